"""The live training display: rank 0's relayed lines drive one progress bar; other lines pass through."""

from __future__ import annotations

import io

from rich.console import Console

from finetune.run.progress import TrainingDisplay, parse_log_line, wanted


def test_relayed_lines_drive_the_bar_and_the_rest_is_printed():
    out = io.StringIO()
    with TrainingDisplay(Console(file=out, force_terminal=True, width=160)) as display:
        display.write(b"[rank0]: [finetune] parameters: 131,072 trainable of 918,656 (lora)\n")
        display.write(b"[rank0]: {'loss': '5.942', 'grad_norm': '2.157', 'learning_rate': '0.003', "
                      b"'train_tokens_per_second': '160.9'}\n[rank0]: progress: step 12/1")  # a line in two writes
        display.write(b"17 (10%), 15 s elapsed, about 135 s left\n")
        task = display.progress.tasks[0]
        assert (task.completed, task.total) == (12, 117) and task.description == "training"
        assert task.fields == {"loss": "5.942", "speed": "161"}
    text = out.getvalue()
    assert "parameters: 131,072 trainable" in text
    # one short line per logging step; the whole dict stays in RUN/logs (issue 24)
    assert "loss 5.9420, lr 0.003, grad norm 2.16" in text and "'loss'" not in text
    assert "progress: step 12/117" not in text  # shown by the bar, not as a line


def test_tokenizing_lines_become_the_status_text():
    out = io.StringIO()
    with TrainingDisplay(Console(file=out, force_terminal=True, width=160)) as display:
        display.write(b"[rank0]: [finetune] tokenizing: 1200/5000 rows\n")
        assert display.progress.tasks[0].description == "tokenizing 1200/5000 rows"
        display.write(b"[rank0]: [finetune] tokenized data: 4990 sequences, 123 tokens -> /c\n")
        assert display.progress.tasks[0].description == "loading model"
    text = out.getvalue()
    assert "tokenizing: 1200/5000 rows" not in text and "tokenized data: 4990 sequences" in text


def test_log_lines_are_recognised_and_only_a_terminal_gets_the_display():
    assert parse_log_line("{'loss': '2.3', 'epoch': '1'}") == {"loss": 2.3, "epoch": 1.0}
    assert parse_log_line("{not python}") is None and parse_log_line("loss 2.3") is None
    assert not wanted(io.StringIO())
