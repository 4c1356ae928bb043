"""`finetune eval RUN_DIR`: loss and perplexity of the base model and of the fine-tuned one.

Both are measured on the same sequences, tokenized and masked exactly as the run trained
(finetune.data.tokenize: the prompt is not scored when data.mask_prompt is true), so the two numbers
compare the models and nothing else. The data is the run's validation split (the same seeded
hold-out the trainer evaluated on), or `--data FILE`, read as the run's source with that path, in
`--format`, or as the run's only source; a run without a validation split is measured on its training data, and the table says so.

Loss is the mean cross-entropy per scored token over all sequences (not a mean of batch means), and
perplexity is exp(loss). The result goes to RUN/eval.json, or RUN/eval-<FILE's name>.json for --data FILE
(a second data set never overwrites the first's numbers).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from finetune import objectives
from finetune.errors import FinetuneError
from finetune.rundir.names import BENCHMARKS_KEY, EVAL_FILE, SUMMARY_FILE


def eval_file(data: Optional[Path]) -> str:
    """RUN/eval.json for the run's own data; eval-<stem>.json for --data FILE (issue 24)."""
    if data is None:
        return EVAL_FILE
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(data).stem) or "data"
    return f"eval-{stem}.json"


class EvalError(FinetuneError, ValueError):
    """The run or the data cannot be evaluated: the message says why."""


@dataclass
class Score:
    loss: float
    perplexity: float
    tokens: int


@dataclass
class EvalResult:
    data: str  # what was measured: "validation split (N sequences)", a file, ...
    held_out: bool
    sequences: int
    base: Score
    tuned: Score
    seconds: float

    def table(self) -> str:
        rows = [("model", "loss", "perplexity"),
                ("base", f"{self.base.loss:.4f}", f"{self.base.perplexity:.2f}"),
                ("fine-tuned", f"{self.tuned.loss:.4f}", f"{self.tuned.perplexity:.2f}")]
        lines = [f"{a:<12}{b:>10}{c:>14}" for a, b, c in rows]
        note = "" if self.held_out else " (not held out: the run trained on it)"
        return (f"data: {self.data}, {self.sequences} sequences, {self.tuned.tokens} scored tokens{note}\n"
                + "\n".join(lines) + "\n")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def score(model, rows: list[dict[str, list[int]]], collator, device, batch_size: int = 8) -> Score:
    """Token-weighted mean cross-entropy of `rows` (input_ids + labels, IGNORE_INDEX not scored)."""
    import torch

    from finetune.data.tokenize import IGNORE_INDEX

    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = {k: v.to(device) for k, v in collator(rows[start:start + batch_size]).items()}
            labels = batch.pop("labels")
            logits = model(**batch, use_cache=False).logits.float()
            # position t predicts token t + 1, as in transformers' ForCausalLMLoss
            shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
            loss = torch.nn.functional.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)),
                                                     shift_labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
            total += float(loss)
            count += int((shift_labels != IGNORE_INDEX).sum())
    if count == 0:
        raise EvalError("no token to score (every label is masked)")
    mean = total / count
    return Score(loss=mean, perplexity=math.exp(min(mean, 700.0)), tokens=count)


def file_spec(data: Path, recipe_data: Any, fmt: Optional[str] = None, vision: Optional[dict] = None):
    """How to read `--data FILE`: as the run's source with the same path (format, columns, roles), in
    --format when given, else as the only way the run's sources are read; ambiguous is an EvalError.
    `vision` (finetune.data.images.vision_data): a VLM's rows, read with their images beside FILE."""
    from finetune.data.formats import FORMATS, RowSpec
    from finetune.data.sources import sources_of
    from finetune.recipe.references import is_local

    if vision:
        from finetune.data.images import with_images

        spec = file_spec(data, recipe_data, fmt)
        return with_images(spec, str(data), vision)
    sources = sources_of(recipe_data)
    same = [s.spec for s in sources if is_local(s.path) and _same_file(Path(s.path), Path(data))]
    if fmt is not None:
        if fmt not in FORMATS:
            raise EvalError(f"--format {fmt}: unknown format (known: {', '.join(FORMATS)})")
        return next((spec for spec in same if spec.format == fmt), RowSpec(fmt))
    if same:
        return same[0]
    specs = [s.spec for i, s in enumerate(sources) if s.spec not in [t.spec for t in sources[:i]]]
    if len(specs) == 1:
        return specs[0]
    read_as = ", ".join(f"{s.name}: {s.format}" for s in sources)
    raise EvalError(f"--data {data}: not one of the run's sources, which are read differently ({read_as}); "
                    f"say how to read the file with --format ({'|'.join(FORMATS)})")


def check_data_file(data: Path, recipe, fmt: Optional[str] = None) -> None:
    """--data FILE read row by row as preflight reads a run's data (finetune.data.validate: lines of at most
    64 MiB, nesting bounded, every row converted), before any model loads: a 6 GB file without a newline is one
    line here, where datasets' JSON reader ran 12 minutes (issue 34)."""
    from finetune.data.sources import Source, sources_of
    from finetune.data.validate import validate

    if objectives.get(recipe.objective).score_head:  # finetune.use.reward_eval reads the file as the run's pairs
        sources = sources_of(recipe.data.model_copy(update={"path": str(data), "sources": None}), "reward")
    else:
        sources = [Source(str(data), "train", file_spec(data, recipe.data, fmt))]
    checked = validate(sources)
    if not checked.ok:
        shown = checked.messages()
        more = f" (and {checked.total - 1} more problem(s) in {data})" if checked.total > 1 else ""
        raise EvalError(f"--data {shown[0]}{more}")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.expanduser().resolve() == b.expanduser().resolve()
    except OSError:
        return False


def eval_rows(run_dir: Path, recipe, tokenizer, data: Optional[Path], log: Callable[[str], None],
              fmt: Optional[str] = None):
    """(rows, description, held out?) of the sequences to score."""
    from finetune.data.cache_root import tokenized_root
    from finetune.data.prepare import tokenize_for_training
    from finetune.data.tokenize import DataError, load_raw, split_eval, tokenize_examples

    if not objectives.get(recipe.objective).perplexity and data is None:
        raise EvalError(f"{run_dir} trained with objective: {recipe.objective}: its preference rows have no loss to "
                        f"score; {SUMMARY_FILE} holds its rewards (pass --data FILE with SFT rows to score those)")
    from finetune.data.sources import describe
    from finetune.data.spec import DataSpec

    data_spec = DataSpec.of(recipe)
    try:
        if data is not None:
            spec = file_spec(data, recipe.data, fmt, data_spec.vision)
            from finetune.data.vision_encode import undecoded

            raw = undecoded(load_raw(str(data)), spec)
            rows = tokenize_examples(raw, tokenizer, spec.format, data_spec.max_length, data_spec.mask_prompt,
                                     spec=spec, think=data_spec.think)
            return rows, str(data), True
        dataset = tokenize_for_training(data_spec, tokenizer, tokenized_root(), log=lambda s: None)
        train, held = split_eval(dataset, recipe.data.validation_split, recipe.training.seed)
    except DataError as exc:
        raise EvalError(str(exc)) from None
    if held is not None:
        return [dict(r) for r in held], "the run's validation split", True
    log(f"note: {run_dir} has no validation split (data.validation_split: 0); scoring its training data")
    return [dict(r) for r in train], f"the training data ({describe(recipe.data)})", False


def evaluate(run_dir: Path, data: Optional[Path] = None, device: str = "auto", batch_size: int = 8,
             log: Callable[[str], None] = print, fmt: Optional[str] = None) -> Any:
    """EvalResult (loss and perplexity); for a reward model, finetune.use.reward_eval.PairwiseResult."""
    from finetune.use.chat import ChatError, load_chat_model, resolve_source
    from finetune.rundir.errors import RunDirError
    from finetune.rundir.run_dir import RunDir
    from finetune.data.packing import Collator

    run_dir = Path(run_dir)
    try:
        run_recipe = RunDir(run_dir).require().recipe()  # the one reader of a run's recipe (finetune.rundir)
    except RunDirError as exc:
        raise EvalError(str(exc)) from None
    if data is not None and not Path(data).is_file():
        raise EvalError(f"--data {data}: no such file")
    if data is not None:
        check_data_file(Path(data), run_recipe, fmt)
    started = time.perf_counter()
    if objectives.get(run_recipe.objective).score_head:  # a reward model: pairwise accuracy (finetune.use.reward_eval)
        from finetune.use.reward_eval import evaluate_reward

        from finetune.fsutil import write_atomic

        pairwise = evaluate_reward(run_dir, run_recipe, data, device, batch_size, EvalError)
        write_atomic(run_dir / EVAL_FILE, json.dumps(pairwise.to_json(), indent=2) + "\n")
        return pairwise
    try:
        source = resolve_source(run_dir)
        if data is not None:
            file_spec(data, source.recipe.data, fmt)  # an ambiguous file fails before the models load
        log(f"loading {source.label} ...")  # seconds to a minute: say so (issue 24)
        chat = load_chat_model(source, device)
    except ChatError as exc:
        raise EvalError(str(exc)) from None
    recipe = source.recipe
    rows, described, held_out = eval_rows(run_dir, recipe, chat.tokenizer, data, log, fmt)
    if not rows:
        raise EvalError(f"{described}: no sequence to score")
    pad = chat.tokenizer.pad_token_id if chat.tokenizer.pad_token_id is not None else chat.tokenizer.eos_token_id
    collator = Collator(pad, always_mask=True)
    if chat.vision is not None:  # a VLM's rows: their pixels too, through the run's image processor
        from finetune.train.vlm_collator import VisionCollator

        collator = VisionCollator(chat.vision.processor, chat.vision.vm, pad)
    tuned = score(chat.model, rows, collator, chat.device, batch_size)
    base = _base_score(chat, source, rows, collator, batch_size)
    result = EvalResult(data=described, held_out=held_out, sequences=len(rows), base=base, tuned=tuned,
                        seconds=time.perf_counter() - started)
    write_record(run_dir / eval_file(data), result.to_json())
    return result


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Write an eval record; the benchmarks `finetune eval --tasks` put in eval.json stay (and the other way round)."""
    from finetune.fsutil import write_atomic

    try:
        earlier = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        earlier = {}
    if isinstance(earlier, dict):
        keep = {BENCHMARKS_KEY} if BENCHMARKS_KEY not in record else set(earlier) - {BENCHMARKS_KEY}
        record = {**{k: v for k, v in earlier.items() if k in keep}, **record}
    write_atomic(path, json.dumps(record, indent=2) + "\n")


def _base_score(chat, source, rows, collator, batch_size: int) -> Score:
    """The adapter switched off (LoRA), or the base model loaded beside the full fine-tune."""
    if source.adapter is not None:
        with chat.model.disable_adapter():
            return score(chat.model, rows, collator, chat.device, batch_size)
    from finetune.rundir.run_dir import resolve_base
    from finetune.use.chat import Source, load_chat_model

    recipe = source.recipe
    base = load_chat_model(Source(model=resolve_base(recipe), recipe=recipe, fmt=recipe.data.format,
                                  tokenizer=source.tokenizer, label="base"), chat.device)
    return score(base.model, rows, collator, chat.device, batch_size)
