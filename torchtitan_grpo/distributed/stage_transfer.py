"""Bring the tensors rank 0 lacks (held by other pipeline stages) to rank 0.

Under pipeline parallelism each rank holds one stage's tensors, but only rank
0 pushes to the inference servers, so every tensor rank 0 does not hold has to
be sent to it, point to point. Two pushes need this: the full-weight gather
(``gather.ShardGatherer``) and the LoRA push (``lora_pp.PipelineLoraPush``).

:func:`plan_to_rank0` decides once, with one collective, who sends what;
:func:`exchange_to_rank0` then runs the plan every push. Each tensor comes
from the *lowest* rank holding it: within a stage that rank is the one taking
part in all of the stage's own gathers, so it holds the full value. Both sides
walk the same list in the same order, so every recv on rank 0 meets its send.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["Entry", "Transfer", "plan_to_rank0", "exchange_to_rank0", "sent_by"]

Entry = tuple[list[str], tuple[int, ...], torch.dtype]
"""One tensor of this rank: every name it is known under (tied weights have
several; the first is the one looked up), its shape and its dtype."""


class Transfer(NamedTuple):
    """One point-to-point send to rank 0 (a tuple, so it unpacks as
    ``src, names, shape, dtype``)."""

    src: int
    """The lowest rank holding the tensor (a rank of the planning group)."""
    names: list[str]
    """Every name of the tensor; on rank 0 all of them point to the one received tensor."""
    shape: tuple[int, ...]
    dtype: torch.dtype


def plan_to_rank0(entries: list[Entry], group: dist.ProcessGroup | None = None,
                  skip: Callable[[list[str], tuple[int, ...], torch.dtype], bool] | None = None) -> list[Transfer]:
    """The transfers that bring rank 0 every tensor it lacks, in the order
    both sides run them; the same list on every rank (a collective).

    ``entries``: this rank's tensors. ``group``: the group to plan and send
    on; it must span the whole world (the gather's own copy of it), since the
    sends go to global rank 0 by global rank. ``skip``: tensors of other ranks
    to leave out (the full-weight push leaves out those without an HF name,
    e.g. the last stage's copy of tied embeddings). A name rank 0 holds under
    any alias is never sent; a tensor is sent once, by the lowest other rank
    holding one of its names first, with all of its names."""
    world = dist.get_world_size(group)
    if group is not None and world != dist.get_world_size():
        raise ValueError(f"plan_to_rank0: the group has {world} ranks, the world {dist.get_world_size()}; "
                         "it must span the whole world")
    everyone: list = [None] * world
    dist.all_gather_object(everyone, [(list(names), tuple(shape), dtype) for names, shape, dtype in entries],
                           group=group)
    have = {n for names, _, _ in everyone[0] for n in names}
    plan: list[Transfer] = []
    for src in range(1, world):
        for names, shape, dtype in everyone[src]:
            if skip is not None and skip(names, shape, dtype):
                continue
            if names[0] not in have:
                have.update(names)
                plan.append(Transfer(src, names, shape, dtype))
    return plan


def sent_by(plan: list[Transfer], rank: int) -> set[str]:
    """Every name ``rank`` sends under ``plan`` (its tensors it must keep whole)."""
    return {n for t in plan if t.src == rank for n in t.names}


def exchange_to_rank0(plan: list[Transfer], tensors: dict[str, torch.Tensor], device: torch.device,
                      group: dist.ProcessGroup | None = None,
                      prepare: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.contiguous) -> None:
    """Run ``plan`` (from :func:`plan_to_rank0` on the same group): rank 0
    receives each tensor on ``device`` and adds it to ``tensors`` under all
    its names (one tensor, so aliases stay tied); its sender sends
    ``prepare(tensors[names[0]])`` (send needs a contiguous tensor on the
    backend's device: NCCL a GPU's, gloo the CPU). Other ranks only send."""
    rank = dist.get_rank()
    for src, names, shape, dtype in plan:
        if rank == 0:
            t = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(t, src=src, group=group)
            for n in names:
                tensors[n] = t
        elif rank == src:
            dist.send(prepare(tensors[names[0]]), dst=0, group=group)
