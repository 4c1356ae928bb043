"""Where a trained model is served, and the one function that says what to do after `train`, `merge` and `export`.

What each server accepts of a PEFT LoRA adapter, each rule with the server's version and file it was read from
(issue 36). An adapter that uses something a server refuses or ignores gets "merge first" with the reason, never
a command that would serve something other than what was trained.

No torch, no transformers: `finetune train` prints these after the ranks exit, and lint's import graph stays light.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from finetune import objectives

# vllm/config/lora.py (v0.26.0): `MaxLoRARanks = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]`;
# --max-lora-rank must be one of them and at least the adapter's largest rank (peft_helper.validate_legal).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
TRAINED_TEMPLATE = "trained_chat_template.jinja"  # the trained prompt, where it differs from the tokenizer's


@dataclass(frozen=True)
class AdapterFacts:
    """What servers look at in adapter_config.json."""
    rank: int
    max_rank: int            # with rank_pattern
    alpha: float
    rslora: bool = False
    dora: bool = False
    lora_bias: bool = False
    bias: str = "none"
    modules_to_save: tuple[str, ...] = ()
    alpha_pattern: bool = False
    rank_pattern: bool = False
    init: Any = True

    @property
    def alpha_is_integer(self) -> bool:
        return float(self.alpha).is_integer()


def adapter_facts(config: dict) -> AdapterFacts:
    rank = int(config.get("r") or 8)
    ranks = [rank, *[int(v) for v in (config.get("rank_pattern") or {}).values()]]
    return AdapterFacts(
        rank=rank, max_rank=max(ranks), alpha=float(config.get("lora_alpha") or 8),
        rslora=bool(config.get("use_rslora")), dora=bool(config.get("use_dora")),
        lora_bias=bool(config.get("lora_bias")), bias=str(config.get("bias") or "none"),
        modules_to_save=tuple(config.get("modules_to_save") or ()),
        alpha_pattern=bool(config.get("alpha_pattern")), rank_pattern=bool(config.get("rank_pattern")),
        init=config.get("init_lora_weights", True))


@dataclass(frozen=True)
class Rule:
    server: str
    applies: Callable[[AdapterFacts], bool]
    effect: str       # what the server does with such an adapter
    source: str       # version and file the rule was read from


_VLLM = "vLLM main, vllm/lora/peft_helper.py (_validate_features, validate_legal)"
_SGLANG = "SGLang, python/sglang/srt/lora/lora.py (LoRAAdapter: scaling = lora_alpha / r, stacks lora_A/lora_B)"
_LLAMA = ("llama.cpp 0c1e57098 (llama-cpp-python 0.3.36), convert_lora_to_gguf.py and src/llama-graph.cpp "
          "(scale = alpha / rank, one alpha per adapter)")
_OLLAMA = "Ollama, convert/convert.go (AdapterParameters.Alpha uint32 `json:\"lora_alpha\"`; llama and gemma2 only)"

RULES = (
    Rule("vllm", lambda a: a.dora, "refuses DoRA", _VLLM),
    Rule("vllm", lambda a: a.lora_bias, "refuses lora_bias", _VLLM),
    Rule("vllm", lambda a: a.bias != "none", "refuses bias other than none", _VLLM),
    Rule("vllm", lambda a: any(m not in ("classifier", "score") for m in a.modules_to_save),
         "refuses modules_to_save other than classifier/score", _VLLM),
    Rule("vllm", lambda a: isinstance(a.init, str) and a.init.lower() not in ("gaussian", "eva", "orthogonal", "mica", "lora_ga"),
         "refuses inits that change the base weights (PiSSA, OLoRA, LoftQ...)", _VLLM),
    Rule("vllm", lambda a: a.max_rank > VLLM_MAX_LORA_RANKS[-1],
         f"accepts ranks up to {VLLM_MAX_LORA_RANKS[-1]} (--max-lora-rank from {{{', '.join(map(str, VLLM_MAX_LORA_RANKS))}}})",
         "vLLM v0.26.0, vllm/config/lora.py (MaxLoRARanks)"),
    Rule("sglang", lambda a: a.rslora, "ignores rsLoRA (scales by alpha / r, not alpha / sqrt(r))", _SGLANG),
    Rule("sglang", lambda a: a.alpha_pattern or a.rank_pattern, "ignores alpha_pattern / rank_pattern (one scaling)", _SGLANG),
    Rule("sglang", lambda a: a.dora, "ignores DoRA's magnitude vectors", _SGLANG),
    Rule("sglang", lambda a: bool(a.modules_to_save) or a.lora_bias, "ignores modules_to_save and lora_bias", _SGLANG),
    Rule("llama.cpp", lambda a: a.rslora, "ignores rsLoRA unless alpha is scaled by sqrt(r) (portable_adapter_config)", _LLAMA),
    Rule("llama.cpp", lambda a: a.alpha_pattern, "ignores alpha_pattern (one alpha per adapter)", _LLAMA),
    Rule("llama.cpp", lambda a: a.dora or a.lora_bias, "refuses DoRA and lora_bias tensors (not lora_A/lora_B)", _LLAMA),
    Rule("llama.cpp", lambda a: bool(a.modules_to_save), "refuses modules_to_save (lm_head/embeddings in the adapter)", _LLAMA),
    Rule("ollama", lambda a: not a.alpha_is_integer, "reads lora_alpha as an unsigned integer: a fraction fails", _OLLAMA),
    Rule("ollama", lambda a: a.rslora and not (a.alpha * math.sqrt(a.rank)).is_integer(),
         "runs llama.cpp's alpha / r, and alpha x sqrt(r) is no integer", _OLLAMA),
    Rule("ollama", lambda a: a.alpha_pattern or a.dora or a.lora_bias or bool(a.modules_to_save),
         "runs llama.cpp's adapters (no alpha_pattern, DoRA, lora_bias, modules_to_save)", _OLLAMA),
)


def merge_first_reasons(facts: AdapterFacts, server: str) -> list[str]:
    """Why `server` would not serve this adapter as PEFT computes it (empty: it would)."""
    return [rule.effect for rule in RULES if rule.server == server and rule.applies(facts)]


def vllm_max_lora_rank(rank: int) -> Optional[int]:
    """The smallest --max-lora-rank vLLM accepts that holds `rank` (None: above its largest)."""
    return next((allowed for allowed in VLLM_MAX_LORA_RANKS if allowed >= rank), None)


def portable_adapter_config(config: dict, base_model: Optional[str], for_llama_cpp: bool = False) -> dict:
    """adapter_config.json as it should travel: lora_alpha an integer when it is one (Ollama reads a uint32), the
    base model only as a hub id (never a local path), and for llama.cpp (which scales by alpha / r) an rsLoRA
    adapter's alpha multiplied by sqrt(r), so alpha' / r = alpha / sqrt(r), PEFT's rsLoRA scale."""
    out = dict(config)
    alpha = float(out.get("lora_alpha") or 8)
    if for_llama_cpp and out.get("use_rslora"):
        alpha = alpha * math.sqrt(int(out.get("r") or 8))
        out["use_rslora"] = False
    out["lora_alpha"] = int(alpha) if alpha.is_integer() else alpha
    if base_model:
        out["base_model_name_or_path"] = base_model
    else:
        out.pop("base_model_name_or_path", None)
    return out


# ------------------------------------------------------------------------------------------------
# The commands


@dataclass
class ServeContext:
    """What the commands need to know about the thing to serve."""
    name: str
    base: Optional[str] = None          # base model (hub id or local path) for adapter serving
    adapter: Optional[Path] = None
    model: Optional[Path] = None        # merged or full weights
    chat_template: Optional[Path] = None  # the trained prompt, where it differs from the tokenizer's
    facts: Optional[AdapterFacts] = None
    notes: list[str] = field(default_factory=list)


def serve_steps(ctx: ServeContext, finetune: str, local: bool = True) -> list[tuple[str, str]]:
    """(command, why) per server that will serve `ctx` as it trained; "merge first" lines where one would not.
    local False: `ctx` names a Hub repository (a model card's lines), which `finetune export` cannot read."""
    from finetune.rundir.run_dir import command_line

    template = ["--chat-template", ctx.chat_template] if ctx.chat_template is not None else []
    steps: list[tuple[str, str]] = []
    if ctx.model is not None:
        steps.append((command_line("vllm", "serve", ctx.model, *template), "vLLM (OpenAI API on :8000)"))
        steps.append((command_line("python", "-m", "sglang.launch_server", "--model-path", ctx.model, *template),
                      "SGLang"))
        if local:
            steps.append((f"{finetune} {command_line('export', ctx.model, '--gguf', 'q8_0', '-o', f'exports/{ctx.name}')}",
                          "llama.cpp / Ollama / LM Studio: GGUF + Modelfile, verified"))
        return steps
    if ctx.adapter is None or ctx.facts is None or ctx.base is None:
        return steps
    facts = ctx.facts
    vllm_why = merge_first_reasons(facts, "vllm")
    if vllm_why:
        steps.append(("# vLLM: merge first", "; ".join(vllm_why)))
    else:
        rank = vllm_max_lora_rank(facts.max_rank)
        steps.append((command_line("vllm", "serve", ctx.base, "--enable-lora", "--lora-modules",
                                   f"{ctx.name}={ctx.adapter}", "--max-lora-rank", str(rank), *template),
                      f"vLLM: base + adapter (rank {facts.max_rank} -> --max-lora-rank {rank})"))
    sglang_why = merge_first_reasons(facts, "sglang")
    if sglang_why:
        steps.append(("# SGLang: merge first", "; ".join(sglang_why)))
    else:
        steps.append((command_line("python", "-m", "sglang.launch_server", "--model-path", ctx.base, "--enable-lora",
                                   "--lora-paths", f"{ctx.name}={ctx.adapter}", "--max-lora-rank",
                                   str(facts.max_rank), *template), "SGLang: base + adapter"))
    return steps


def trained_template_file(folder: Path, tokenizer_dir: Optional[Path], recipe) -> Optional[Path]:
    """FOLDER/trained_chat_template.jinja holding the prompt the run trained with, written when it differs from
    the tokenizer's own template (the demo: Alpaca vs `<|user|>`); None when the tokenizer's is the trained one,
    or the run trained on plain text (no chat template to give a server)."""
    from finetune.data.formats import alpaca_chat_template
    from finetune.data.show import trained_format
    from finetune.fsutil import write_atomic

    fmt = trained_format(recipe)
    tokenizer_template = _tokenizer_template(tokenizer_dir)
    if fmt == "alpaca":
        trained = alpaca_chat_template()
    elif fmt == "messages":
        trained = recipe.data.chat_template or tokenizer_template
    else:
        return None
    if not trained or trained == tokenizer_template:
        return None
    path = folder / TRAINED_TEMPLATE
    try:
        if not path.is_file() or path.read_text(encoding="utf-8") != trained:
            write_atomic(path, trained)
    except OSError:
        return None
    return path


def _tokenizer_template(tokenizer_dir: Optional[Path]) -> Optional[str]:
    if tokenizer_dir is None:
        return None
    jinja = tokenizer_dir / "chat_template.jinja"
    try:
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    return template if isinstance(template, str) else None


def run_context(run_dir: Path) -> Optional[ServeContext]:
    """The serving context of a finished run directory (its adapter or full weights), None when it has neither."""
    from finetune.rundir.names import ADAPTER_CONFIG
    from finetune.rundir.errors import RunDirError
    from finetune.rundir.run_dir import RunDir

    run = RunDir(run_dir)
    try:
        recipe = run.recipe()
    except RunDirError:
        return None
    name = recipe.name or run_dir.name
    template = trained_template_file(run_dir, run.tokenizer(), recipe) \
        if not objectives.get(recipe.objective).score_head else None
    if run.has_model():
        return ServeContext(name, model=run.model_path, chat_template=template)
    adapter = run.adapter()
    if adapter is None:
        return None
    try:
        config = json.loads((adapter / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    base = recipe.model.name_or_path
    from finetune.builtin import BuiltinModelError, builtin_model_dir, is_builtin

    if is_builtin(base):
        try:
            base = str(builtin_model_dir(base))
        except BuiltinModelError:
            return None
    return ServeContext(name, base=base, adapter=adapter, chat_template=template, facts=adapter_facts(config))


def next_steps(run_dir: Path, objective: str = "sft", *, for_report: bool = False,
               saved: Optional[list[str]] = None) -> list[tuple[str, str]]:
    """(command, why) after a run, for `finetune train`'s `next:` lines and report.html's Next table alike (issue 39:
    decided here only, the two render it): look at it, talk to it, score it, merge it, serve it. `for_report`: the
    report does not point at itself, and it adds training further from the newest checkpoint (a run stopped before
    its final save resumes from there). Every command runs as printed here (finetune.hints: the venv's path when it
    is not activated; a file path where there is no desktop to open it; every argument shell-quoted)."""
    from finetune import hints
    from finetune.rundir.checkpoint import checkpoint_dirs
    from finetune.rundir.names import TENSORBOARD_DIR
    from finetune.rundir.names import REPORT_FILE
    from finetune.rundir.run_dir import RunDir, command_line

    finetune, steps = hints.finetune(), []
    run = RunDir(run_dir)
    if not for_report and (run_dir / REPORT_FILE).is_file():
        opener = hints.open_file(run_dir / REPORT_FILE)
        steps.append((opener or command_line(run_dir / REPORT_FILE),
                      "loss plot, memory, config, versions" + ("" if opener else " (open it in a browser)")))
    from finetune.rundir.names import ADAPTER_DIR

    has_adapter = ADAPTER_DIR in saved if saved is not None else run.adapter_path.is_dir()
    saved = bool(saved) if saved is not None else (has_adapter or run.has_model())
    record = objectives.get(objective)
    if saved and record.score_head:  # a scoring head, not a chat model
        steps.append((f"{finetune} {command_line('eval', run_dir)}", "pairwise accuracy on its pairs, base vs trained"))
    elif saved:
        steps.append((f"{finetune} {command_line('chat', run_dir)}", "talk to it (--prompt TEXT for one answer)"))
        if record.perplexity:  # a preference loss is not a perplexity
            steps.append((f"{finetune} {command_line('eval', run_dir)}", "loss and perplexity, base vs fine-tuned"))
    if has_adapter:
        steps.append((f"{finetune} {command_line('merge', run_dir, '-o', f'merged/{run_dir.name}')}",
                      "one model to serve (CPU, streaming)"))
    if saved and not record.score_head:
        ctx = run_context(run_dir)
        if ctx is not None:
            if ctx.adapter is not None:
                steps.append((f"{finetune} {command_line('export', run_dir, '--gguf', 'q8_0', '-o', f'exports/{ctx.name}')}",
                              "llama.cpp / Ollama / LM Studio: merged, GGUF + Modelfile, verified"))
            steps += serve_steps(ctx, finetune)
    checkpoints = checkpoint_dirs(run_dir)
    if checkpoints:
        newest = checkpoints[-1][1]
        steps.append((f"{finetune} {command_line('convert', newest, '-o', run_dir / f'{newest.name}-hf')}",
                      f"turn {newest.name} into an adapter or weights"))
    if (run_dir / TENSORBOARD_DIR).is_dir():
        steps.append((f"{hints.tensorboard()} {command_line('--logdir', run_dir / TENSORBOARD_DIR)}", "the curves, live"))
    if for_report and checkpoints:
        steps.append((f"{finetune} {command_line('train', run.recipe_path, '--force-resume')}",
                      "train further from the newest checkpoint (after raising training.max_steps or epochs)"))
    return steps


def merged_next_steps(merged: Path) -> list[tuple[str, str]]:
    """(command, why) after `finetune merge`: chat, then serve the merged model with the trained prompt (the run's
    recipe travels in the merged folder as finetune_recipe.yaml)."""
    from finetune import hints
    from finetune.rundir.errors import RunDirError
    from finetune.rundir.run_dir import command_line, merged_recipe

    finetune, recipe = hints.finetune(), None
    try:
        recipe = merged_recipe(merged)
    except RunDirError:
        pass  # merged by hand or from an older run: the tokenizer's template is all there is
    template = trained_template_file(merged, merged, recipe) if recipe is not None else None
    name = (recipe.name if recipe is not None and recipe.name else None) or merged.name
    steps = [(f"{finetune} {command_line('chat', merged)}", "talk to it, prompted as the run trained")]
    return steps + serve_steps(ServeContext(name, model=merged, chat_template=template), finetune)


def export_next_steps(output: Path, gguf: Path, name: str) -> list[str]:
    from finetune.rundir.run_dir import command_line

    steps = [(command_line("llama-server", "-m", gguf), "llama.cpp (OpenAI API on :8080; the GGUF carries the prompt)"),
             (f"cd {command_line(output)} && {command_line('ollama', 'create', name, '-f', 'Modelfile')} && "
              f"{command_line('ollama', 'run', name)}", "Ollama")]
    return lines(steps)


def hub_steps(kind: str, name: str, repo_id: str, base: Optional[str], adapter_config: dict,
              template: bool) -> list[tuple[str, str]]:
    """(command, why) that serve a published repository as it trained, for its model card: `kind` adapter, model or
    gguf (finetune.publish.contents). vLLM and SGLang take a Hub id for the model and for a LoRA adapter; llama.cpp's
    `-hf` (common/arg.cpp, --hf-repo) downloads a repository's GGUF; Ollama reads the Modelfile this repository
    carries once it is downloaded (`hf download`, huggingface_hub's CLI)."""
    from finetune.rundir.run_dir import command_line

    chat_template = Path(TRAINED_TEMPLATE) if template else None  # a file of the repository, downloaded beside
    if kind == "gguf":
        return [(command_line("llama-server", "-hf", repo_id), "llama.cpp (the GGUF carries the trained prompt)"),
                (f"{command_line('hf', 'download', repo_id, '--local-dir', name)} && cd {command_line(name)} && "
                 f"{command_line('ollama', 'create', name, '-f', 'Modelfile')} && {command_line('ollama', 'run', name)}",
                 "Ollama, with the Modelfile's trained TEMPLATE and stops")]
    if kind == "model":
        return serve_steps(ServeContext(name, model=Path(repo_id), chat_template=chat_template), "finetune", local=False)
    if base is None:
        return [("# The base model is not on the Hub", "serve the adapter on your copy of the base, or publish a merged "
                 "model (finetune merge RUN -o MERGED, then finetune publish MERGED)")]
    return serve_steps(ServeContext(name, base=base, adapter=Path(repo_id), chat_template=chat_template,
                                    facts=adapter_facts(adapter_config)), "finetune", local=False)


def lines(steps: list[tuple[str, str]]) -> list[str]:
    """`next:` and one aligned `command  # why` line per step."""
    if not steps:
        return []
    width = max(len(command) for command, _ in steps)
    return ["next:"] + [f"  {command.ljust(width)}  # {why}" for command, why in steps]
