"""`finetune eval RUN_DIR` for a reward model (objective reward): pairwise accuracy, the share of pairs whose
chosen answer scores above the rejected one, for the trained model and for its starting point.

The pairs are the run's training rows (data.validation_split held out when the run had one), or `--data FILE`
with prompt/chosen/rejected rows; each answer is scored as TRL's RewardTrainer scores it in training: prompt +
answer, through the chat template for message rows, the score of the last token. The base is the starting
model with the same (untrained) head for a LoRA run, so 50% is chance. finetune.use.evaluate writes the
result to RUN/eval.json.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional


@dataclass
class PairwiseResult:
    data: str
    held_out: bool
    pairs: int
    accuracy: float
    base_accuracy: Optional[float]
    mean_margin: float
    seconds: float

    def table(self) -> str:
        note = "" if self.held_out else " (not held out: the run trained on them)"
        base = "n/a (full fine-tune: no untrained head to compare)" if self.base_accuracy is None \
            else f"{self.base_accuracy:.1%}"
        return (f"data: {self.data}, {self.pairs} pairs{note}\n"
                f"pairwise accuracy: {self.accuracy:.1%} (chance 50%), base {base}\n"
                f"mean margin (chosen - rejected score): {self.mean_margin:.3f}\n")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def texts(row: dict[str, Any], tokenizer) -> tuple[str, str]:
    """(prompt + chosen, prompt + rejected) as RewardTrainer tokenizes them."""
    from finetune.data.template_budget import render_for

    out = []
    for answer in ("chosen", "rejected"):
        if isinstance(row["prompt"], list):
            out.append(render_for(tokenizer, row["prompt"] + row[answer]))
        else:
            out.append(row["prompt"] + row[answer])
    return out[0], out[1]


def scores(model, tokenizer, rows: list[str], device, batch_size: int) -> list[float]:
    import torch

    out: list[float] = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = tokenizer(rows[start:start + batch_size], return_tensors="pt", padding=True,
                              add_special_tokens=False, padding_side="right")
            logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
            out += logits[:, 0].float().cpu().tolist()
    return out


def pairwise(model, tokenizer, pairs: list[tuple[str, str]], device, batch_size: int) -> tuple[float, float]:
    chosen = scores(model, tokenizer, [c for c, _ in pairs], device, batch_size)
    rejected = scores(model, tokenizer, [r for _, r in pairs], device, batch_size)
    wins = sum(c > r for c, r in zip(chosen, rejected))
    return wins / len(pairs), sum(c - r for c, r in zip(chosen, rejected)) / len(pairs)


def evaluate_reward(run_dir: Path, recipe, data: Optional[Path], device: str, batch_size: int,
                    error: type[Exception]) -> PairwiseResult:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from finetune.rundir.run_dir import resolve_base
    from finetune.data.trl_rows import load_rows
    from finetune.data.tokenize import DataError

    started = time.perf_counter()
    device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device)
    tokenizer = AutoTokenizer.from_pretrained(str(run_dir / "tokenizer"))
    section = recipe.data if data is None else recipe.data.model_copy(update={"path": str(data), "sources": None})
    try:
        rows = load_rows(section, "reward", recipe.training.seed)
    except DataError as exc:
        raise error(str(exc)) from None
    held_out = data is not None
    described = str(data) if data is not None else "the run's training pairs"
    if data is None and recipe.data.validation_split > 0:
        rows = rows.train_test_split(test_size=recipe.data.validation_split, seed=recipe.training.seed)["test"]
        held_out, described = True, "the run's validation split"
    pairs = [texts(rows[i], tokenizer) for i in range(len(rows))]
    if not pairs:
        raise error(f"{described}: no pair to score")
    base_accuracy = None
    if (run_dir / "model").is_dir():
        model = AutoModelForSequenceClassification.from_pretrained(str(run_dir / "model"), dtype=torch.float32)
    elif (run_dir / "adapter").is_dir():
        from peft import PeftModel

        base = AutoModelForSequenceClassification.from_pretrained(resolve_base(recipe),
                                                                  num_labels=1, dtype=torch.float32)
        base.config.pad_token_id = tokenizer.pad_token_id
        model = PeftModel.from_pretrained(base, str(run_dir / "adapter"))
    else:
        raise error(f"{run_dir}: no model/ or adapter/ to evaluate (a ZeRO checkpoint: run `finetune convert` first)")
    model.to(device).eval()
    accuracy, margin = pairwise(model, tokenizer, pairs, device, batch_size)
    if hasattr(model, "disable_adapter"):
        with model.disable_adapter():
            base_accuracy, _ = pairwise(model, tokenizer, pairs, device, batch_size)
    result = PairwiseResult(described, held_out, len(pairs), accuracy, base_accuracy, margin,
                            time.perf_counter() - started)
    return result
