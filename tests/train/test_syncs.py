"""finetune.train.syncs: the census counts the calls that make a GPU's host wait, and where they are made."""

from __future__ import annotations

import pytest

from finetune.train.dist import host_side
from finetune.train.syncs import Census, _leaves_the_device, summary_lines


def test_the_census_counts_host_reads_by_the_line_that_makes_them():
    import torch

    x = torch.ones(4, requires_grad=True)
    with Census() as census:
        for _ in range(3):
            y = (x * 2).sum()
            y.item()  # one host read
            if torch.isfinite(y):  # __bool__: another
                pass
        x.detach()[x.detach() > 1].numel()  # a boolean mask: its size is a device value
        (x * 3).sum().backward()  # no host read
    result = census.result(steps=3)
    calls = {s["call"]: s for s in result["host_syncs"]["sites"]}
    assert set(calls) == {"item", "__bool__", "__getitem__"}
    assert calls["item"]["per_step"] == calls["__bool__"]["per_step"] == 1
    assert result["host_syncs"]["per_step"] == pytest.approx(7 / 3)
    assert calls["item"]["site"].startswith("tests/train/test_syncs.py:") and "test_the_census_counts" in calls["item"]["site"]
    assert result["collectives"] == result["host_side"] == {"per_step": 0, "sites": []}
    with torch.no_grad():  # closed: nothing more is counted
        (x * 2).sum().item()
    assert census.result(3) == result
    assert summary_lines(result)[0] == f"host syncs per step: {7 / 3:g}"


def test_a_read_inside_torch_names_the_caller_and_torchs_line():
    import torch

    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    optimizer = torch.optim.Adam([param], foreach=False)  # the for-loop step reads its step count on the host
    optimizer.step()
    with Census() as census:
        optimizer.step()
    site = census.result(1)["host_syncs"]["sites"][0]["site"]
    assert site.startswith("tests/train/test_syncs.py:") and "(via torch/optim/" in site


def test_collectives_are_counted_and_torch_distributed_is_restored(tmp_path):
    import torch
    import torch.distributed as dist

    original = dist.all_reduce
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        with Census() as census:
            dist.all_reduce(torch.ones(2))
            dist.barrier()
            flag = host_side(torch.zeros(1, dtype=torch.int32))  # the stop flag's way: a host tensor by design
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            flag[0].item()
        assert dist.all_reduce is original
    finally:
        dist.destroy_process_group()
    result = census.result(1)
    assert sorted(s["call"] for s in result["collectives"]["sites"]) == ["all_reduce", "barrier"]
    assert all(s["site"].startswith("tests/train/test_syncs.py:") for s in result["collectives"]["sites"])
    assert result["host_syncs"]["per_step"] == 0
    assert sorted(s["call"] for s in result["host_side"]["sites"]) == ["all_reduce", "item"]


def test_copies_to_the_host_count_only_from_a_device():
    import torch

    on_cpu, elsewhere = torch.ones(2), torch.empty(2, device="meta")
    assert not _leaves_the_device("cpu", (on_cpu,), {})
    assert _leaves_the_device("cpu", (elsewhere,), {}) and _leaves_the_device("numpy", (elsewhere,), {})
    assert _leaves_the_device("to", (elsewhere, "cpu"), {}) and _leaves_the_device("to", (elsewhere,), {"device": "cpu"})
    assert not _leaves_the_device("to", (elsewhere, "cpu"), {"non_blocking": True})
    assert not _leaves_the_device("to", (elsewhere, torch.float16), {})
