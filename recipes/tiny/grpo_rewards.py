"""A reward the tiny random-init model can learn in a few dozen GRPO steps (recipes/tiny/grpo_*.yaml):
the share of completion tokens from the first quarter of its 768-token vocabulary. It follows the reward
contract of README "GRPO": one float per completion, extra columns and TRL's arguments in **kwargs."""

LOW_IDS = 192  # a quarter of builtin:tiny-llama's vocabulary: ~0.25 at the start, 1.0 when learnt


def low_id_share(prompts, completions, completion_ids, **kwargs):
    return [sum(1 for t in ids if t < LOW_IDS) / len(ids) if ids else 0.0 for ids in completion_ids]
