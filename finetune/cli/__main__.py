"""`python -m finetune.cli`: the same as the `finetune` command."""

from finetune.cli import main

main()
