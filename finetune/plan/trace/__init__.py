"""`finetune plan --trace`: the planner's check against the real model code, and the only part of plan/ that
imports torch (transformers and peft too), always inside a function or in a module only the trace imports.

- step: one training step of transformers' modeling code on fake tensors (`trace`), extrapolated to full depth;
- live_tensors: the dispatch mode that counts live storages by kind (imports torch at the top);
- qlora: bitsandbytes' 4-bit linears and peft's kbit casts, emulated on fake tensors;
- allocations: the allocation events of steps at several lengths, for finetune.plan.allocator's replay.

The pure arithmetic the trace is compared with stays one level up (finetune/plan/).
"""
