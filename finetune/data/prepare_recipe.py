"""A recipe's training set tokenized into the cache, or found there: the step `finetune prepare` runs, and
`finetune train` runs in the launcher before any rank starts (finetune.run.start).

The data spec is built from the recipe (finetune.data.spec.DataSpec) and finetune.data.prepare does the work, in
this process or, when this process has imported torch, in a fresh one (finetune.data.prepare_fresh). The caller
loads the tokenizer (finetune.tokenizer.load_for_launch: without torch, a built-in model built first); objectives
trained by TRL tokenize their rows in the trainer and have nothing to prepare here.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Union

from finetune.data import cache_entry
from finetune.data.cache_root import tokenized_root
from finetune.data.prepare import MANIFEST, Prepared, entry, is_prepared, prepare
from finetune.data.spec import DataSpec


def prepare_recipe(recipe: Any, tokenizer, log: Callable[[str], None],
                   num_proc: Union[str, int, None] = None) -> Prepared:
    """Tokenize the SFT training set of `recipe` (a finetune.recipe.Recipe) into the tokenized cache
    (finetune.data.cache_root), or find it there. Raises finetune.data.tokenize.DataError, naming file and line,
    on a row it cannot use."""
    spec, cache_dir = DataSpec.of(recipe), tokenized_root()
    target = entry(spec, tokenizer, cache_dir)
    if "torch" in sys.modules and not (is_prepared(target) and cache_entry.problem(target, MANIFEST) is None):
        # `finetune train`'s preflight imported torch: tokenize in a fresh process, so that the workers it
        # forks do not each carry torch (finetune.data.prepare_fresh).
        from finetune.data.prepare_fresh import prepare_in_fresh_process

        return prepare_in_fresh_process(spec, tokenizer, cache_dir, log=log, num_proc=num_proc)
    return prepare(spec, tokenizer, cache_dir, log=log, num_proc=num_proc)
