"""DAPO's dynamic sampling: a step trains only on groups that carry signal.

A group whose rewards are all equal has zero advantages: it adds nothing to
the policy gradient and only dilutes the loss normaliser. Dropping such groups
from a batch (``grpo.filter_constant_groups``) shrinks the batch, and with a
strong model on an easy set most groups are all-correct, so the step's
effective batch collapses. Dynamic sampling (DAPO, arXiv 2503.14476, sec. 3.2)
instead discards a constant group before it reaches the producer's buffer and
draws another prompt in its place, so every step takes ``prompts_per_step``
groups with signal.

The guard: a model that solves (or fails) every prompt would make that loop
sample forever. After ``max_filtered`` constant groups discarded one after
another (finishing order), the next constant groups are kept (they train with
zero advantages; the run goes on) until a group with signal arrives, which
re-arms the filter. The first time the guard opens, one warning is logged.

This module only decides; the producer (``producer.py``) disposes of a
discarded group: in the ledger as handed (a resume does not draw it again),
its in-flight slot released and admission woken.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("torchtitan_grpo")

DEFAULT_MAX_FILTERED_PER_PROMPT = 10
"""``max_filtered = 0`` means this many times ``prompts_per_step``."""


def resolve_max_filtered(max_filtered: int, prompts_per_step: int) -> int:
    """``grpo.dynamic_sampling_max_filtered``, 0 resolved to its default."""
    if max_filtered < 0:
        raise ValueError(f"grpo.dynamic_sampling_max_filtered must be >= 0, got {max_filtered}")
    return max_filtered or DEFAULT_MAX_FILTERED_PER_PROMPT * prompts_per_step


class DynamicSampler:
    """Keeps or discards each finished group. Not thread-safe: the producer
    calls it under its own lock."""

    def __init__(self, max_filtered: int, prompts_per_step: int):
        self.max_filtered = resolve_max_filtered(max_filtered, prompts_per_step)
        self.filtered = 0
        """Groups discarded since the last :meth:`take_filtered`."""
        self.in_a_row = 0
        """Constant groups discarded one after another (reset by a group with signal)."""
        self._warned = False

    def keep(self, constant: bool) -> bool:
        """Whether a finished group goes into the buffer (False: discard it)."""
        if not constant:
            self.in_a_row = 0
            return True
        if self.in_a_row >= self.max_filtered:
            if not self._warned:  # once per run: the guard may open again, the line would repeat
                self._warned = True
                logger.warning(
                    "dynamic sampling: %d groups in a row had equal rewards (no signal); letting such groups train "
                    "with zero advantages until one with signal arrives (grpo.dynamic_sampling_max_filtered; the "
                    "task may be too easy or too hard for the model; rollout/constant_groups counts them)",
                    self.in_a_row)
            return True
        self.in_a_row += 1
        self.filtered += 1
        return False

    def take_filtered(self) -> int:
        """Groups discarded since the last call (one trainer step's)."""
        n, self.filtered = self.filtered, 0
        return n
