"""Which slot each row of the static cache reads its prompt's KV from (issue 50).

A GRPO request asks for ``n`` samples of one prompt. The static batch prefills
the prompt once and copies its KV into every sample's slot, so a decode step's
attention reads the same prompt bytes ``n`` times from HBM: at 64 rows of the
Qwen3-4B shape with 128-token prompts and 1,024 new tokens, a fifth of the
step's KV reads. Here each sample is pointed at one sibling's copy for its
prompt positions (``paged_attention.paged_decode``'s ``shared``): the
siblings' programs run side by side, so L2 serves all reads but the first.
The bytes read are equal to the row's own, so the attention is unchanged to
the bit; the copies stay, because a sibling may end first and its slot be
given to another request: the rows that read from it then move to the
lowest sibling still running.

Kept as two slot-indexed device buffers (``src``, ``length``), written only
when rows join or leave (a small upload, not per step) and read by every
captured decode graph at their fixed addresses; host mirrors decide what to
rewrite. ``TORCHTITAN_GRPO_SHARED_PROMPTS=0`` turns it off (an A/B switch).
"""

from __future__ import annotations

import os

import torch

from torchtitan_grpo.server.engine.to_device import upload


def enabled() -> bool:
    return os.environ.get("TORCHTITAN_GRPO_SHARED_PROMPTS") != "0"


class SharedPrompts:
    """Per slot: the slot its first ``length`` positions are read from (itself and 0 when it
    shares nothing)."""

    def __init__(self, slots: int, device: torch.device):
        self.device = device
        self.src = torch.arange(slots, device=device)
        self.length = torch.zeros(slots, dtype=torch.long, device=device)
        self._src = list(range(slots))  # host mirrors
        self._length = [0] * slots

    def args(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``paged_decode``'s ``shared`` for a step over slots ``[0, b)``."""
        return self.src[:b], self.length[:b]

    def prefilled(self, slots: list[int], owners: list[int], lengths: list[int]) -> None:
        """``slots[i]`` now holds a copy of the first ``lengths[i]`` positions of ``owners[i]``
        (its own slot for the sample whose prefill wrote them)."""
        self._set({s: (o, n if o != s else 0) for s, o, n in zip(slots, owners, lengths)})

    def left(self, freed: list[int], live: list[int]) -> None:
        """``freed`` slots' rows ended, ``live`` slots' rows run on: those that read from a freed
        slot read from the lowest of their group still live instead (it holds the same copy)."""
        gone = set(freed)
        change = {s: (s, 0) for s in freed}
        groups: dict[int, list[int]] = {}
        for s in live:
            if self._src[s] in gone:
                groups.setdefault(self._src[s], []).append(s)
        for group in groups.values():
            new = min(group)
            change.update({s: (new, self._length[s] if s != new else 0) for s in group})
        self._set(change)

    def clear(self) -> None:
        self._set({s: (s, 0) for s in range(len(self._src)) if self._src[s] != s or self._length[s]})

    def _set(self, change: dict[int, tuple[int, int]]) -> None:
        if not change:
            return
        slots = sorted(change)
        for s in slots:
            self._src[s], self._length[s] = change[s]
        at, src, length = upload([slots, [self._src[s] for s in slots], [self._length[s] for s in slots]],
                                 self.device)
        self.src[at] = src
        self.length[at] = length
