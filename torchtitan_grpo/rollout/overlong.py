"""Overlong reward shaping: a graded penalty for completions near their budget.

DAPO's "soft overlong punishment" (arXiv 2503.14476, section 3.4). A
completion cut at its token budget is usually scored as a wrong answer, yet
its reasoning may have been sound: the hard cut is a noisy signal, and one
that only arrives once the budget is spent. A graded penalty over the last
``buffer`` tokens of the budget tells the policy it is running long before it
is cut, so lengths are pushed back smoothly instead of by a cliff.

With ``L_max`` the completion's budget and ``L_cache`` the buffer, a
completion of ``n`` tokens gets ``factor`` times

* 0 when ``n <= L_max - L_cache``;
* ``((L_max - L_cache) - n) / L_cache``, in ``[-1, 0)``, inside the buffer;
* -1 past ``L_max``.

It is added to the task reward before the group's advantages
(``groups.GroupScorer``, ``grpo.overlong_buffer_tokens``), so among equally
correct completions the shorter one gets the larger advantage.
"""

from __future__ import annotations

from typing import Sequence


def overlong_penalty(length: int, max_len: int, buffer: int, factor: float = 1.0) -> float:
    """The penalty (<= 0) of a completion of ``length`` tokens with budget
    ``max_len`` and a buffer of ``buffer`` tokens; 0 when ``buffer`` is 0 (off).

    A budget no larger than the buffer (a dataset row's own small
    ``max_new_tokens``, a long prompt's budget cut to the sequence limit) is
    graded over its whole length: the buffer is capped at the budget, so the
    penalty stays in [-factor, 0] instead of putting every completion of that
    group near -factor."""
    if buffer <= 0:
        return 0.0
    buffer = min(buffer, max_len)
    free = max_len - buffer
    if length <= free:
        return 0.0
    if length > max_len:
        return -factor
    return factor * (free - length) / buffer


def shape_rewards(rewards: Sequence[float], lengths: Sequence[int], max_len: int, buffer: int,
                  factor: float = 1.0) -> tuple[list[float], float]:
    """Each reward plus its completion's penalty, and the group's mean penalty."""
    penalties = [overlong_penalty(n, max_len, buffer, factor) for n in lengths]
    shaped = [r + p for r, p in zip(rewards, penalties, strict=True)]
    return shaped, sum(penalties) / len(penalties) if penalties else 0.0
