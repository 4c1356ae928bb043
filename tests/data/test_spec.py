"""Issue 39: the data section as tokenizing reads it is one typed, frozen DataSpec (finetune.data.spec), built from
the recipe once; its cache key is the key caches were made with before, so they keep being found."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from finetune.data.spec import DataSpec, SourceSpec
from finetune.recipe import Recipe, load_recipe
from finetune.recipe.schema import DataSection, SourceSection
from tests.conftest import REPO


class StandInTokenizer:
    """What the key reads of a tokenizer, fixed: a pinned key then depends on finetune's code alone."""
    backend_tokenizer = None
    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    bos_token_id, eos_token_id = 1, 2

    def get_vocab(self):
        return {"<s>": 1, "</s>": 2, "a": 3, "b": 4}


# Hub sources (no local file, so no size or mtime in the key). The keys were computed by the code before issue 39
# (commit 8bda09f: finetune.data.prepare.cache_key of finetune.data.sources.section_for_tokenizing(recipe)).
PINNED = {
    "shorthand": ({"data": {"path": "org/instructions"}}, "22dfff834b5d759e"),
    "mixture": ({"data": {"sources": [{"path": "org/alpaca", "weight": 3},
                                      {"path": "org/chats", "format": "sharegpt", "split": "dev", "samples": 50,
                                       "columns": {"messages": "dialog"}, "roles": {"bot": "assistant"}}]},
                 "training": {"seed": 7}}, "03231ddac7fb6b85"),
    "chat": ({"data": {"path": "org/chats", "format": "messages", "chat_template": "{{ messages }}", "think": "mask",
                       "packing": True, "mask_prompt": False, "max_length": 512, "seed": 3, "num_proc": 2,
                       "padding_free": True, "validation_split": 0.1}}, "f9bd6b3614e9fdd6"),
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_the_key_is_the_one_caches_were_made_with(name):
    sections, key = PINNED[name]
    recipe = Recipe.model_validate({"model": {"name_or_path": "builtin:tiny-llama"}, **sections})
    assert DataSpec.of(recipe).cache_key(StandInTokenizer()) == key


def _key_before_issue_39(recipe, tokenizer) -> str:
    """The key as it was computed (commit 8bda09f), from the data section's dict, for local files too."""
    from finetune.data.sources import data_files
    from finetune.recipe.references import is_local

    def absolute(path):
        return str(Path(path).expanduser().absolute()) if isinstance(path, str) and is_local(path) else path

    def identity(path):
        local = Path(path).expanduser()
        if not is_local(path) or not local.exists():
            return None
        files = data_files(local) if local.is_dir() else [local]
        return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]

    data = recipe.data.model_dump(mode="json")
    data["seed"] = recipe.training.seed if recipe.data.seed is None else recipe.data.seed
    section = {k: data.get(k) for k in ("path", "format", "split", "columns", "roles", "sources", "seed", "think",
                                        "chat_template", "max_length", "packing", "mask_prompt")}
    section["path"] = absolute(section["path"])
    section["sources"] = [{**item, "path": absolute(item.get("path"))} for item in section["sources"] or []] or None
    files = [identity(str(item["path"])) for item in data["sources"] or [data]]
    blob = json.dumps({"v": 4, "data": section, "source": files, "template": tokenizer.chat_template,
                       "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "class": type(tokenizer).__name__},
                      sort_keys=True, default=str)
    digest = hashlib.sha256(blob.encode())
    digest.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    return digest.hexdigest()[:16]


@pytest.mark.parametrize("recipe_file,overrides", [
    ("recipes/demo.yaml", []),
    ("recipes/demo.yaml", ["data.packing=true", "data.seed=9", "data.mask_prompt=false"]),
    ("recipes/tiny/mix_alpaca_sharegpt.yaml", []),
    ("recipes/tiny/mix_alpaca_sharegpt.yaml", ["data.think=mask", "training.seed=5", "data.max_length=77"]),
])
def test_the_key_of_local_files_is_computed_as_before(recipe_file, overrides, monkeypatch):
    monkeypatch.chdir(REPO)  # the recipes' relative paths: the launcher's view, absolute in the key
    recipe = load_recipe(Path(recipe_file), overrides).recipe
    assert DataSpec.of(recipe).cache_key(StandInTokenizer()) == _key_before_issue_39(recipe, StandInTokenizer())


def test_the_spec_holds_the_schemas_values_and_no_defaults_of_its_own():
    for spec_class in (DataSpec, SourceSpec):
        defaults = [f.name for f in dataclasses.fields(spec_class)
                    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
        assert not defaults, f"{spec_class.__name__}: defaults are the schema's (finetune.recipe.schema)"
    assert {f.name for f in dataclasses.fields(SourceSpec)} == set(SourceSection.model_fields)
    # A new key of the data section is either read by tokenizing (a field here, and in the key) or named here.
    assert set(DataSection.model_fields) - {f.name for f in dataclasses.fields(DataSpec)} == {
        "padding_free", "pad_to_multiple_of", "validation_split"}  # batching, not tokenizing
    spec = DataSpec.from_section({"path": "org/rows"})
    assert (spec.format, spec.max_length, spec.mask_prompt, spec.think, spec.seed) == (
        DataSection.model_fields["format"].default, DataSection.model_fields["max_length"].default,
        DataSection.model_fields["mask_prompt"].default, DataSection.model_fields["think"].default,
        Recipe.model_validate({"model": {"name_or_path": "m"}, "data": {"path": "x"}}).training.seed)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.max_length = 1  # type: ignore[misc]


def test_the_spec_travels_to_a_fresh_process_whole():
    """finetune.data.prepare_fresh pickles it for its child."""
    import pickle

    spec = DataSpec.of(Recipe.model_validate({"model": {"name_or_path": "builtin:tiny-llama"}, **PINNED["mixture"][0]}))
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert [s.weight for s in spec.read_sources()] == [3.0, None] and spec.seed == 7
