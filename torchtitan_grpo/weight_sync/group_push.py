"""What SGLang's and vLLM's protocols share: a weight group of the replica's
own (``PushConfig.backend`` "gloo" or "nccl"; own store port, own
communicator, never the trainer's FSDP/TP groups) that the bytes are
broadcast on, from a thread of the replica's own (and on GPUs its own CUDA
stream), while HTTP requests drive the replica's receives.

``GroupPush`` joins the group (the replica's HTTP join and ours at once),
broadcasts staged buckets while the update requests are in flight, and tears
the group down at an ejection; the protocols (``sglang_push``,
``vllm_push``) say which requests go around the broadcasts.
"""

from __future__ import annotations

import abc
import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

import torch

from torchtitan_grpo.aio import DaemonExecutor
from torchtitan_grpo.weight_sync import buckets as bk
from torchtitan_grpo.weight_sync.control import answered, until
from torchtitan_grpo.weight_sync.group import init_weight_group, master_store
from torchtitan_grpo.weight_sync.staging import Staged
from torchtitan_grpo.weight_sync.transport import Replica, Transport
from torchtitan_grpo.weight_sync.upload import Uploader


def spec_lists(specs: list[bk.TensorSpec]) -> tuple[list[str], list[str], list[list[int]]]:
    """Names, dtype names and shapes: the metadata of an update request."""
    return [b.name for b in specs], [bk.dtype_name(b.dtype) for b in specs], [list(b.shape) for b in specs]


class GroupPush(Transport):
    """Base of the transports over a weight group per replica."""

    group_name: str
    """The group's name in the store (the replica's side joins under it too)."""

    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        self._bodies: tuple[list, list[bytes]] | None = None  # (plan, its update requests' JSON)

    @property
    def reads_host_memory(self) -> bool:
        return self.cfg.backend == "gloo"

    # ------------------------------------------------------ the protocol's part

    @abc.abstractmethod
    async def replica_ranks(self, r: Replica) -> int:
        """How many ranks ``r`` joins the group with."""

    @abc.abstractmethod
    def init_request(self, r: Replica, port: int) -> tuple[str, dict]:
        """The route and body that make ``r`` join a group at ``port``."""

    @abc.abstractmethod
    def update_requests(self, plan: list[list[bk.TensorSpec]]) -> list[dict]:
        """The update requests of a version in ``plan``, as far as they are the
        same every version (``encoded_updates`` encodes them once)."""

    async def rendezvous(self, r: Replica, executor: DaemonExecutor) -> tuple[int, Callable[[], Any]]:
        """The store port ``r`` is told, and our join (run on ``executor``):
        a store of our own that both sides meet in."""
        store = await asyncio.get_running_loop().run_in_executor(
            executor, master_store, self.cfg.master_address, r.world_size, self.cfg.init_timeout_s)
        return store.port, lambda: init_weight_group(
            self.cfg.master_address, store.port, 0, r.world_size, backend=self.cfg.backend,
            group_name=self.group_name, timeout_s=self.cfg.init_timeout_s,
            device=self.device if self.cfg.backend == "nccl" else None, store=store)

    # ------------------------------------------------------------- transport

    async def connect(self, r: Replica) -> None:
        """One weight group for replica ``r``: its HTTP join and ours run at
        once (each blocks until the other side has joined)."""
        r.world_size = 1 + await self.replica_ranks(r)
        t = await self.probe_builtin(r)  # before the rendezvous: a real vLLM joins its own way
        r.builtin, r.ack_posted, r.end_version = t.builtin, t.ack_posted, t.end_version
        executor = DaemonExecutor(f"push-{r.url}")
        loop = asyncio.get_running_loop()
        try:
            port, join_fn = await self.rendezvous(r, executor)
        except BaseException:
            executor.shutdown(wait=False, cancel_futures=True)
            raise
        path, body = self.init_request(r, port)
        http = asyncio.create_task(self.post(r, path, body, self.cfg.init_timeout_s))
        join = loop.run_in_executor(executor, join_fn)
        try:
            group, _ = await asyncio.gather(join, http)
        except BaseException:
            http.cancel()
            executor.shutdown(wait=False, cancel_futures=True)
            raise
        if self.cfg.backend == "nccl":
            r.stream = await loop.run_in_executor(executor, lambda: torch.cuda.Stream(device=self.device))
        r.group, r.executor = group, executor

    def abort(self, r: Replica) -> None:
        if r.group is not None:
            r.group.abort()  # unblocks a hung NCCL receive; the trainer never waits on it
        if r.executor is not None:
            r.executor.shutdown(wait=False, cancel_futures=True)  # a stuck gloo thread is abandoned
        r.group, r.executor, r.stream, r.uploader = None, None, None, None

    def release(self, r: Replica) -> None:
        if r.group is not None:
            r.group.close()
        if r.executor is not None:
            r.executor.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- helpers

    def encoded_updates(self, plan: list[list[bk.TensorSpec]]) -> list[bytes]:
        """``update_requests(plan)`` as JSON, the same every version, so
        encoded once per plan (~0.6 ms for 399 tensors)."""
        if self._bodies is None or self._bodies[0] is not plan:
            self._bodies = (plan, [json.dumps(b).encode() for b in self.update_requests(plan)])
        return self._bodies[1]

    async def end_session(self, r: Replica, answers: list[asyncio.Future], path: str, body: dict | None) -> None:
        """Once every byte has arrived: the updates' replies, then the
        session's end (``path`` with ``body``; None: no session to end).
        SGLang and vLLM promise no order between requests in flight, so the
        end goes out only after the replies."""
        await answered(answers)
        if body is not None:
            await self.post(r, path, body, self.cfg.deadline_s)

    async def with_broadcasts(self, r: Replica, answers: list[asyncio.Future], staged: Staged,
                              buckets: list[int], wait: bool = True) -> None:
        """Broadcast ``staged``'s ``buckets`` (indices) to ``r`` while its update requests ``answers``
        are in flight; return once the broadcasts are done (the replica has
        the bytes; its replies may still be coming), or with ``wait=False``
        once they are queued on the sender's stream. If a request fails
        meanwhile (a refused update posts no receive), stop at once."""
        stop = threading.Event()
        # One hop to the replica's thread for all of them, not one per buffer
        # through the event loop (on 2 H200s this made no measurable
        # difference to push bandwidth: docs/perf-history/weight-push.md, runs 4 and 5).
        send = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(
            r.executor, self.broadcast_all, r, staged, buckets, stop, wait))
        try:
            await until(send, answers)
        except BaseException:
            stop.set()  # no further buffer is sent to a replica that refused or failed
            raise

    @staticmethod
    def broadcast_all(r: Replica, staged: Staged, buckets: list[int], stop: threading.Event,
                      wait: bool = True) -> None:
        """The replica's thread: broadcast ``buckets`` of ``staged``, each
        once its snapshot copy is queued; only the last (``wait``) is waited
        for on the host."""
        group, stream = r.group, r.stream  # an ejection clears them while this thread may still run
        up = None
        if stream is not None and staged.buffers[0].device.type == "cpu":  # staging "host" over nccl
            staged.await_written(stop)  # the uploads follow every bucket's copy to the host
            up = r.uploader
            need = max(b.numel() for b in staged.buffers)
            if up is None or up.nbytes < need:
                up = r.uploader = Uploader(stream.device, need)
            if buckets[0] == 0:  # every transfer starts at bucket 0
                up.begin(staged.buffers, staged.ready)
        for i, k in enumerate(buckets):
            if stop.is_set():
                return
            last = wait and i == len(buckets) - 1
            if up is not None:
                group.broadcast(up.take(k, stream), src=0, stream=stream, wait=False)
                up.sent(k, stream)  # bucket k+1 uploads while k is sent
                if last:
                    stream.synchronize()
                continue
            # Bucket by bucket: in a push that waits (published before it is
            # staged), the first broadcast is queued as soon as the first
            # bucket's copies are, not after the whole snapshot.
            staged.await_written(stop, bucket=k)
            if stop.is_set():
                return
            if staged.ready is not None:  # the snapshot's copy of this bucket
                if stream is not None:
                    stream.wait_event(staged.ready[k])
                else:
                    staged.ready[k].synchronize()  # gloo from pinned memory: the copy may still run
            # Only the last is waited for on the host: each chunk follows the
            # one before on the stream, with no host round trip in between.
            group.broadcast(staged.buffers[k], src=0, stream=stream, wait=last)
