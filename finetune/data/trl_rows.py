"""The rows of TRL's objectives read for training: `load_rows`, sources mixed by weight or samples like SFT's
(finetune.data.mix). Their formats are registered by finetune.data.preference (pairs, kto) and finetune.data.grpo
(prompts), imported here for that; preflight has checked every local row with the same converters.
"""

from __future__ import annotations

from typing import Any

from finetune.data import grpo as _grpo_rows  # noqa: F401 - registers `prompts`
from finetune.data import preference as _preference_rows  # noqa: F401 - registers `pairs` and `kto`
from finetune.data.formats import RowProblem


def load_rows(data: Any, objective: str, seed: int):
    """The rows of `objective` as a `datasets.Dataset` in TRL's column names, sources mixed like SFT's
    (finetune.data.mix). Hub sources are read here and converted row by row; a bad row is a DataError."""
    import datasets

    from finetune.data.formats import to_example
    from finetune.data.mix import MixError, mixture, targets
    from finetune.data.sources import sources_of
    from finetune.data.tokenize import DataError, load_raw

    sources = sources_of(data, objective)
    per_source = []
    for source in sources:
        rows = []
        for number, row in enumerate(load_raw(source.path, source.split), 1):
            try:
                rows.append(to_example(row, source.spec).values)
            except RowProblem as exc:
                raise DataError(f"{source.path}: row {number}: {exc}") from None
        per_source.append(rows)
    if len(sources) == 1 and sources[0].weight is None and sources[0].samples is None:
        return datasets.Dataset.from_list(per_source[0])
    try:
        shares = targets([len(rows) for rows in per_source], [s.weight for s in sources],
                         [s.samples for s in sources], [s.path for s in sources])
    except MixError as exc:
        raise DataError(str(exc)) from None
    return datasets.Dataset.from_list([per_source[s][i] for s, i in mixture(shares, seed)])

