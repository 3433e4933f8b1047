"""Per-prompt generation budgets: a dataset row's own ``max_new_tokens``.

A task whose answers vary widely in length (a proof beside a one-line sum)
wastes decode steps and KV memory when every prompt gets the longest budget.
A row may carry an integer ``max_new_tokens``; its group is generated with
``min(row value, rollout.max_new_tokens)``, so the config's value stays the
run's ceiling (what ``inference.max_model_len`` and the trainer's
``training.seq_len`` are sized for). Rows without it (or with null, as a
column missing from some rows reads) get the config's value.

A completion cut at its own budget ends with finish reason "length", like
one cut at the config's: it counts in ``rollout/truncated_frac`` and
``grpo.mask_truncated`` drops it.

The sequence limit (:func:`fit_budget`): a sample longer than
``training.seq_len`` cannot be trained (the model's RoPE table ends there),
and a request whose prompt plus budget passes a server's context is refused
by SGLang and vLLM alike (HTTP 400, which would stop the run). So a group's
budget is also cut to what its prompt leaves of the limit, and a prompt that
leaves no room is skipped (counted in ``rollout/skipped_long_prompts``)
rather than sent. Reasoning datasets have a few such rows; the run goes on.
"""

from __future__ import annotations

import numbers
from typing import Sequence

FIELD = "max_new_tokens"


def _bad(value) -> bool:
    return value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0)


def check_budgets(rows: Sequence[dict], source: str) -> None:
    """Raise one line naming the field and the first row (0-based, in
    ``source``) whose ``max_new_tokens`` is not a positive integer; at start-up,
    not when the row is first drawn hours into a run."""
    for i, row in enumerate(rows):
        if _bad(row.get(FIELD)):
            raise ValueError(f"{source}: row {i}: field {FIELD!r} must be a positive integer, got {row[FIELD]!r}")


def fit_budget(prompt_tokens: int, budget: int, max_sequence_tokens: int) -> int | None:
    """``budget`` cut so that prompt and completion fit ``max_sequence_tokens``
    (0: no limit); None when the prompt alone leaves no room for one token."""
    if max_sequence_tokens <= 0:
        return budget
    room = max_sequence_tokens - prompt_tokens
    return min(budget, room) if room >= 1 else None


def group_budget(row: dict, cap: int) -> int:
    """Completion tokens for ``row``'s group: its own budget, at most ``cap``
    (``rollout.max_new_tokens``)."""
    value = row.get(FIELD)
    if value is None:
        return cap
    if _bad(value):  # a row that did not come through check_budgets (another source)
        raise ValueError(f"prompt row: field {FIELD!r} must be a positive integer, got {value!r}")
    return min(int(value), cap)
