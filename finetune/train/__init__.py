"""The per-rank training runner and its parts.

    torchrun --nproc_per_node 2 -m finetune.train.runner --run-dir runs/demo

`finetune train RECIPE` (finetune.run.start) writes the run directory and starts that command; the
runner reads recipe.yaml, deepspeed.json and training_args.json from it. Modules: `data` (formats,
loss masking, packing, tokenization cache), `model` (tokenizer, base model, LoRA/QLoRA), `callbacks`
(summary, effective DeepSpeed config), `dist` (the collectives every rank calls),
`runner` (the order of it all, and the outputs).
"""
