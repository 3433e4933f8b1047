"""SGLang's weight-update protocol over a weight group, as a real SGLang
0.5.x gets it (see PROTOCOLS.md):

    pause -> begin -> (update request k, broadcast of bucket k) per bucket -> end -> continue

Each request that must follow another goes out after the other's reply. An
update request is posted before its broadcast, and the first broadcast waits
until ``begin`` was confirmed, so a receive is always waiting when the bytes
arrive. The request for bucket k+1 is posted as soon as bucket k has
arrived; its broadcast starts after the reply to k. A replica loads a
session's buckets as one version at its end; the served version rides with
the last bucket's update.

The SGLang routes that do not need a group (a session's begin and end, the
version tag, the clean-up before a rejoin, the replica's ranks) are module
functions here: the disk and ipc transports speak them too.

The built-in server takes more (pipelined requests, ``?ack=posted``, the
version at the session's end): ``builtin_push`` adds that beside this.
"""

from __future__ import annotations

import asyncio

from torchtitan_grpo.protocol import sglang
from torchtitan_grpo.weight_sync import buckets as bk
from torchtitan_grpo.weight_sync.control import Requests, until
from torchtitan_grpo.weight_sync.group_push import GroupPush, spec_lists
from torchtitan_grpo.weight_sync.staging import Staged
from torchtitan_grpo.weight_sync.transport import Replica, Transport


# ------------------------------------------------- SGLang routes of any transport


async def server_ranks(t: Transport, r: Replica) -> int:
    """SGLang's tp_size from /get_server_info, else 1 (the built-in server)."""
    info = await t.get(r.url + "/get_server_info")
    tp = info.get("tp_size") if isinstance(info, dict) else None
    return int(tp) if isinstance(tp, int) and tp >= 1 else 1


async def tag_version(t: Transport, replicas: list[Replica], version: int) -> None:
    """Name the weights each replica loaded from disk ``version``."""
    await asyncio.gather(*(t.post(r, "/update_weight_version",
                                  {"new_version": str(version), "abort_all_requests": False}, 30)
                           for r in replicas))


async def reset_replica(t: Transport, r: Replica) -> None:
    """Close what an abandoned transfer left open on ``r`` (its old group,
    its update session, a pause); each may already be gone."""
    # The group goes first: the built-in server then drops what it received
    # of the abandoned version, so that closing the session loads nothing.
    for path, body in (("/destroy_weights_update_group", {"group_name": sglang.GROUP_NAME}),
                       ("/end_weight_update", {}), ("/continue_generation", {})):
        try:
            await t.post(r, path, body, t.cfg.init_timeout_s)
        except Exception:
            pass


async def begin_session(r: Replica, req: Requests) -> asyncio.Future | None:
    """SGLang >= 0.5.23 needs an update session; older builds answer 404
    (probed once per replica, then skipped). Returns begin's reply (None:
    no session), which the first broadcast waits for: an update without
    a session posts no receive."""
    if not r.sessionful:
        return None
    begin = req.post("/begin_weight_update", {"selector": "all"}, 30)
    try:
        await req.ordered(begin)
    except FileNotFoundError:
        r.sessionful = False
        return None
    return begin


# ------------------------------------------------------------------ transport


class SGLangPush(GroupPush):
    """SGLang's protocol over a weight group (backend "gloo" or "nccl")."""

    group_name = sglang.GROUP_NAME

    async def replica_ranks(self, r: Replica) -> int:
        return await server_ranks(self, r)

    def init_request(self, r: Replica, port: int) -> tuple[str, dict]:
        return "/init_weights_update_group", sglang.init_group_request(
            self.cfg.master_address, port, 1, r.world_size, self.group_name, self.cfg.backend)

    async def tag(self, replicas: list[Replica], version: int) -> None:
        await tag_version(self, replicas, version)

    async def reset(self, r: Replica) -> None:
        await reset_replica(self, r)

    def update_requests(self, plan: list[list[bk.TensorSpec]]) -> list[dict]:
        """Each bucket's update request, without the version (the last one
        flushes the cache; ``update_body`` adds the version to it)."""
        return [self.update_request(plan, k, None) for k in range(len(plan))]

    def update_request(self, plan: list[list[bk.TensorSpec]], k: int, version: str | None) -> dict:
        """Bucket ``k``'s update request (the last one flushes the cache)."""
        return sglang.update_request(*spec_lists(plan[k]), self.group_name, flattened=True,
                                     flush_cache=self.cfg.pause_mode != "in_place" and k == len(plan) - 1,
                                     weight_version=version)

    def update_body(self, r: Replica, staged: Staged, k: int) -> dict | bytes:
        """What bucket ``k``'s update request carries: the encoded one, but
        the last, which sets the version the replica serves from the end."""
        if k < len(staged.plan) - 1:
            return self.encoded_updates(staged.plan)[k]
        return self.update_request(staged.plan, k, str(staged.version))

    def end_body(self, r: Replica, staged: Staged) -> dict:
        """The body of ``/end_weight_update``."""
        return {}

    async def send(self, r: Replica, staged: Staged) -> None:
        """pause -> begin -> (update request + broadcast) per bucket -> end -> continue."""
        req = Requests(self.session, r.url)
        pausing = self.cfg.pause_mode != "none"
        try:
            watched: list[asyncio.Future] = []  # every request so far: the first failure stops the transfer
            if pausing:
                watched.append(req.post("/pause_generation", {"mode": self.cfg.pause_mode}, 30))
                await req.ordered(watched[-1])
            begin = await begin_session(r, req)
            if begin is not None:
                watched.append(begin)
            updates: list[asyncio.Future] = []
            for k in range(len(staged.plan)):
                # Request k goes out once bucket k-1 has arrived, before the
                # reply to k-1: the replica then already holds request k-1
                # (its receive was posted), so k queues behind it (SGLang's
                # update lock) and is parsed while k-1 finishes.
                updates.append(req.post("/update_weights_from_distributed", self.update_body(r, staged, k),
                                        self.cfg.deadline_s))
                watched.append(updates[-1])
                if k == 0 and begin is not None:
                    await until(begin, watched)  # a session, or the update posts no receive
                elif k > 0:
                    # Bucket k is broadcast only after the reply to k-1, when the
                    # replica is about to post its receive: an NCCL broadcast
                    # launched earlier spins on the trainer's GPU until then
                    # (2 H200s: a replica slowed 10x made the async step 1.30x
                    # slower that way, docs/perf-history/weight-push.md runs 10-11).
                    await until(updates[k - 1], watched)
                await self.with_broadcasts(r, watched, staged, [k])
            # The replica loads a session's buckets as one version at its end.
            await self.end_session(r, updates, "/end_weight_update",
                                   self.end_body(r, staged) if r.sessionful else None)
        finally:
            if pausing:
                await self.unpause(r, "/continue_generation", {})
