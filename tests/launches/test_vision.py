"""A vision-language model trained by `finetune train` (issue 38): ZeRO-3 on 2 processes where one rank's micro batch
has no image finishes (the tower guard), with the losses of a 1-process run of the same rows; the 1-process run's
adapter then chats about an image and merges.

One image row among text rows, micro batch 1: each step's two rows put the image on one rank only. Without the
guard this run stops at the collective timeout (ZeRO-3's trace check, then a gather, wait for the other rank).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from finetune.builtin_vision import QUESTION, colour_rows
from tests.conftest import FINETUNE, REPO
from finetune.run.launch.commands import free_port
from tests.train_fixtures import runner_env

RECIPE = REPO / "recipes" / "tiny" / "vlm_qwen_lora_zero3.yaml"


def train(out, data, cache, *sets: str, timeout: float = 300) -> subprocess.CompletedProcess:
    argv = [*FINETUNE, "train", str(RECIPE), "--output-dir", str(out), "--master-port", str(free_port()),
            "--set", f"data.path={data}", "--set", "training.max_steps=4", "--set", "launch.nccl_timeout=120", *sets]
    result = subprocess.run(argv, cwd=REPO, env=runner_env(cache), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def losses(run) -> list[float]:
    return [entry["loss"] for entry in json.loads((run / "summary.json").read_text())["loss_history"]]


def test_zero3_with_an_image_on_one_rank_finishes_and_matches_one_process(tmp_path, tiny_cache):
    rows = colour_rows(tmp_path, 1, seed=5, text_rows=3)
    data = tmp_path / "one_image.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    two, one = tmp_path / "two", tmp_path / "one"
    train(two, data, tiny_cache)
    train(one, data, tiny_cache, "--set", "launch.procs_per_node=1", "--set", "training.gradient_accumulation_steps=2")
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert sum(summary["tower_guard_dummy_forwards"]) >= 4  # two epochs of 3 text rows: a dummy image each
    assert losses(two) == pytest.approx(losses(one), abs=1e-5)

    # the 1-process run's adapter, as `finetune chat RUN --image` and `finetune merge RUN` use it (in this process:
    # two more interpreters would cost the suite 20 s)
    from finetune.use.chat import answer, load_chat_model, resolve_source
    from finetune.use.conversation import Conversation
    from finetune.use.images import ImageError, checked_images
    from finetune.weights.merge import merge
    from finetune.weights.merge_inputs import resolve_inputs

    chat = load_chat_model(resolve_source(one), "cpu")
    image = checked_images([str(tmp_path / rows[0]["images"][0])], chat.vision)
    reply = answer(chat, Conversation(chat.tokenizer, chat.fmt, vision=chat.vision), QUESTION, max_new_tokens=3,
                   images=tuple(image))
    text_only = Conversation(chat.tokenizer, chat.fmt, vision=chat.vision).prompt_ids(QUESTION)
    assert reply.prompt_tokens >= len(text_only) + 3  # vision start, end and the image's own tokens
    with pytest.raises(ImageError, match="no such file"):
        checked_images([str(tmp_path / "nothing.png")], chat.vision)
    from finetune.use.evaluate import evaluate

    scored = evaluate(one, data=data, device="cpu", log=lambda line: None)  # `finetune eval RUN --data`: image rows
    assert scored.sequences == 4 and scored.tuned.loss < scored.base.loss
    inputs = resolve_inputs(one, None, None)
    merge(inputs.base, inputs.adapter, tmp_path / "merged", source_dirs=inputs.tokenizer_dirs)
    assert (tmp_path / "merged" / "preprocessor_config.json").is_file()  # the processor as the run trained it


@pytest.mark.full
def test_the_tiny_llava_recipe_learns_the_colours(tmp_path, tiny_cache):
    """recipes/tiny/vlm_llava_full.yaml as README shows it: 24 steps on 2 processes, then chat names each colour."""
    from finetune.builtin_vision import COLOURS

    out = tmp_path / "llava"
    argv = [*FINETUNE, "train", str(REPO / "recipes" / "tiny" / "vlm_llava_full.yaml"), "--output-dir", str(out),
            "--master-port", str(free_port())]
    result = subprocess.run(argv, cwd=REPO, env=runner_env(tiny_cache), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    from finetune.use.chat import answer, load_chat_model, resolve_source
    from finetune.use.conversation import Conversation

    chat = load_chat_model(resolve_source(out), "cpu")
    for colour in COLOURS:
        image = str(REPO / "recipes" / "data" / "images" / f"{colour}_28x28.png")
        reply = answer(chat, Conversation(chat.tokenizer, chat.fmt, vision=chat.vision), QUESTION, max_new_tokens=3,
                       images=(image,))
        assert reply.text.strip() == colour
