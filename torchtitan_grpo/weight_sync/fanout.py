"""The broadcast fan-out (``weight_sync.fanout = "broadcast"``): each bucket of
a version leaves the trainer once, whatever the number of replicas.

Per replica (``per_replica``, the default) the trainer sends every byte once
per replica, so its side carries N x the bytes. Here the trainer and every
admitted replica share one weight group (``broadcast_group``) and a version
is one *round*: the control plane of SGLang's protocol goes to every member
at once (its own HTTP requests, pipelined to built-in servers), and each
bucket is broadcast once on the shared group.

The Pusher is unchanged: one sender per replica, deadlines, ejection,
rejoin and readmission. This transport's ``send`` is what decides the path.

State of a replica (``send`` for version v)::

    joining / ejected --connect (own group)--> CATCHING UP
    CATCHING UP --p2p send ok, caught up--> ADMITTED (Pusher readmits)
    ADMITTED --next round--> MEMBER (the group is re-formed to take it in)
    MEMBER --round v ok--> MEMBER
    MEMBER --not ready in ready_s (roll call)--> dropped: PushError, ejected,
             the round goes on without it on a group re-formed before any byte
    MEMBER --fails after the first byte--> the round fails for all its
             members: each is ejected and catches up point to point
    MEMBER --arrives after its round started--> v point to point (own group),
             still eligible: the next round takes it back in

A round for version v (one at a time, on the pusher's event loop):

1. *gather*: the first member's ``send`` opens it; it waits up to
   ``ready_s`` for every eligible replica (joined and admitted) to arrive;
2. *roll call*: pause (if any) and ``/begin_weight_update`` to each; one that
   has not answered within ``ready_s`` is dropped (a frozen replica never
   answers: no byte is ever sent to a group it is in);
3. *membership*: if the members ready differ from the group's, a new group
   is formed over them (next generation) and the old one destroyed on them;
4. *buckets*: bucket k is broadcast once every member's receive for it is
   posted (built-in server: update k answered ``?ack=posted``; otherwise
   update k-1 answered, as ``sglang_push`` does);
5. *end*: each member's session ends (the version loads) on its own; a
   member whose end fails is ejected alone.

A joining replica (``Pusher.add_replica``) or one readmitted after a
catch-up thus always gets its first version over its own group, and enters
the shared group at a version boundary. The per-replica groups stay joined
(idle) so that a catch-up needs no new rendezvous.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from dataclasses import dataclass, field

from torchtitan_grpo.protocol import sglang
from torchtitan_grpo.protocol.builtin import ACK_POSTED
from torchtitan_grpo.reasons import reason, typed_reason
from torchtitan_grpo.weight_sync import buckets as bk
from torchtitan_grpo.weight_sync.broadcast_group import BroadcastGroup, destroy_on, form_group
from torchtitan_grpo.weight_sync.builtin_push import BuiltinSGLangPush
from torchtitan_grpo.weight_sync.control import PushError, Requests, answered, until
from torchtitan_grpo.weight_sync.group_push import GroupPush, spec_lists
from torchtitan_grpo.weight_sync.sglang_push import begin_session
from torchtitan_grpo.weight_sync.staging import Staged
from torchtitan_grpo.weight_sync.transport import Replica, Transport

logger = logging.getLogger(__name__)

READY_S = 5.0
"""How long a round waits for a member to arrive and to answer its roll
call, at most (and at most a quarter of ``deadline_s``)."""


@dataclass
class FanoutStats:
    """What the trainer's side did, counted (tests and bench/fanout.py read it)."""

    rounds: int = 0
    broadcasts: int = 0
    """Buckets broadcast on the shared group (one per bucket per round)."""
    bytes: int = 0
    """Bytes the trainer sent on the shared group."""
    reforms: int = 0
    dropped: int = 0
    point_to_point: int = 0
    """Versions sent to one replica over its own group (catch-ups, late arrivals)."""


@dataclass
class Round:
    """One version's broadcast to the members that arrive for it."""

    staged: Staged
    expected: set[str]
    arrived: dict[str, Replica] = field(default_factory=dict)
    results: dict[str, asyncio.Future] = field(default_factory=dict)
    gathering: bool = True
    bytes_started: bool = False
    lost: set[str] = field(default_factory=set)
    """Members ejected (``abort``) while the round runs."""
    active: set[str] = field(default_factory=set)
    """The members past the roll call, whose bytes are on the shared group."""
    stop: threading.Event = field(default_factory=threading.Event)
    everyone: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None

    def join(self, r: Replica) -> asyncio.Future:
        self.arrived[r.url] = r
        fut = self.results[r.url] = asyncio.get_running_loop().create_future()
        if self.expected <= set(self.arrived):
            self.everyone.set()
        return fut

    def settle(self, url: str, error: BaseException | None) -> None:
        fut = self.results.get(url)
        if fut is not None and not fut.done():
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)


class BroadcastFanout(Transport):
    """SGLang's protocol to every admitted replica over one shared weight
    group; each replica's own group (``BuiltinSGLangPush``) for the rest."""

    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        if cfg.protocol != "sglang":
            raise ValueError(f'weight_sync.fanout = "broadcast" needs the SGLang protocol (inference.backend '
                             f'sglang or builtin), got protocol {cfg.protocol!r}; use fanout "per_replica"')
        self.inner = BuiltinSGLangPush(cfg, device)
        self.known: dict[str, Replica] = {}
        self.group: BroadcastGroup | None = None
        self.gen = 0
        self.round: Round | None = None
        self.held: dict[str, str] = {}
        """Replica URL -> the shared group's name it joined (destroyed before a rejoin)."""
        self.stats = FanoutStats()
        self.ready_s = min(READY_S, cfg.deadline_s / 4)
        self._bodies: tuple[object, str, list[bytes]] | None = None

    # ------------------------------------------------- what the inner transport decides

    @property
    def reads_host_memory(self) -> bool:
        return self.inner.reads_host_memory

    def plan(self, specs: list[bk.TensorSpec]) -> list[list[bk.TensorSpec]]:
        return self.inner.plan(specs)

    def prepare_buffers(self, buffers):
        return self.inner.prepare_buffers(buffers)

    async def start(self) -> None:
        await self.inner.start()
        self.session = self.inner.session

    async def connect(self, r: Replica) -> None:
        self.known.setdefault(r.url, r)  # before any await: ranks follow the Pusher's order
        self.known[r.url] = r
        await self.inner.connect(r)  # its own group: catch-ups and late versions

    async def reset(self, r: Replica) -> None:
        name = self.held.pop(r.url, None)
        if name is not None:
            await destroy_on(self, [r], name)
        await self.inner.reset(r)

    async def tag(self, replicas: list[Replica], version: int) -> None:
        await self.inner.tag(replicas, version)

    def release(self, r: Replica) -> None:
        self.inner.release(r)

    async def close(self, replicas: list[Replica]) -> None:
        rnd = self.round
        if rnd is not None and rnd.task is not None and not rnd.task.done():
            rnd.stop.set()
            rnd.task.cancel()
        if self.group is not None:
            self.group.abort()
            self.group = None
        await self.inner.close(replicas)

    def abort(self, r: Replica) -> None:
        """``r`` is ejected. In a round that has sent bytes, the shared group
        cannot go on without it: the round fails (its members catch up on
        their own groups); before that it is only dropped."""
        rnd = self.round
        if rnd is not None and rnd.task is not None and not rnd.task.done() and r.url in rnd.arrived:
            rnd.lost.add(r.url)
            if rnd.bytes_started and r.url in rnd.active and not rnd.results[r.url].done():
                rnd.stop.set()
                rnd.task.cancel()
        if self.group is not None and r.url in self.group.members:
            self.group.members = [u for u in self.group.members if u != r.url]  # re-formed next round
        self.inner.abort(r)

    # ------------------------------------------------------------- sending

    def eligible(self, r: Replica) -> bool:
        """Whether ``r`` is a member (or enters at this version): joined and admitted."""
        return r.url in self.known and r.joined and r.admitted

    async def send(self, r: Replica, staged: Staged) -> None:
        rnd = self._round_for(staged) if self.eligible(r) else None
        if rnd is not None:
            return await rnd.join(r)  # raises PushError when dropped: the Pusher ejects it
        self.stats.point_to_point += 1
        await self.inner.send(r, staged)

    def _round_for(self, staged: Staged) -> Round | None:
        """The round ``staged`` joins; None: a round of another version is on."""
        rnd = self.round
        if rnd is not None and rnd.gathering and rnd.staged is staged and rnd.staged.version == staged.version:
            return rnd
        if rnd is not None and rnd.task is not None and not rnd.task.done():
            return None
        expected = {u for u, x in self.known.items() if self.eligible(x)}
        rnd = self.round = Round(staged, expected)
        rnd.task = asyncio.create_task(self._run(rnd))
        return rnd

    async def _run(self, rnd: Round) -> None:
        version = rnd.staged.version
        try:
            try:
                await asyncio.wait_for(rnd.everyone.wait(), self.ready_s)
            except asyncio.TimeoutError:
                pass  # the late ones go point to point (send), the round goes on without them
            rnd.gathering = False
            order = list(self.known)
            members = sorted((r for u, r in rnd.arrived.items() if u not in rnd.lost),
                             key=lambda r: order.index(r.url))
            await asyncio.wait_for(self._round(rnd, members), self.cfg.deadline_s)
            self.stats.rounds += 1
        except BaseException as e:
            if rnd.bytes_started and self.group is not None:
                self.group.abort()  # its broadcast may hang on a member that is gone
                self.group = None
            lost = sorted(rnd.lost & rnd.active)
            cause = (f"{', '.join(lost)} left the group after the first byte" if lost
                     else typed_reason(e) if str(e) else type(e).__name__)
            why = e if isinstance(e, PushError) else PushError(
                f"the broadcast of version {version} failed: {cause} (each member catches up on its own group)")
            for url in rnd.results:
                rnd.settle(url, why)
            if not isinstance(e, (Exception, asyncio.CancelledError)):
                raise

    async def _round(self, rnd: Round, members: list[Replica]) -> None:
        cfg, staged = self.cfg, rnd.staged
        reqs = {r.url: await self.inner.pipelined_requests(r) or Requests(self.session, r.url) for r in members}
        watched: dict[str, list[asyncio.Future]] = {r.url: [] for r in members}
        calls = {r.url: asyncio.ensure_future(self._roll_call(r, reqs[r.url], watched[r.url])) for r in members}
        done, _ = await asyncio.wait(calls.values(), timeout=self.ready_s) if calls else (set(), set())
        ready = []
        for r in members:
            c = calls[r.url]
            if c in done and c.exception() is None and r.url not in rnd.lost:
                ready.append(r)
                continue
            c.cancel()
            for f in watched[r.url]:
                f.cancel()
            self.stats.dropped += 1
            why = c.exception() if c in done else None
            rnd.settle(r.url, PushError(
                f"dropped from the broadcast group at version {staged.version}: "
                + (f"its roll call failed: {reason(why)}" if why else f"not ready within {self.ready_s:g}s")
                + " (it catches up on its own group)"))
        if not ready:
            return
        rnd.active = {r.url for r in ready}
        await self._membership(ready)
        g = self.group
        n = len(staged.plan)
        ack = {r.url: reqs[r.url].in_order and self.inner.acks_posted(r) for r in ready}
        updates: dict[str, list[asyncio.Future]] = {r.url: [] for r in ready}
        for r in ready:
            if reqs[r.url].in_order:  # every request now, handled in order (builtin_push)
                for k in range(n):
                    self._post_update(r, reqs[r.url], staged, k, g.name, ack[r.url], updates, watched)
                self._post_end(r, reqs[r.url], staged, watched)
        everything = [f for r in ready for f in watched[r.url]]
        for k in range(n):
            for r in ready:
                if not reqs[r.url].in_order:
                    self._post_update(r, reqs[r.url], staged, k, g.name, False, updates, watched)
                    everything.append(updates[r.url][-1])
            gates = [] if k == 0 else [updates[r.url][k] if ack[r.url] else updates[r.url][k - 1] for r in ready]
            for gate in gates:  # every member's receive of bucket k is posted (or about to be)
                await until(gate, everything)
            rnd.bytes_started = True
            wait = k == n - 1 or not all(ack.values())
            send = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(
                g.link.executor, GroupPush.broadcast_all, g.link, staged, [k], rnd.stop, wait))
            try:
                await until(send, everything)
            except BaseException:
                rnd.stop.set()
                raise
            self.stats.broadcasts += 1
            self.stats.bytes += staged.buffers[k].numel() * staged.buffers[k].element_size()
        ends = await asyncio.gather(*(self._end(r, reqs[r.url], staged, updates[r.url], watched[r.url])
                                      for r in ready), return_exceptions=True)
        for r, e in zip(ready, ends):
            rnd.settle(r.url, e if isinstance(e, BaseException) else None)

    async def _roll_call(self, r: Replica, req: Requests, watched: list[asyncio.Future]) -> None:
        """Pause (if any) and open the session; returns once ``r`` answered."""
        if self.cfg.pause_mode != "none":
            watched.append(req.post("/pause_generation", {"mode": self.cfg.pause_mode}, 30))
            await req.ordered(watched[-1])
        begin = await begin_session(r, req)
        if begin is not None:
            watched.append(begin)
        await answered(list(watched))

    async def _membership(self, ready: list[Replica]) -> None:
        """Re-form the shared group if its members are not ``ready`` (in order)."""
        urls = [r.url for r in ready]
        g = self.group
        if g is not None and g.members == urls and g.link.group is not None and not g.link.group.closed:
            return
        old, self.group = self.group, None
        if old is not None:
            old.close()
            await destroy_on(self, [r for r in ready if self.held.get(r.url) == old.name], old.name)
        self.gen += 1
        self.stats.reforms += 1
        self.group = await form_group(self, ready, self.gen)
        for r in ready:
            self.held[r.url] = self.group.name

    def _bodies_for(self, staged: Staged, name: str) -> list[bytes]:
        """Every bucket's update without a version, encoded once per plan and group."""
        if self._bodies is None or self._bodies[0] is not staged.plan or self._bodies[1] != name:
            self._bodies = (staged.plan, name, [json.dumps(self._update(staged, k, name, None)).encode()
                                                for k in range(len(staged.plan))])
        return self._bodies[2]

    def _update(self, staged: Staged, k: int, name: str, version: str | None) -> dict:
        last = k == len(staged.plan) - 1
        return sglang.update_request(*spec_lists(staged.plan[k]), name, flattened=True,
                                     flush_cache=self.cfg.pause_mode != "in_place" and last, weight_version=version)

    def _post_update(self, r: Replica, req: Requests, staged: Staged, k: int, name: str, ack: bool,
                     updates: dict, watched: dict) -> None:
        """Update ``k``; the version rides with the last one unless ``r`` takes it at the end."""
        if r.end_version or k < len(staged.plan) - 1:
            body = self._bodies_for(staged, name)[k]
        else:
            body = self._update(staged, k, name, str(staged.version))
        fut = req.post("/update_weights_from_distributed", body, self.cfg.deadline_s,
                       params=ACK_POSTED if ack else None)
        updates[r.url].append(fut)
        watched[r.url].append(fut)

    def _post_end(self, r: Replica, req: Requests, staged: Staged, watched: dict) -> None:
        if r.sessionful:
            body = {"weight_version": str(staged.version)} if r.end_version else {}
            watched[r.url].append(req.post("/end_weight_update", body, self.cfg.deadline_s))
        if self.cfg.pause_mode != "none":
            watched[r.url].append(req.post("/continue_generation", {}, 30))

    async def _end(self, r: Replica, req: Requests, staged: Staged, updates: list[asyncio.Future],
                   watched: list[asyncio.Future]) -> None:
        """``r``'s session ends and its version loads (its own failure is its own)."""
        done = False
        try:
            if not req.in_order:
                await answered(updates)
                self._post_end(r, req, staged, {r.url: watched})
            await answered(watched)
            done = True
        finally:
            if not done and self.cfg.pause_mode != "none":
                await self.inner.unpause(r, "/continue_generation", {})
