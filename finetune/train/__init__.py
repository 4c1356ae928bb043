"""The per-rank training runner and its parts.

    torchrun --nproc_per_node 2 -m finetune.train.runner --run-dir runs/demo

`finetune train RECIPE` (finetune.run.start) tokenizes the data (finetune.data.prepare), writes the run
directory and starts that command; the runner reads recipe.yaml, deepspeed.json and training_args.json
from it and memory-maps the tokenized data. Modules: `model` (tokenizer, base model, LoRA/QLoRA), `callbacks`
(summary, effective DeepSpeed config), `dist` (the collectives every rank calls),
`runner` (the order of it all, and the outputs); one module per objective's path, with the same steps
(`objective_steps` picks it from finetune.objectives): `sft`, `preference` (dpo, orpo, kto, simpo, and what
every TRL objective shares), `grpo`, `reward`.
"""
