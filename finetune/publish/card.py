"""The model card (README.md) of a published run, merged model or GGUF export, written with huggingface_hub's
ModelCard / ModelCardData / EvalResult (the metadata keys the Hub reads: base_model, base_model_relation,
library_name, datasets, license, tags, model-index).

The body says what the Hub's metadata cannot: the exact prompt the model trained on, the run's numbers and loss plot,
the scores against the base, how to serve it from this repository, and the recipe (local paths and secrets removed).
"""

from __future__ import annotations

from typing import Any, Optional

from finetune.publish.contents import Publication, base_hub_id

_WHAT = {"adapter": "a LoRA adapter", "model": "a fine-tuned model", "gguf": "a GGUF file"}


def card_text(pub: Publication, repo_id: str) -> str:
    from huggingface_hub import ModelCard

    data = card_data(pub, repo_id)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body(pub, repo_id)}").content


def card_data(pub: Publication, repo_id: str):
    from huggingface_hub import ModelCardData

    base = _base(pub)
    tags = ["finetune", *([pub.recipe.method, pub.recipe.objective] if pub.recipe is not None else [])]
    if pub.kind == "gguf":
        tags += ["gguf", str(pub.export.get("type", ""))]
    extra: dict[str, Any] = {}
    if base and pub.relation:
        extra["base_model_relation"] = pub.relation
    results = eval_results(pub)
    return ModelCardData(base_model=base, library_name=pub.library, license=base_license(base),
                         datasets=dataset_ids(pub.recipe) or None, tags=[t for t in tags if t],
                         model_name=repo_id.split("/")[-1] if results else None,
                         eval_results=results or None, **extra)


def _base(pub: Publication) -> Optional[str]:
    if pub.kind == "gguf":
        return pub.export.get("base_model") or None
    return base_hub_id(pub.recipe)


def dataset_ids(recipe) -> list[str]:
    """The recipe's data sources that are hub data sets (local files are not named)."""
    if recipe is None:
        return []
    from finetune.data.sources import sources_of
    from finetune.recipe.references import is_local

    return sorted({s.path for s in sources_of(recipe.data, recipe.objective) if not is_local(s.path)})


def base_license(base: Optional[str]) -> Optional[str]:
    """The base model's licence from its model card in the local Hugging Face cache (never fetched)."""
    if not base:
        return None
    from huggingface_hub import ModelCard, try_to_load_from_cache

    path = try_to_load_from_cache(base, "README.md")
    if not isinstance(path, str):
        return None
    try:
        license_ = ModelCard.load(path).data.license
    except (OSError, ValueError):
        return None
    return license_ if isinstance(license_, str) else None


def eval_results(pub: Publication) -> list:
    """model-index entries: the fine-tuned model's scores (finetune eval; --tasks: lm-eval's metrics)."""
    from huggingface_hub import EvalResult

    out = []
    evals = pub.evals or {}
    tuned = evals.get("tuned")
    if isinstance(tuned, dict) and isinstance(tuned.get("loss"), (int, float)):
        name = "validation split" if evals.get("held_out") else "training data (not held out)"
        for metric in ("loss", "perplexity"):
            out.append(EvalResult(task_type="text-generation", dataset_type="finetune-eval", dataset_name=name,
                                  metric_type=metric, metric_value=float(tuned[metric])))
    for task, entry in ((evals.get("benchmarks") or {}).get("tasks") or {}).items():
        for metric, values in (entry.get("metrics") or {}).items():
            value = values.get("fine_tuned")
            if isinstance(value, (int, float)):
                out.append(EvalResult(task_type="text-generation", dataset_type=task, dataset_name=task,
                                      metric_type=metric, metric_value=float(value)))
    return out


# ------------------------------------------------------------------------------------------------
# The body


def body(pub: Publication, repo_id: str) -> str:
    base = _base(pub)
    local_base = pub.recipe.model.name_or_path if pub.recipe is not None and not base else None
    what = _WHAT[pub.kind] + (f" ({pub.export.get('type')}, for llama.cpp, Ollama and LM Studio)" if pub.kind == "gguf" else "")
    origin = (f"[{base}](https://huggingface.co/{base})" if base else
              f"`{local_base}` (a local or built-in model, not on the Hub)" if local_base else "its base model")
    known = pub.recipe is not None or pub.kind == "gguf"
    intro = f"{what} fine-tuned from {origin} with finetune." if known else f"{what}."
    parts = [f"# {pub.name}", "", intro[0].upper() + intro[1:], ""]
    parts += _prompt_section(pub)
    parts += _training_section(pub)
    parts += _eval_section(pub)
    parts += _serve_section(pub, repo_id, base)
    if pub.recipe_yaml:
        parts += ["## Recipe", "", "`finetune_recipe.yaml` in this repository, as the run resolved it (local paths "
                  "reduced to file names, secrets removed):", "", "```yaml", pub.recipe_yaml.rstrip(), "```", ""]
    return "\n".join(parts)


def _prompt_section(pub: Publication) -> list[str]:
    from finetune.data.formats import alpaca_prompt, chat_format

    fmt = chat_format(pub.recipe) if pub.recipe is not None else pub.export.get("prompt")
    lines = ["## Prompt format", ""]
    if fmt == "alpaca":
        lines += ["The model trained on the Alpaca prompt: BOS, then this text, then the reply and EOS "
                  "(one turn after another for a conversation):", "", "```", alpaca_prompt("{instruction}").rstrip("\n"),
                  "```", ""]
    elif fmt == "messages":
        lines += ["The model trained on chat messages rendered with this chat template:", ""]
    elif fmt == "text":
        lines += ["The model trained on plain text: prompt it with text to continue (no chat template).", ""]
    else:
        lines += ["The prompt format is not recorded with this model.", ""]
    if pub.template is not None and fmt != "text":
        where = ("`trained_chat_template.jinja` in this repository, for servers' `--chat-template`" if pub.item(
            "trained_chat_template.jinja") else "the tokenizer's chat template")
        lines += [f"As a Jinja chat template, {where}:", "", "```jinja", pub.template.strip(), "```", ""]
    if pub.kind == "gguf":
        lines += ["The GGUF carries this prompt as `tokenizer.chat_template`; the Modelfile's TEMPLATE is the same "
                  "prompt for Ollama. Replies end at: " + ", ".join(f"`{s}`" for s in pub.export.get("stops") or []), ""]
    return lines


def _training_section(pub: Publication) -> list[str]:
    recipe, summary = pub.recipe, pub.summary
    if recipe is None:
        return []
    lora = recipe.lora
    method = recipe.method + (f" (r {lora.r}, alpha {lora.alpha:g}{', rsLoRA' if lora.rslora else ''}"
                              f"{', DoRA' if lora.dora else ''}, {_targets(lora.target_modules)})"
                              if recipe.method in ("lora", "qlora") else "")
    rows = [("method", method), ("objective", recipe.objective),
            ("data", ", ".join(dataset_ids(recipe)) or "local data (not published)"),
            ("max length", str(recipe.data.max_length)), ("learning rate", f"{recipe.training.learning_rate:g}")]
    if summary:
        rows += [("steps", str(summary.get("steps", "n/a"))),
                 ("train loss, first -> last", f"{_num(summary.get('train_loss_first'))} -> {_num(summary.get('train_loss_last'))}"),
                 ("tokens trained", f"{summary.get('tokens_trained', 0):,}"),
                 ("wall time", f"{_num(summary.get('wall_seconds'), '.0f')} s on {summary.get('world_size', 'n/a')} "
                               f"process(es), DeepSpeed ZeRO stage {summary.get('zero_stage', 'n/a')}")]
    lines = ["## Training", "", "| | |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in rows] + [""]
    from finetune.rundir.names import PLOT_FILE

    if pub.item(PLOT_FILE) is not None:
        lines += [f"![train loss and learning rate]({PLOT_FILE})", ""]
    return lines


def _eval_section(pub: Publication) -> list[str]:
    evals = pub.evals or {}
    lines = []
    if isinstance(evals.get("tuned"), dict) and "loss" in evals["tuned"]:
        lines += [f"Loss and perplexity on {_cell(_scrubbed(evals.get('data')))} (`finetune eval`):", "",
                  "| model | loss | perplexity |", "|---|---|---|",
                  f"| base | {_num(evals['base'].get('loss'))} | {_num(evals['base'].get('perplexity'), '.2f')} |",
                  f"| fine-tuned | {_num(evals['tuned'].get('loss'))} | {_num(evals['tuned'].get('perplexity'), '.2f')} |", ""]
    bench = evals.get("benchmarks") or {}
    if bench.get("tasks"):
        lines += [f"lm-evaluation-harness {bench.get('lm_eval')} (`finetune eval --tasks`, prompted as the model "
                  "trained):", "", "| task | metric | base | fine-tuned |", "|---|---|---|---|"]
        for task, entry in bench["tasks"].items():
            for metric, v in (entry.get("metrics") or {}).items():
                lines.append(f"| {_cell(task)} | {_cell(metric)} | {_num(v.get('base'))} | {_num(v.get('fine_tuned'))} |")
        lines.append("")
    return ["## Evaluation", "", *lines] if lines else []


def _serve_section(pub: Publication, repo_id: str, base: Optional[str]) -> list[str]:
    from finetune.serve import hub_steps

    steps = hub_steps(pub.kind, pub.name, repo_id, base, pub.adapter_config,
                      template=pub.item("trained_chat_template.jinja") is not None)
    commands = [f"{command}  # {why}" for command, why in steps if not command.startswith("#")]
    notes = [f"{command.lstrip('# ')}: {why}." for command, why in steps if command.startswith("#")]
    if not steps:
        return []
    return ["## Use it", "", *notes, *(["```bash", *commands, "```"] if commands else []), ""]


def _targets(value: Any) -> str:
    return value if isinstance(value, str) else ", ".join(map(str, value or []))


def _scrubbed(text: Any) -> str:
    from finetune.publish.scrub import looks_local

    words = str(text or "the run's data").split()
    return " ".join("(local file)" if looks_local(w.strip("()")) else w for w in words)


def _cell(value: Any) -> str:
    return str(value).replace("<", "&lt;").replace("|", "\\|")


def _num(value: Any, spec: str = ".4f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "n/a"
