"""One weight group over the trainer and several replicas (``fanout = "broadcast"``).

SGLang's ``/init_weights_update_group`` takes ``rank_offset`` and
``world_size``, so a weight group need not be a pair: the trainer is rank 0
and hosts the store, replica k (with ``n_k`` ranks, its TP size) joins at
``rank_offset = 1 + n_0 + ... + n_{k-1}``, and one ``broadcast(src=0)`` of a
bucket reaches every rank. The built-in server joins any rank of any world
size the same way (``group.init_weight_group``) and its receive is a
broadcast from rank 0 whatever the world size, so nothing changes on the
receive side. (vLLM's protocol would allow it too: its workers take
``world_size`` = 1 + every worker of every replica; not wired here.)

A group is made for a fixed set of members and never changes: a collective
needs every rank, so a member that leaves means a new group, made by
:func:`form_group` under the next generation's name (``grpo_fanout_<gen>``:
a replica may hold its own per-replica group beside it, the server keys
groups by name), and the old one destroyed on the members that remain.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import torch

from torchtitan_grpo.aio import DaemonExecutor
from torchtitan_grpo.protocol import sglang
from torchtitan_grpo.reasons import reason
from torchtitan_grpo.weight_sync.control import PushError
from torchtitan_grpo.weight_sync.group import init_weight_group, master_store
from torchtitan_grpo.weight_sync.transport import Replica, Transport

logger = logging.getLogger(__name__)


def group_name(gen: int) -> str:
    """The name of generation ``gen``'s group (never the per-replica ``weight_update_group``)."""
    return f"grpo_fanout_{gen}"


def rank_offsets(ranks: list[int]) -> tuple[list[int], int]:
    """Each member's ``rank_offset`` (the trainer is rank 0) and the world size."""
    offsets, at = [], 1
    for n in ranks:
        if n < 1:
            raise ValueError(f"a replica joins with at least one rank, got {n}")
        offsets.append(at)
        at += n
    return offsets, at


@dataclass
class BroadcastGroup:
    """The trainer's end of one multi-replica group."""

    name: str
    members: list[str]
    """The members' URLs, in rank order."""
    world_size: int
    link: Replica
    """What ``GroupPush.broadcast_all`` reads: the group, the thread its
    blocking broadcasts run on and, for nccl, their CUDA stream."""

    def abort(self) -> None:
        """Unblock a broadcast in flight (NCCL; gloo ends at its timeout) and drop the group."""
        if self.link.group is not None:
            self.link.group.abort()
        self._drop_thread()

    def close(self) -> None:
        if self.link.group is not None:
            self.link.group.close()
        self._drop_thread()

    def _drop_thread(self) -> None:
        if self.link.executor is not None:
            self.link.executor.shutdown(wait=False, cancel_futures=True)
        self.link.group = self.link.executor = self.link.stream = self.link.uploader = None


async def form_group(t: Transport, members: list[Replica], gen: int) -> BroadcastGroup:
    """Make generation ``gen``'s group over ``members`` (in that rank order):
    every member's HTTP join and ours run at once, each blocking until all
    ranks are in. Raises ``PushError`` naming the members that failed."""
    cfg = t.cfg
    name = group_name(gen)
    offsets, world = rank_offsets([r.world_size - 1 for r in members])
    executor = DaemonExecutor(f"push-{name}")
    loop = asyncio.get_running_loop()
    try:
        store = await loop.run_in_executor(executor, master_store, cfg.master_address, world, cfg.init_timeout_s)
        join = loop.run_in_executor(executor, lambda: init_weight_group(
            cfg.master_address, store.port, 0, world, backend=cfg.backend, group_name=name,
            timeout_s=cfg.init_timeout_s, device=t.device if cfg.backend == "nccl" else None, store=store))
        https = [asyncio.ensure_future(t.post(r, "/init_weights_update_group", sglang.init_group_request(
            cfg.master_address, store.port, off, world, name, cfg.backend), cfg.init_timeout_s))
            for r, off in zip(members, offsets)]
        results = await asyncio.gather(join, *https, return_exceptions=True)
    except BaseException:
        executor.shutdown(wait=False, cancel_futures=True)
        raise
    group, replies = results[0], results[1:]
    failed = [f"{r.url}: {reason(e)}" for r, e in zip(members, replies) if isinstance(e, BaseException)]
    if isinstance(group, BaseException) or failed:
        if not isinstance(group, BaseException):
            group.abort()
        executor.shutdown(wait=False, cancel_futures=True)
        why = "; ".join(failed) or reason(group)
        raise PushError(f"the broadcast group {name!r} over {len(members)} replica(s) could not be formed: {why}")
    link = Replica(f"broadcast:{name}", world_size=world)
    link.group, link.executor = group, executor
    if cfg.backend == "nccl":
        link.stream = await loop.run_in_executor(executor, lambda: torch.cuda.Stream(device=t.device))
    logger.info("broadcast group %s formed: trainer + %d replica(s), world size %d", name, len(members), world)
    return BroadcastGroup(name, [r.url for r in members], world, link)


async def destroy_on(t: Transport, replicas: list[Replica], name: str) -> None:
    """Destroy group ``name`` on ``replicas`` (best effort: one may already be gone)."""
    async def one(r: Replica) -> None:
        try:
            await t.post(r, "/destroy_weights_update_group", {"group_name": name}, t.cfg.init_timeout_s)
        except Exception as e:
            logger.info("destroying %s on %s: %s", name, r.url, reason(e))

    await asyncio.gather(*(one(r) for r in replicas))
