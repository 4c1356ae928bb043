"""`export --verify` with llama-cpp-python installed: the GGUF run by llama.cpp itself.

Two checks against transformers: llama.cpp's tokens of the trained prompt (rendered on fixed questions) equal the
ids transformers' tokenizer gives (a wrong pre-tokenizer or special-token handling shows here, not in the weights),
and on the run's rows llama.cpp's logits against transformers' logits of the same GGUF weights (read back): the
argmax must agree wherever transformers' top-2 margin exceeds the measured max |logit difference|; KL and the max
difference are recorded. llama.cpp's CPU matmuls round the activations too (to 8-bit blocks for quantized weights,
to f16 for f16 weights: ggml-cpu's vec_dot_type), so its logits differ from the dequantized weights' in transformers
by more than rounding the weights does: KL is reported, not bounded (README: "llama.cpp itself" has the numbers).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional


def llama_cpp_run(gguf_file: Path, tokenizer, texts: list[tuple[str, bool]], rows: list[list[int]]
                  ) -> Optional[tuple[list[str], list[Any]]]:
    """(the prompts llama.cpp tokenizes differently, llama.cpp's float64 logits of each row), or None when
    llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    import numpy as np
    import torch

    log = logging.getLogger("llama-cpp-python")  # its per-tensor load log stays off the screen
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        llm = llama_cpp.Llama(model_path=str(gguf_file), n_ctx=max(len(r) for r in rows) + 8, logits_all=True,
                              verbose=False)
        differ = []
        for text, specials in texts:
            ours = list(tokenizer(text, add_special_tokens=specials)["input_ids"])
            theirs = llm.tokenize(text.encode("utf-8"), add_bos=specials and tokenizer.bos_token_id is not None
                                  and ours[:1] == [tokenizer.bos_token_id], special=True)
            if theirs != ours:
                differ.append(f"{text[:40]!r}: {theirs[:12]} vs {ours[:12]}")
        computed = []
        for ids in rows:
            llm.reset()
            llm.eval(ids)
            computed.append(torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float64)))
        llm.close()
    finally:
        log.setLevel(level)
    return differ, computed
