"""The built-in server's extensions of SGLang's and vLLM's protocols.

A replica whose /model_info says it is the built-in server
(``protocol.builtin``) gets these; any other replica, a real SGLang or vLLM,
gets the plain protocol of ``sglang_push`` / ``vllm_push``, which these
classes fall back to.

* **Pipelined requests** (``PushConfig.pipelined``): the built-in server
  takes a transfer's requests on one connection (``control.PipelinedConnection``)
  and handles them in order, so every request goes out as soon as it can be
  written (vLLM: start, update, finish and resume at once) and only the
  broadcasts wait for replies.
* **A session's end with the last byte**: its end (SGLang end, vLLM finish)
  waits for the update in flight, so with pipelining off it still gets the
  end as soon as the last byte has arrived rather than after the last reply.
* **``?ack=posted``** (``PushConfig.ack_posted``, pipelined only): each
  update is answered once its receive is posted. SGLang's bucket k then goes
  out queued behind bucket k-1 still in flight, so the link does not idle
  between buckets; vLLM's finish is handled while the bytes arrive. The
  server receives into buffers of its own and loads a version only at the
  session's end, so only the end must follow a pause: the pause goes just
  before the end and is handled while the bytes arrive, which then never
  wait for a generating replica to stop (a decode step in mode "abort",
  every running request in vLLM's "wait").
* **The version at the session's end** (SGLang): ``/end_weight_update``
  takes ``weight_version``, so every update body is the same bytes each
  version, encoded once here and parsed once there.
"""

from __future__ import annotations

import asyncio

from torchtitan_grpo.protocol import vllm
from torchtitan_grpo.protocol.builtin import ACK_POSTED
from torchtitan_grpo.weight_sync.control import PipelinedConnection, Requests, answered, until
from torchtitan_grpo.weight_sync.sglang_push import SGLangPush, begin_session
from torchtitan_grpo.weight_sync.staging import Staged
from torchtitan_grpo.weight_sync.transport import Replica
from torchtitan_grpo.weight_sync.vllm_push import VLLMPush

CONN_MAX_IDLE_S = 30.0
"""A pipelined connection idle for longer is replaced, not reused: servers
close idle connections (aiohttp after 75 s or more), and one closed while a
transfer's first request is on its way would fail that transfer."""


class BuiltinExtensions:
    """What both protocols gain with a built-in server (mixed in before them)."""

    async def pipelined_requests(self, r: Replica) -> Requests | None:
        """A transfer's pipelined connection to a built-in server (the last
        transfer's, while usable); None: each request on its own."""
        if not (r.builtin and self.cfg.pipelined):
            return None
        if r.conn is None or not r.conn.usable(CONN_MAX_IDLE_S):
            if r.conn is not None:
                r.conn.close()
            r.conn = None
            conn = PipelinedConnection(r.url, headers=self.auth)
            await conn.open(30)
            r.conn = conn
        return Requests(self.session, r.url, r.conn)

    def acks_posted(self, r: Replica) -> bool:
        """Whether a pipelined transfer's updates ask for ``?ack=posted``."""
        return r.ack_posted and self.cfg.ack_posted

    async def end_session(self, r: Replica, answers: list[asyncio.Future], path: str, body: dict | None) -> None:
        """The built-in server takes its end after the update in flight (one
        lock), so the end goes out at once and overlaps the last update's
        reply and checks (~1.4 ms per version for vLLM on 2 H200s)."""
        if not r.builtin or body is None:
            return await super().end_session(r, answers, path, body)
        end = asyncio.create_task(self.post(r, path, body, self.cfg.deadline_s))
        await answered([*answers, end])

    def abort(self, r: Replica) -> None:
        super().abort(r)
        if r.conn is not None:
            r.conn.close()  # replies still due on it belong to the abandoned transfer
        r.conn = None

    async def close(self, replicas: list[Replica]) -> None:
        for r in replicas:
            if r.conn is not None:
                r.conn.close()
        await super().close(replicas)


class BuiltinSGLangPush(BuiltinExtensions, SGLangPush):
    """SGLang's protocol, with the built-in server's extensions where a replica offers them."""

    def update_body(self, r: Replica, staged: Staged, k: int) -> dict | bytes:
        if r.end_version:  # the version goes with the end: every body is the encoded one
            return self.encoded_updates(staged.plan)[k]
        return super().update_body(r, staged, k)

    def end_body(self, r: Replica, staged: Staged) -> dict:
        return {"weight_version": str(staged.version)} if r.end_version else {}

    async def send(self, r: Replica, staged: Staged) -> None:
        """Pipelined: pause -> begin -> every update -> end -> continue written
        at once (with ``ack_posted``: the pause just before the end), the
        broadcasts following the replies."""
        req = await self.pipelined_requests(r)
        if req is None:
            return await super().send(r, staged)
        pausing = self.cfg.pause_mode != "none"
        done = False
        try:
            watched: list[asyncio.Future] = []  # every request so far: the first failure stops the transfer
            ack = self.acks_posted(r)
            late = pausing and ack  # the pause just before the end (module docstring)
            if pausing and not late:
                watched.append(req.post("/pause_generation", {"mode": self.cfg.pause_mode}, 30))
            begin = await begin_session(r, req)
            if begin is not None:
                watched.append(begin)
            n = len(staged.plan)
            # Handled in this order, each after the one before: every update,
            # then the end and continue, go out now, and the replica goes from
            # one to the next without a round trip.
            updates = [req.post("/update_weights_from_distributed", self.update_body(r, staged, k),
                                self.cfg.deadline_s, params=ACK_POSTED if ack else None) for k in range(n)]
            watched += updates
            if late:
                watched.append(req.post("/pause_generation", {"mode": self.cfg.pause_mode}, 30))
            if r.sessionful:
                watched.append(req.post("/end_weight_update", self.end_body(r, staged), self.cfg.deadline_s))
            if pausing:
                watched.append(req.post("/continue_generation", {}, 30))
            for k in range(n):
                if k == 0 and begin is not None:
                    # A session, or the update posts no receive. Not update 0's
                    # reply even with ``ack``: that would add its round trip to
                    # every version (2 H200s: ~1.5 ms, run 48), and on a new
                    # group it cannot come at all, NCCL making the communicator
                    # in the first collective on both sides at once (run 45).
                    await until(begin, watched)
                elif ack and k > 0:
                    # Update k is answered once its receive is posted: bucket k
                    # goes out then, so it never spins on the trainer's GPU, and
                    # is queued behind k-1 with no host wait (the replica posts
                    # k while k-1 is in flight): no gap.
                    await until(updates[k], watched)
                elif k > 0:
                    await until(updates[k - 1], watched)  # as SGLang's protocol does (sglang_push)
                await self.with_broadcasts(r, watched, staged, [k], wait=k == n - 1 or not ack)
            await answered(watched)  # the replica loads the session's buckets as one version at its end
            done = True
        finally:
            if pausing and not done:
                await self.unpause(r, "/continue_generation", {})


class BuiltinVLLMPush(BuiltinExtensions, VLLMPush):
    """vLLM's protocol, with the built-in server's extensions where a replica offers them."""

    async def send(self, r: Replica, staged: Staged) -> None:
        """Pipelined: pause, start, update, finish and resume written at once
        (with ``ack_posted``: the pause just before the finish); the
        broadcasts start once the round is started."""
        req = await self.pipelined_requests(r)
        if req is None:
            return await super().send(r, staged)
        mode, body = self.pause_mode, self.encoded_updates(staged.plan)[0]
        finish = vllm.finish_weight_update_request(str(staged.version))
        done = False
        try:
            ack = self.acks_posted(r)
            calls = {vllm.PAUSE: (None, 30, vllm.pause_query(mode)),
                     vllm.START_WEIGHT_UPDATE: (None, 30, None),
                     vllm.UPDATE_WEIGHTS: (body, self.cfg.deadline_s, ACK_POSTED if ack else None),
                     vllm.FINISH_WEIGHT_UPDATE: (finish, self.cfg.deadline_s, None),
                     vllm.RESUME: (None, 30, None)}
            order = list(calls)
            if ack:  # the pause just before the finish (module docstring)
                order.remove(vllm.PAUSE)
                order.insert(order.index(vllm.FINISH_WEIGHT_UPDATE), vllm.PAUSE)
            replies = {path: req.post(path, *calls[path]) for path in order}
            start, watched = replies[vllm.START_WEIGHT_UPDATE], list(replies.values())
            # The update is next in line: no broadcast spins while the round starts.
            await until(start, watched)
            await self.with_broadcasts(r, watched, staged, list(range(len(staged.buffers))))
            await answered(watched)
            done = True
        finally:
            if not done:
                await self.unpause(r, vllm.RESUME, None)
