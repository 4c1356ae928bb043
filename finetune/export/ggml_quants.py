"""llama.cpp's own quantizer for one tensor (ggml_quantize_chunk, ggml.h), from the libggml-base that
llama-cpp-python installs, for `export --verify` of a K-quant: the reference weights rounded by the same C code
that `llama_model_quantize` runs (no importance matrix: finetune passes none), so a Q4_K_M GGUF is checked
weight for weight and its KL bound comes from its own rounding, as q8_0's does from gguf-py's.

gguf-py dequantizes K-quants but has no K-quant quantizer; without llama-cpp-python this module answers None and
readback falls back to gguf-py's Q4_0/Q5_0/Q8_0 as a proxy (README: `finetune export`).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np

# ggml.h's enum ggml_type (gguf-py's GGMLQuantizationType has the same numbers).
GGML_TYPES = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


@lru_cache(maxsize=1)
def library() -> Optional[ctypes.CDLL]:
    """llama-cpp-python's libggml-base (or libggml), with the two functions typed; None when it is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    folder = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll", "libggml.so", "libggml.dylib"):
        path = folder / name
        if not path.is_file():
            continue
        lib = ctypes.CDLL(str(path))
        if not hasattr(lib, "ggml_quantize_chunk"):
            continue
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p,
                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_float)]
        lib.ggml_row_size.restype = ctypes.c_size_t
        lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        lib.ggml_quantize_init.restype = None
        lib.ggml_quantize_init.argtypes = [ctypes.c_int]
        return lib
    return None


def quantize(array: np.ndarray, kind: str) -> Optional[np.ndarray]:
    """The rows of `array` (float32, last axis the row) in llama.cpp's `kind` blocks, as the GGUF stores them
    (uint8, one row of blocks per row); None without llama.cpp's library or for another type."""
    lib = library()
    if lib is None or kind not in GGML_TYPES:
        return None
    ggml_type = GGML_TYPES[kind]
    rows = np.ascontiguousarray(array, dtype=np.float32).reshape(-1, array.shape[-1])
    n_rows, n_per_row = rows.shape
    row_size = lib.ggml_row_size(ggml_type, n_per_row)
    out = np.zeros((n_rows, row_size), dtype=np.uint8)
    lib.ggml_quantize_init(ggml_type)
    written = lib.ggml_quantize_chunk(ggml_type, rows.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                      out.ctypes.data_as(ctypes.c_void_p), 0, n_rows, n_per_row, None)
    if written != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes for {kind}, expected {out.nbytes}")
    return out


def round_trip(array: np.ndarray, kind: str) -> Optional[np.ndarray]:
    """`array` as a `kind` GGUF tensor reads back (llama.cpp's quantizer, gguf-py's dequantizer)."""
    import gguf

    packed = quantize(array, kind)
    if packed is None:
        return None
    return gguf.quants.dequantize(packed, gguf.GGMLQuantizationType[kind]).reshape(array.shape)
