"""`auto` in a recipe (issue 35): which keys may say it, what they are without a machine to judge by, and how a
run directory writes them back. finetune.plan.auto decides them for a machine; the schema validates them."""

from __future__ import annotations

from typing import Any

# What an `auto` key is without a machine to judge by (no GPU memory known, or no GPU): the memory-safe values these
# keys had as fixed defaults before they could be `auto` (issue 35), so CPU runs and plans without --gpu-memory do
# what they did. finetune.plan.auto decides them for a machine.
AUTO_WITHOUT_MACHINE: dict[str, Any] = {
    "training.gradient_checkpointing": True,
    "training.loss_kernel": "default",
    "training.micro_batch_size": 1,
    "deepspeed.enabled": True,
    "data.pad_to_multiple_of": 1,
}


def with_auto(data: dict[str, Any], keys) -> dict[str, Any]:
    """A recipe dumped as data (model_dump) with `auto` written back for `keys` (Recipe.auto_keys). A decided micro
    batch took its rows from the accumulation: the accumulation written back is the rows per step again."""
    training = data.get("training")
    if "training.micro_batch_size" in keys and isinstance(training, dict) and \
            isinstance(training.get("micro_batch_size"), int):
        training["gradient_accumulation_steps"] = training["micro_batch_size"] * training["gradient_accumulation_steps"]
    for key in keys:
        section, name = key.split(".")
        if isinstance(data.get(section), dict) and name in data[section]:  # not a key the record leaves out
            data[section][name] = "auto"
    return data


def with_auto_values(recipe, values: dict[str, Any]):
    """A copy of `recipe` with decided values (a run directory's auto.json, finetune.plan.auto) on the keys it leaves
    auto, and the accumulation that goes with a decided micro batch; every key the recipe wrote stays."""
    out = recipe.model_copy(deep=True)
    for key, value in values.items():
        if key in out.auto_keys or key == "training.gradient_accumulation_steps" and \
                "training.micro_batch_size" in out.auto_keys:
            section, name = key.split(".")
            setattr(getattr(out, section), name, value)
    return out



def auto_or(kind: type, value: Any, expected: str) -> Any:
    """`auto`, or `value` as `kind` (pydantic's lax rules: "4" is 4, yes is true), else one message naming what is
    expected: a `Union[kind, Literal["auto"]]` would report one error per member of the union."""
    if value == "auto":
        return value
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(kind).validate_python(value)
    except ValidationError:
        raise ValueError(f"expected {expected}") from None


def auto_in_range(value: Any, most: int, what: str) -> Any:
    """`auto`, or a whole number from 1 to `most` (auto_or's lax rules), else one message: 'expected `auto` or <what>
    from 1 to <most>'."""
    expected = f"`auto` or {what} from 1 to {most:,}"
    value = auto_or(int, value, expected)
    if isinstance(value, int) and not 1 <= value <= most:
        raise ValueError(f"expected {expected}")
    return value
