"""The static cache's shared-prompt books (server/engine/shared_prompts.py): which slot each
row reads its prompt's KV from, as rows join and leave; the device buffers follow the host's.
The kernel's side is tests/test_paged_attention.py's."""

from __future__ import annotations

import torch

from torchtitan_grpo.server.engine.shared_prompts import SharedPrompts


def _state(sp: SharedPrompts) -> tuple[list[int], list[int]]:
    assert sp.src.tolist() == sp._src and sp.length.tolist() == sp._length  # device = host mirror
    return sp._src, sp._length


def test_siblings_read_the_owner_then_the_lowest_one_left():
    sp = SharedPrompts(8, torch.device("cpu"))
    assert _state(sp) == (list(range(8)), [0] * 8)
    # one prompt of 3 samples in slots 0-2 (its prefill wrote slot 0), one of 2 in slots 3-4
    sp.prefilled([0, 1, 2, 3, 4], [0, 0, 0, 3, 3], [10, 10, 10, 7, 7])
    assert _state(sp) == ([0, 0, 0, 3, 3, 5, 6, 7], [0, 10, 10, 0, 7, 0, 0, 0])
    sp.left([0, 4], [1, 2, 3])  # the first prompt's owner leaves, and the second's sibling
    assert _state(sp) == ([0, 1, 1, 3, 4, 5, 6, 7], [0, 0, 10, 0, 0, 0, 0, 0])
    sp.left([1], [2, 3])  # the new source leaves too: the last sample reads its own copy
    assert _state(sp) == ([0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 0, 0, 0, 0])
    sp.prefilled([0, 1], [1, 1], [4, 4])  # a new prompt in the freed slots, written to slot 1
    assert _state(sp) == ([1, 1, 2, 3, 4, 5, 6, 7], [4, 0, 0, 0, 0, 0, 0, 0])
    sp.clear()
    assert _state(sp) == (list(range(8)), [0] * 8)


def test_step_args_are_views_of_the_fixed_buffers():
    """A captured decode graph reads the buffers at their addresses: args() must not copy."""
    sp = SharedPrompts(4, torch.device("cpu"))
    src, length = sp.args(2)
    sp.prefilled([0, 1], [0, 0], [5, 5])
    assert src.tolist() == [0, 0] and length.tolist() == [0, 5]
    assert src.data_ptr() == sp.src.data_ptr() and length.data_ptr() == sp.length.data_ptr()
