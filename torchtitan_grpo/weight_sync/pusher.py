"""The weight-push sidecar: snapshot on the trainer, one sender per replica.

The trainer calls ``push(tensors, version)`` after each optimizer step. That
call only copies the tensors into a free *staging buffer* (``staging``:
flattened buckets, a device copy on GPUs) and returns; if every staging
buffer is still being sent, it skips this version instead of waiting.
Everything else happens on the sidecar:

* Each replica has its own sender, an asyncio task, that hands versions to
  the transport (``transport``: one per Pusher, picked in ``TRANSPORTS``;
  over a weight group each replica also gets its own thread for the blocking
  broadcasts, its own CUDA stream and its own group, never the trainer's
  FSDP/TP groups).
* A sender always sends the newest staged version and skips older ones; a
  replica only ever loads whole versions (an update session of the replica's
  protocol, the version set at its end).
* A transfer that misses ``deadline_s`` (or fails) is abandoned: the
  transport aborts it, the replica is ejected from routing, its sender
  reconnects in the background, sends it the newest version, and only then
  readmits it.
* A replica the inference pool knows to be down (``replica_down``) is
  treated the same way at once, not at its deadline: a hung replica must not
  hold a push that waits, nor a staging buffer, for ``deadline_s``.

``mode = "sync"`` uses the same machinery and then waits until every
admitted replica serves the new version (the on-policy baseline).

When the caller waits for the replicas (sync mode), a version is handed to
the senders as soon as its staging buffer is chosen, before the trainer has
copied anything into it: the transfer's control plane (SGLang's pause, begin
and first update request, and the replica's parsing of it) then runs while
the trainer's thread stages, and only the broadcasts wait, each until the
copies of its own bucket are queued. In async mode it is handed over once
staged, so that the trainer's thread never competes with the senders for the
GIL during its snapshot.

What each protocol sends, and in which order: ``sglang_push``,
``vllm_push``, ``builtin_push`` (the built-in server's extensions),
``ipc_push``, ``disk_push``.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import threading
import time
from typing import Callable, Protocol

import torch

from torchtitan_grpo.aio import LoopThread
from torchtitan_grpo.reasons import reason, typed_reason
from torchtitan_grpo.weight_sync.control import PushError
from torchtitan_grpo.weight_sync.push_config import PushConfig
from torchtitan_grpo.weight_sync.staging import Staged, StagingBuffers
from torchtitan_grpo.weight_sync.transport import Replica, Transport

__all__ = ["NoPush", "PushConfig", "PushError", "Pusher", "ReplicaDown", "TRANSPORTS", "WeightPusher"]

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0
"""``close``: how long each replica's health check and teardown may take
together (all replicas at once; one down is skipped, never waited for)."""

TRANSPORTS: dict[str, str | type[Transport]] = {
    # Over a weight group (backend "gloo" or "nccl"), by protocol; each falls
    # back to the plain protocol for a replica that is not the built-in server.
    "sglang": "builtin_push.BuiltinSGLangPush",
    "vllm": "builtin_push.BuiltinVLLMPush",
    # Transports of their own (the backend's name; "ipc" by protocol).
    "ipc": "ipc_push.IpcPush",  # SGLang's /update_weights_from_tensor
    "disk": "disk_push.DiskPush",
    "vllm_ipc": "vllm_ipc_push.VLLMIpcPush",  # vLLM's IPC weight-transfer engine
    "adapter": "adapter_push.AdapterPush",  # weight_sync.lora_push = "adapter": LoRA adapters, not weights
    "delta": "delta_push.DeltaPush",  # weight_sync.delta: changed elements against the replica's version
    "broadcast": "fanout.BroadcastFanout",  # weight_sync.fanout = "broadcast": one group over every replica
}
"""Every transport, by name: ``"<module of weight_sync>.<class>"`` (imported
when picked) or the class itself. A new transport is a module of its own and
a line here."""


def make_transport(cfg: PushConfig, device: torch.device) -> Transport:
    """``TRANSPORTS[backend]``, or for a weight group (gloo, nccl) ``TRANSPORTS[protocol]``;
    "ipc" is SGLang's or vLLM's by protocol."""
    name = cfg.protocol if cfg.backend in ("gloo", "nccl") else cfg.backend
    name = "vllm_ipc" if name == "ipc" and cfg.protocol == "vllm" else name
    name = "broadcast" if cfg.backend in ("gloo", "nccl") and cfg.fanout == "broadcast" else name
    if name not in TRANSPORTS:
        raise ValueError(f"no weight-push transport {name!r} (backend {cfg.backend!r}, protocol "
                         f"{cfg.protocol!r}); known: {', '.join(TRANSPORTS)}")
    cls = TRANSPORTS[name]
    if isinstance(cls, str):
        module, _, attr = cls.rpartition(".")
        cls = getattr(importlib.import_module(f"{__package__}.{module}"), attr)
    return cls(cfg, device)


class WeightPusher(Protocol):
    def push(self, tensors: dict[str, torch.Tensor], version: int, wait: bool | None = None) -> dict[str, float]: ...

    def close(self) -> None: ...


class NoPush:
    """``weight_sync.mode = "off"``: replicas keep their initial weights."""

    def push(self, tensors, version, wait=None):
        return {}

    def close(self) -> None:
        pass


class ReplicaDown(PushError):
    """The inference pool reported the replica down (``Pusher.replica_down``)."""


def caught_up(r: Replica, replicas: list[Replica], newest: int, mode: str) -> bool:
    """Whether ``r``, ejected and just past a whole transfer, may be routed to again.

    Once it is as current as admitted replicas are: the newest version in sync
    mode (which brings every admitted replica there before the trainer goes
    on); in async mode also the one before (a new version may be staged while
    its transfer runs; demanding lag 0 would never readmit a replica whose
    update outlasts a trainer step), or any version the replicas it would join
    still serve. A version can take longer to send than the trainer takes to
    step (gloo on one GPU: ~2.6 s against ~0.23 s per step for a 0.6B fp32
    model), so that no replica is ever within one version of the newest: one
    that holds at least what every admitted replica serves is then as current
    as the fleet gets, and waiting for a lag of one would keep it out for good."""
    if newest - r.version <= (0 if mode == "sync" else 1):
        return True
    if mode == "sync":
        return False
    serving = [o.version for o in replicas if o.admitted and o is not r]
    return not serving or r.version >= min(serving)


def lag_metrics(replicas: list[Replica], version: int, bytes_per_version: int) -> dict[str, float]:
    """Per replica its lag behind ``version`` and its newest whole transfer's
    rate (HTTP control plane included); ejections and failures in all."""
    m = {}
    for k, r in enumerate(replicas):
        m[f"push/replica{k}_version_lag"] = float(version - r.version)
        if r.last_transfer_s > 0:
            m[f"push/replica{k}_GBps"] = bytes_per_version / r.last_transfer_s / 1e9
    m["push/ejected_replicas"] = float(sum(not r.admitted for r in replicas))
    m["push/failures"] = float(sum(r.failures for r in replicas))
    return m


class Pusher:
    """Created on the trainer's rank 0. ``on_eject(url)`` / ``on_readmit(url)``
    let the inference pool stop and resume routing to a replica (both are
    called on the pusher's event loop); the pool's ``replica_down(url,
    reason)`` takes a replica it knows to be down out of the push at once."""

    def __init__(self, loop: LoopThread, urls: list[str], config: PushConfig, device: torch.device,
                 on_eject: Callable[[str], None] | None = None, on_readmit: Callable[[str], None] | None = None):
        if config.staging not in ("device", "host"):
            raise ValueError(f'staging must be "device" or "host", got {config.staging!r}')
        self.loop, self.cfg, self.device = loop, config, device
        self.transport = make_transport(config, device)
        self.staging = StagingBuffers(config, device, self.transport)
        self.replicas = [Replica(u.rstrip("/")) for u in urls]
        self.on_eject = on_eject or (lambda url: None)
        self.on_readmit = on_readmit or (lambda url: None)
        self._tasks: list[asyncio.Task] = []
        self._abandoned: set[asyncio.Task] = set()  # given-up transfers still running their clean-up
        self._progress = threading.Condition()
        self._closed = self._started = False
        self.skipped_versions = 0
        self.initial_version = 0
        """The version the replicas loaded from disk (``connect``): what a
        replica that rejoins before any version is staged holds."""

    @property
    def stages_async(self) -> bool:
        """Whether ``push`` leaves a copy to pinned host memory running on the
        caller's stream: the source tensors must not change until it is done
        (``StagingBuffers.pinned``)."""
        return self.staging.pinned

    @property
    def bytes_per_version(self) -> int:
        return self.staging.bytes_per_version

    # What bench/snapshot_copy.py drives the staging copy through (``StagingBuffers``'s own names are public).
    _plan = property(lambda self: self.staging.plan, lambda self, plan: setattr(self.staging, "plan", plan))
    _free_buffer = property(lambda self: self.staging.free_buffer)
    _stage = property(lambda self: self.staging.stage)

    # ------------------------------------------------------------ set-up

    def connect(self, initial_version: int = 0) -> None:
        """Join every replica (its weight group) and tag the weights they
        loaded from disk with ``initial_version``; fail (naming the replica)
        if any replica cannot join."""
        self.loop.run(self._connect_all(initial_version))

    async def _connect_all(self, initial_version: int) -> None:
        await self.transport.start()
        with self.staging.lock:  # replicas added from now on join on their own (add_replica)
            self._started = True
            initial = list(self.replicas)
        results = await asyncio.gather(*(self._connect_first(r) for r in initial), return_exceptions=True)
        errors = [f"{r.url}: {reason(e)}" for r, e in zip(initial, results) if isinstance(e, Exception)]
        if errors:
            raise PushError("weight groups could not be set up: " + "; ".join(errors))
        self.initial_version = initial_version
        await self.transport.tag(initial, initial_version)
        for r in initial:
            r.joined, r.version = True, initial_version
            self._tasks.append(asyncio.create_task(self._sender(r)))

    async def _connect_first(self, r: Replica) -> None:
        """Join ``r`` at start-up. A replica that answers and refuses (a
        weight group or transfer engine of the same name is still open there:
        a trainer killed before ``close``, restarted against long-lived
        servers) is reset and asked once more; the first refusal is what
        fails if that does not help."""
        try:
            await self.transport.connect(r)
        except PushError as first:
            logger.info("weight push: %s refused to join (%s); closing what an earlier trainer left there "
                        "and joining again", r.url, reason(first))
            try:
                await self.transport.reset(r)
                await self.transport.connect(r)
            except Exception:
                raise first from None

    def add_replica(self, url: str) -> bool:
        """A replica that joined the fleet (e.g. through the pool's replica
        file); any thread. Before ``connect`` it is simply connected with the
        others (False). Afterwards it is joined in the background, sent the
        newest version and only then readmitted (True: route to it only after
        ``on_readmit``)."""
        url = url.rstrip("/")
        with self.staging.lock:
            if any(r.url == url for r in self.replicas):
                return False
            r = Replica(url)
            started = self._started
            if started:
                r.admitted = False
            self.replicas.append(r)
        if started:
            def begin():
                self._tasks.append(asyncio.create_task(self._sender(r)))
                r.wake.set()  # not joined yet: the sender joins, then catches up
            self.loop.loop.call_soon_threadsafe(begin)
        return started

    # ------------------------------------------------------- trainer side

    def push(self, tensors: dict[str, torch.Tensor], version: int, wait: bool | None = None) -> dict[str, float]:
        """Snapshot ``tensors`` as ``version`` and return. With ``wait`` (the
        default in sync mode) also wait until every admitted replica serves it.

        Without ``wait`` this never blocks: when every staging buffer is being
        sent, the version is skipped. With ``wait`` it waits for a buffer too,
        so the last version of a run is always delivered."""
        wait = self.cfg.mode == "sync" if wait is None else wait
        t0 = time.perf_counter()
        self.staging.replan(tensors)
        staged = self.staging.free_buffer()
        while staged is None and wait:
            self._reclaim_from_ejected()
            with self._progress:
                self._progress.wait(timeout=0.05)
            staged = self.staging.free_buffer()
        if staged is None:
            self.skipped_versions += 1
            stall = time.perf_counter() - t0
            return {"push/skipped_versions": float(self.skipped_versions), "time/push_stall_s": stall,
                    **lag_metrics(self.replicas, version, self.bytes_per_version)}
        staged.start_writing()
        # A caller that waits for the replicas anyway (sync mode, a run's last
        # push) gets the version published before it is written: the senders'
        # control plane then runs during the snapshot and only the broadcasts
        # wait, each for its bucket's copies. Without ``wait`` the trainer's
        # thread goes back to training right after the snapshot, and a sender
        # busy on the event loop meanwhile would make every torch call of the
        # snapshot wait for the GIL: on 2 H200s the async step's stall went
        # from 0.6-1.0 ms to 2.7 ms that way (docs/perf-history/weight-push.md, run 27), so
        # it publishes after.
        if wait:
            self._publish(staged, version)
        try:
            self.staging.stage(staged, tensors)
        except BaseException as e:
            self.staging.withdraw(staged, e)
            raise
        staged.done_writing()
        if not wait:
            self._publish(staged, version)
        stall = time.perf_counter() - t0
        m = {"time/push_stall_s": stall, "push/bytes": float(self.bytes_per_version),
             "push/skipped_versions": float(self.skipped_versions)}
        if wait:
            self.wait_for(version)
            m["time/push_s"] = time.perf_counter() - t0
            m["push/GBps"] = self.bytes_per_version / m["time/push_s"] / 1e9
        # a transport's own figures (the delta push: what share its last transfer sent)
        m |= getattr(self.transport, "metrics", dict)()
        return m | lag_metrics(self.replicas, version, self.bytes_per_version)

    def _publish(self, staged: Staged, version: int) -> None:
        """Make ``staged`` the newest version and wake the senders."""
        self.staging.publish(staged, version)
        self.loop.loop.call_soon_threadsafe(self._wake_all)

    def _reclaim_from_ejected(self) -> None:
        """A push that waits for a staging buffer waits for admitted replicas
        only. A buffer read by nothing but replicas out of routing (catch-up
        transfers) is taken back by giving those transfers up: such a replica
        gets the version being pushed next, instead of the one it was sent."""
        with self.staging.lock:
            read_by_admitted = {id(r.holding) for r in self.replicas if r.admitted and r.holding is not None}
            held = [(r, r.holding) for r in self.replicas
                    if not r.admitted and r.holding is not None and id(r.holding) not in read_by_admitted]
        for r, staged in held:
            why = PushError(f"its catch-up transfer of version {staged.version} was given up: "
                            "a push that waits needs the staging buffer")
            self.loop.loop.call_soon_threadsafe(self._give_up, r, why, staged)

    def replica_down(self, url: str, reason: str) -> None:
        """The inference pool's word that ``url`` is down (connection refused,
        its process exited, a failed health check): it leaves the push now
        rather than at its deadline.

        Any thread, the pusher's event loop included; never blocks, and calls
        no hook from inside. Soon after, on the pusher's event loop: its
        transfer in flight, if any, is abandoned (releasing its staging
        buffer) and it is ejected as at a missed deadline (``on_eject``; once
        it answers /health again it rejoins, is sent the newest version and
        ``on_readmit`` follows), so a push or ``wait_for`` waiting for it stops
        waiting. A no-op for a URL this pusher does not send to, for a replica
        already out of routing with no transfer in flight, before ``connect``
        and after ``close``."""
        url = url.rstrip("/")
        with self.staging.lock:
            r = next((x for x in self.replicas if x.url == url), None)
            if r is None or not self._started or self._closed:
                return
        try:
            self.loop.loop.call_soon_threadsafe(self._down, r, reason)
        except RuntimeError:  # the loop is already closed: nothing is in flight
            pass

    def _down(self, r: Replica, reason: str) -> None:
        """Event loop: ``replica_down``'s work."""
        if self._closed:
            return
        why = ReplicaDown(f"reported down by the inference pool: {reason}")
        if not self._give_up(r, why) and r.admitted:
            self._eject(r, why)  # nothing in flight: out of routing now all the same
        self._notify()

    def _give_up(self, r: Replica, why: Exception, staged: Staged | None = None) -> bool:
        """Event loop: make ``r``'s sender abandon its transfer in flight (only
        if that transfer reads ``staged``, when given) and eject ``r`` with
        ``why``. False if there is no such transfer."""
        if r.give_up is None or r.give_up.done() or (staged is not None and r.holding is not staged):
            return False
        r.give_up.set_result(why)
        return True

    def wait_for(self, version: int, timeout_s: float | None = None) -> None:
        """Block until every admitted replica serves ``version`` or newer. A
        replica out of routing is never waited for: one ejected meanwhile (a
        missed deadline, a failure, ``replica_down``) stops counting at once."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._progress:
            while not all(r.version >= version or not r.admitted for r in self.replicas):
                if not any(r.admitted for r in self.replicas):
                    raise PushError("every replica has been ejected: " +
                                    "; ".join(f"{r.url}: {r.last_error}" for r in self.replicas))
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"replicas did not reach version {version} in {timeout_s}s")
                self._progress.wait(timeout=left if left is not None else 1.0)

    def status(self) -> list[dict]:
        return [{"url": r.url, "version": r.version, "admitted": r.admitted, "transfers": r.transfers,
                 "failures": r.failures, "last_error": r.last_error, "eject_reason": r.eject_reason,
                 "last_transfer_s": r.last_transfer_s}
                for r in self.replicas]

    # -------------------------------------------------------- sender side

    def _wake_all(self) -> None:
        for r in self.replicas:
            r.wake.set()

    def _notify(self) -> None:
        with self._progress:
            self._progress.notify_all()

    async def _sender(self, r: Replica) -> None:
        while True:
            await r.wake.wait()
            r.wake.clear()
            if not r.joined and not await self._rejoin(r):  # ejected or new: rejoin before anything else
                r.wake.set()
                continue
            staged = self.staging.take(r)
            if staged is None:
                continue
            t0 = time.perf_counter()
            try:
                r.busy = True
                await self._transfer_or_give_up(r, staged)
                r.version = staged.version
                r.transfers += 1
                r.last_transfer_s = time.perf_counter() - t0
                if not r.admitted and caught_up(r, self.replicas, self.staging.newest, self.cfg.mode):
                    r.admitted = True  # caught up: route to it again
                    logger.info("replica %s caught up at version %d: readmitted", r.url, r.version)
                    self.on_readmit(r.url)
            except Exception as e:
                if isinstance(e, TimeoutError) and not str(e):  # aiohttp's, which says nothing
                    e = TimeoutError("a control request timed out")
                self._eject(r, e)
            finally:
                r.busy = False
                self.staging.give_back(r, staged)
                self._notify()
            if self.staging.newest > r.version:
                r.wake.set()  # a newer version arrived meanwhile

    async def _rejoin(self, r: Replica) -> bool:
        """Connect ``r`` again, no sooner than ``reconnect_interval_s`` after
        the last try, once it answers /health (joining a group with a replica
        that is not there would leave a thread blocked in the rendezvous until
        its timeout). False, with ``last_error`` saying why, if not yet."""
        early = r.next_reconnect - time.monotonic()
        if early > 0:
            await asyncio.sleep(early)
        r.next_reconnect = time.monotonic() + self.cfg.reconnect_interval_s
        if not await self.transport.healthy(r):
            r.last_error = "reconnect: replica not answering /health"
            return False
        try:
            await self.transport.reset(r)
            await asyncio.wait_for(self.transport.connect(r), self.cfg.init_timeout_s + 5)
            at_initial = await self._settle_rejoined(r)
        except Exception as e:
            r.last_error = f"reconnect: {typed_reason(e)}"
            await asyncio.sleep(self.cfg.reconnect_interval_s)
            return False
        r.joined = True
        if at_initial and not r.admitted:
            r.admitted = True
            logger.info("replica %s rejoined at the initial version %d: readmitted", r.url, r.version)
            self.on_readmit(r.url)
            self._notify()
        return True

    async def _settle_rejoined(self, r: Replica) -> bool:
        """What ``r`` holds once it has rejoined is not what its number says:
        a restarted server loaded the initial weights from disk, and one
        ejected mid-transfer may hold part of a version. So it is sent the
        newest staged version whatever it held; nothing else would send it,
        since a version is only handed to senders when it is staged, and with
        no replica routable no step runs and none is staged (a lone server
        that crashed stayed out for good that way). With nothing staged yet,
        it holds what every replica started from: tagged so (True: it may be
        readmitted at once)."""
        with self.staging.lock:
            nothing_staged = self.staging.latest is None
        if not nothing_staged:
            r.version = -1
            return False
        await self.transport.tag([r], self.initial_version)
        r.version = self.initial_version
        return True

    async def _transfer_or_give_up(self, r: Replica, staged: Staged) -> None:
        """Send ``staged`` to ``r``; raise if that fails, misses its deadline
        or is given up (``_give_up``). A transfer still running then is
        cancelled but not waited for: its own clean-up (e.g. an unpause
        request to a replica that does not answer) would otherwise hold the
        ejection, the staging buffer and a push that waits."""
        transfer = asyncio.ensure_future(self.transport.send(r, staged))
        r.give_up = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait((transfer, r.give_up), timeout=self.cfg.deadline_s,
                               return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # close()
            self._abandon(transfer)
            raise
        finally:
            give_up, r.give_up = r.give_up, None
        if give_up.done():  # even if the transfer ended too: the replica is down
            why = give_up.result()
        elif transfer.done():
            return transfer.result()  # its own error, if it failed
        else:
            why = TimeoutError(f"missed its {self.cfg.deadline_s}s deadline")
        self._abandon(transfer)
        raise why

    def _abandon(self, transfer: asyncio.Future) -> None:
        """Cancel ``transfer`` and let it end on its own (``close`` waits for it)."""
        transfer.cancel()
        self._abandoned.add(transfer)
        transfer.add_done_callback(self._forget)

    def _forget(self, transfer: asyncio.Future) -> None:
        self._abandoned.discard(transfer)
        if not transfer.cancelled():
            transfer.exception()  # retrieved: the ejection already reported why the transfer ended

    def _eject(self, r: Replica, e: BaseException) -> None:
        r.failures += 1
        r.last_error = r.eject_reason = typed_reason(e)
        r.next_reconnect = time.monotonic() + self.cfg.reconnect_interval_s
        logger.warning("replica %s ejected from routing at version %d: %s", r.url, r.version, r.last_error)
        self.transport.abort(r)
        r.joined = False
        if r.admitted:
            r.admitted = False
            self.on_eject(r.url)
        asyncio.get_running_loop().call_later(self.cfg.reconnect_interval_s, r.wake.set)  # retry even if idle

    # ------------------------------------------------------------ close

    async def _release_replicas(self) -> None:
        """Close on every replica it can reach what this pusher set up there
        (``Transport.reset``: its weight group, update session and pause, or
        its vLLM transfer engine), each within ``CLOSE_TIMEOUT_S``. A real
        SGLang refuses a second group of the same name (torch's process-group
        names) and a vLLM a second transfer engine until the first is torn
        down, so a trainer restarted against the same servers could not join
        them otherwise. A replica down or hung is skipped: one log line."""

        async def teardown(r: Replica) -> str:
            if not await self.transport.healthy(r):  # down: its requests would each wait their timeout
                return "not answering /health"
            await self.transport.reset(r)
            return ""

        async def release(r: Replica) -> str:
            try:
                return await asyncio.wait_for(teardown(r), CLOSE_TIMEOUT_S)
            except asyncio.TimeoutError:
                return f"no answer within {CLOSE_TIMEOUT_S:g}s"
            except Exception as e:
                return typed_reason(e)

        why = await asyncio.gather(*(release(r) for r in self.replicas))
        left = [f"{r.url} ({w})" for r, w in zip(self.replicas, why) if w]
        done = len(self.replicas) - len(left)
        logger.log(logging.WARNING if left else logging.INFO, "weight push closed: released on %d of %d replicas%s",
                   done, len(self.replicas), "; not reached: " + ", ".join(left) if left else "")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def _close():
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            abandoned = list(self._abandoned)  # the senders' cancelled transfers among them
            for t in abandoned:
                t.cancel()
            await asyncio.gather(*abandoned, return_exceptions=True)
            if self._started:
                await self._release_replicas()
            await self.transport.close(self.replicas)

        try:
            self.loop.run(_close(), timeout=10 + CLOSE_TIMEOUT_S)
        except Exception:
            pass
        for r in self.replicas:
            self.transport.release(r)
