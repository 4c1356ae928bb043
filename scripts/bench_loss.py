"""Peak memory of the causal-LM loss: transformers' default against training.loss_kernel: chunked, on CPU.

    python scripts/bench_loss.py                       # Llama-3 vocabulary (128,256), 4,096 tokens
    python scripts/bench_loss.py --hidden 4096 --tokens 8192

Only the part that differs between the two is run: final hidden states -> output head -> cross-entropy,
forward and backward (a frozen head, as with LoRA; --train-head adds its weight gradient to both).
Each kernel runs in its own process, and its peak is the growth of the process's peak RSS
(getrusage ru_maxrss) over its RSS just before the loss: tracemalloc does not see torch's
allocations. The hidden size changes the compute, not the logits' memory, so the default keeps it small.
With float32 (the default here, for CPU speed) the head's output is already fp32: the default loss
then has no separate 16-bit copy of the logits, which bf16 training would add.
The tests run `measure` for both kernels on a tiny head in their own process (tests/test_entry_points.py): two
fresh processes would import torch twice.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LLAMA3_VOCAB = 128_256


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def measure(kernel: str, tokens: int, vocab: int, hidden: int, dtype: str, train_head: bool) -> dict:
    import torch
    from torch.utils.checkpoint import checkpoint
    from transformers.loss.loss_utils import ForCausalLMLoss

    from finetune.chunks import chunk_count
    from finetune.loss_kernel import chunked_causal_lm_loss

    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False, dtype=getattr(torch, dtype))
    head.weight.requires_grad_(train_head)
    states = torch.randn(1, tokens, hidden, dtype=getattr(torch, dtype), requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    labels[:, : tokens // 4] = -100  # a masked prompt
    # The first non-reentrant checkpoint loads lazily imported modules (~100 MiB): not the loss's memory.
    checkpoint(torch.mul, torch.ones(1, requires_grad=True), 2.0, use_reentrant=False).backward()
    before = current_rss()
    start = time.perf_counter()
    if kernel == "default":
        loss = ForCausalLMLoss(head(states), labels, vocab)
    else:
        loss = chunked_causal_lm_loss(states, head, labels, chunk_count(tokens, vocab))
    loss.backward()
    seconds = time.perf_counter() - start
    return {"kernel": kernel, "peak_bytes": peak_rss() - before, "loss": loss.item(), "seconds": seconds,
            "chunks": chunk_count(tokens, vocab) if kernel == "chunked" else 1}


def run_child(kernel: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", kernel, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
           "--hidden", str(args.hidden), "--dtype", args.dtype] + (["--train-head"] if args.train_head else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"bench_loss: the {kernel} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the micro batch (default 4096)")
    parser.add_argument("--vocab", type=int, default=LLAMA3_VOCAB, help="vocabulary (default Llama-3's 128,256)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default 256: it changes compute only)")
    # float32 by default: CPU bf16 matmuls without AMX run ~70x slower than fp32 (0.13 vs 9 GFLOP/s on the
    # 2-core box this was written on); with bf16 the default loss also keeps the 16-bit logits.
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--train-head", action="store_true", help="the head's weight is trained too")
    parser.add_argument("--child", choices=["default", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.tokens, args.vocab, args.hidden, args.dtype, args.train_head)))
        return
    print(f"loss over {args.tokens:,} tokens, vocabulary {args.vocab:,}, hidden {args.hidden}, {args.dtype}, "
          f"head {'trained' if args.train_head else 'frozen'}; each kernel in its own process (CPU, peak RSS growth)")
    results = [run_child(kernel, args) for kernel in ("default", "chunked")]
    for r in results:
        print(f"  {r['kernel']:<8} peak {r['peak_bytes'] / 2**20:9.1f} MiB   loss {r['loss']:.6f}   "
              f"{r['seconds']:6.1f} s   ({r['chunks']} chunk{'s' if r['chunks'] != 1 else ''})")
    ratio = results[0]["peak_bytes"] / max(1, results[1]["peak_bytes"])
    print(f"  default / chunked peak memory: {ratio:.1f}x")


if __name__ == "__main__":
    main()
