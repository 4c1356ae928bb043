"""finetune.train.memory_trace: the allocations live at the peak of the allocator's recorded history, grouped by the
code that made them (the harness's memory rows on a GPU; here the replay, on events shaped as torch writes them)."""

from __future__ import annotations

from finetune.train import memory_trace
from finetune.train.memory_trace import owner, peak_summary

MODEL = {"filename": "/venv/lib/python3.11/site-packages/transformers/models/llama/modeling_llama.py", "line": 91,
         "name": "forward"}
LOSS = {"filename": "/venv/lib/python3.11/site-packages/transformers/loss/loss_utils.py", "line": 36,
        "name": "fixed_cross_entropy"}
TORCH = {"filename": "/venv/lib/python3.11/site-packages/torch/nn/functional.py", "line": 2900, "name": "linear"}


def alloc(addr, size, *frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames), "stream": 0}


def free(addr, size):
    return {"action": "free_requested", "addr": addr, "size": size, "frames": [], "stream": 0}


def test_the_peak_is_the_highest_point_and_its_groups_are_what_was_live_there():
    events = [alloc(1, 100, TORCH, MODEL), alloc(2, 50, TORCH, MODEL), free(1, 100),  # 150 then 50
              alloc(3, 400, LOSS), alloc(4, 30),  # 480: the peak (2, 3, 4 live)
              {"action": "free_completed", "addr": 1, "size": 100, "frames": []},  # not a second free
              free(3, 400), alloc(5, 60, MODEL)]  # 140 after it
    summary = peak_summary(events, baseline_bytes=1000)
    assert summary["peak_above_baseline_bytes"] == 480 and summary["peak_bytes"] == 1480
    assert summary["live_at_peak"] == 3 and summary["other_bytes"] == 0 and not summary["truncated"]
    assert summary["groups"] == [
        {"owner": "transformers/loss/loss_utils.py:36 fixed_cross_entropy", "bytes": 400, "blocks": 1},
        {"owner": "transformers/models/llama/modeling_llama.py:91 forward", "bytes": 50, "blocks": 1},
        {"owner": memory_trace.owner([]), "bytes": 30, "blocks": 1}]


def test_groups_beyond_the_top_are_summed():
    events = [alloc(i, 10 + i, {"filename": f"/x/m{i}.py", "line": i, "name": "f"}) for i in range(5)]
    summary = peak_summary(events, top=2)
    assert [g["bytes"] for g in summary["groups"]] == [14, 13] and summary["other_bytes"] == 10 + 11 + 12


def test_the_owner_skips_torchs_frames_and_says_when_there_is_none():
    assert owner([TORCH, MODEL]) == "transformers/models/llama/modeling_llama.py:91 forward"
    assert owner([TORCH]) == "torch/nn/functional.py:2900 linear"  # nothing but torch: its innermost frame
    assert "autograd" in owner([])


def test_nothing_is_recorded_without_cuda(monkeypatch, tmp_path):
    monkeypatch.setenv(memory_trace.ENV, str(tmp_path / "peak.json"))
    assert memory_trace.wanted() is None  # this machine has no GPU: the runner adds no callback
    monkeypatch.setenv("RANK", "1")
    assert memory_trace.wanted() is None


def test_a_recording_that_cannot_start_is_written_down_and_training_goes_on(tmp_path):
    """torch's history API is private: where it fails (here: no CUDA at all) the callback writes why and returns."""
    from types import SimpleNamespace

    path = tmp_path / "peak.json"
    trace = memory_trace.callback(path)
    trace.on_train_begin(None, SimpleNamespace(global_step=0), None)
    trace.on_step_end(None, SimpleNamespace(global_step=2), None)  # nothing recorded: nothing more happens
    import json

    assert json.loads(path.read_text())["error"].startswith("recording did not start: ")


def test_a_library_under_a_folder_named_torch_is_not_plumbing():
    """The GPU image keeps its environment in /opt/torch/.venv: only torch's own package is skipped."""
    def under_opt_torch(frame):
        return {**frame, "filename": frame["filename"].replace("/venv/lib/python3.11", "/opt/torch/.venv/lib/python3.12")}
    assert owner([under_opt_torch(TORCH), under_opt_torch(MODEL)]) == \
        "transformers/models/llama/modeling_llama.py:91 forward"
    stdlib = {"filename": "/usr/lib/python3.12/contextlib.py", "line": 81, "name": "inner"}
    assert owner([stdlib, under_opt_torch(LOSS)]) == "transformers/loss/loss_utils.py:36 fixed_cross_entropy"
