"""The model families finetune knows (no torch): their layouts (`families`), which family a recipe's model is
(`identify`), and the LoRA targets finetune resolves for them (`targets`). The light core reads these; the
runner, the planner and the merge act on them."""
