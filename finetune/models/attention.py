"""The attention kernel a recipe gets when it does not write one (torch-free).

`model.attn_implementation` left out is sdpa, except for a family whose transformers model class refuses sdpa at load
(Gemma 2's soft-capped scores, gpt-oss's attention sinks: finetune.models.families), which gets eager, so the default
recipe trains every family. Written out, sdpa stays, and lint's R168 says why it cannot run. Applied where recipes are
loaded for a command (lint, and cli.common for the others); a run directory's recipe.yaml records the result.
"""

from __future__ import annotations

from finetune.recipe import LoadedRecipe


def default_attention(loaded: LoadedRecipe) -> LoadedRecipe:
    """`loaded`, its model.attn_implementation set to eager when left out for a family that has no sdpa."""
    from finetune.models.identify import identify

    model = loaded.recipe.model
    if "attn_implementation" in model.model_fields_set:
        return loaded
    ident = identify(model.name_or_path)
    if ident is not None and ident.family is not None and not ident.family.sdpa:
        model.attn_implementation = "eager"
    return loaded
