"""The Ollama Modelfile written beside a GGUF export: `ollama create NAME -f Modelfile` in that folder.

FROM the GGUF next to it (a relative path: the folder can move), the TEMPLATE the run trained with (Go
text/template over .Messages, derived and checked in finetune.export.prompt), one `PARAMETER stop` per token that
ends a reply, and `num_ctx` = the recipe's data.max_length (the longest sequence the model trained on).
"""

from __future__ import annotations

import json
from typing import Optional

from finetune.export.prompt import TrainedPrompt, ollama_template

MODELFILE = "Modelfile"


def modelfile(gguf_name: str, prompt: TrainedPrompt, adds_bos: bool, num_ctx: Optional[int]) -> tuple[str, list[str]]:
    """(the Modelfile's text, notes for the user: what it could not say)."""
    lines = [f"# Written by finetune export: {prompt.origin}.", f"FROM ./{gguf_name}"]
    notes = []
    template = ollama_template(prompt, adds_bos) if prompt.chat_template is not None else None
    if template is not None:
        lines.append(f'TEMPLATE """{template}"""')
    elif prompt.chat_template is not None:
        notes.append("the chat template does not split into per-role text, so the Modelfile has no TEMPLATE; "
                     "write one by hand (the GGUF carries the template as tokenizer.chat_template)")
    else:
        lines.append('TEMPLATE """{{ .Prompt }}"""')  # plain text: the model continues what it is given
    for stop in prompt.stops:
        lines.append(f"PARAMETER stop {json.dumps(stop)}")
    if num_ctx:
        lines.append(f"PARAMETER num_ctx {num_ctx}")
    return "\n".join(lines) + "\n", notes
