"""The rollout client in a process of its own (``rollout.client_process``).

Why: the client's work for each group (prompt encoding, the HTTP request and
its JSON, decoding, the reward) is Python. In the trainer's process it holds
the GIL that the training step's Python needs too: on the 2-core CPU demo,
pipelined, 69 % of the GIL-held samples were the client's and the train phase
stretched from 0.030 to 0.049 s (docs/perf-history/pipeline-loop.md). Here the client runs
beside the trainer and hands it finished groups.

The split:

* client process: the :class:`InferencePool`, the prompt ledger, the scorer
  and the :class:`RolloutProducer` (admission, retries, re-sends), exactly
  as they run in the trainer's process otherwise;
* trainer process: :class:`RolloutProcess`, the producer's trainer-side
  surface (``start``, ``next_batch``, ``published``, ``state_dict``,
  ``close``), over a mirror of the producer's buffer, and
  :class:`RemotePool`, the pool's control surface that the weight pusher and
  the server supervisor use (``mark_down``, ``retire``, ``eject``,
  ``readmit``, the ``on_down`` / ``on_join`` hooks, ``events``).

Each finished group is sent as soon as it is buffered, in buffer order, so a
trainer step finds its groups already in its own process. Taking them sends
``took``; the client's ledger records the hand-over and its reply (the step's
rollout metrics and the ledger's state) is read after the step, when the
trainer publishes its weights: no round trip sits before a step. A
checkpoint saves the ledger state of the last reply plus the prompts handed
over since, so it is exact even with the client gone.

Groups finished while the trainer trains are held and go in one message
when it publishes (``client_main.GroupOutbox``); while it waits, each goes as soon
as it is finished. The trainer's receiving thread takes the GIL each time it
wakes, and a wake during the training step takes it from the step's Python.

Messages are pickled over a socket pair made for the two processes; nothing
from the network reaches them. Client -> trainer: ``("groups", [ScoredGroup])``,
``("down", url, reason)``, ``("join", url, assumed_stale)``,
``("error", text)``, ``("reply", value)`` / ``("reply_error", text)``,
``("alive",)`` every ``client_main.HEARTBEAT_S``.
Trainer -> client: ``("start_pool",)``, ``("pushing",)``,
``("start", version)``, ``("took", n, wait_s)``, ``("published", version)``,
``("events",)``, ``("mark_down" | "retire", url, reason)``,
``("eject" | "readmit", url)``, ``("close",)``; those with a reply are
answered in order.

If the client process dies or stops answering, the next ``next_batch``
starts a new one from the ledger's state (``max_restarts`` times; then it
raises :class:`ProducerStopped` naming the exit, and the run stops at a
step boundary and keeps its checkpoint); if the trainer dies, the client
sees the socket close and exits.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

from torchtitan_grpo.fleet.launcher import describe_exit
from torchtitan_grpo.fleet.pool import PoolConfig
from torchtitan_grpo.rollout.groups import ScoredGroup
from torchtitan_grpo.rollout.producer import ProducerSpec, ProducerStopped, RolloutBatch

logger = logging.getLogger("torchtitan_grpo")

CLIENT_MODULE = "torchtitan_grpo.rollout.client_main"
"""What a spawned client process runs (``-m``)."""

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class RemotePool:
    """The inference pool's control surface, in the trainer's process, for a
    pool that lives in the client process. Any thread."""

    def __init__(self, client: RolloutProcess):
        self._client = client
        self.on_down: Callable[[str, str], None] | None = None
        """Called (on the receiving thread) when the client's pool marks a replica down."""
        self.on_join: Callable[[str], bool] | None = None
        """Called with each replica that joins through the replica file; True:
        it holds stale weights (route to it only after ``readmit``)."""
        self._events: list[tuple[float, str, str, str]] = []
        # What a restarted client's pool is told again (RolloutProcess._restart).
        self.started = False
        self.pushing_on = False
        self.retired: dict[str, str] = {}
        self.ejected: set[str] = set()
        self.adapters: dict[str, str] = {}

    def start(self) -> None:
        """Start the client's pool (its health checks, the replica file)."""
        self._client._request(("start_pool",))
        self.started = True

    def pushing(self) -> None:
        """From now on a joining replica holds stale weights until the pusher
        readmits it (call before the pusher connects)."""
        self._client._send(("pushing",))
        self.pushing_on = True

    def mark_down(self, url: str, reason: str) -> None:
        self._client._send(("mark_down", url, reason))

    def retire(self, url: str, reason: str) -> None:
        self._client._send(("retire", url, reason))
        self.retired[url] = reason

    def eject(self, url: str) -> None:
        self._client._send(("eject", url))
        self.ejected.add(url)

    def readmit(self, url: str) -> None:
        self._client._send(("readmit", url))
        self.ejected.discard(url)

    def set_adapter(self, url: str, name: str) -> None:
        """Name the LoRA adapter ``name`` in every request to ``url`` (weight_sync.lora_push = "adapter")."""
        self._client._send(("set_adapter", url, name))
        self.adapters[url] = name

    @property
    def events(self) -> list[tuple[float, str, str, str]]:
        """(time.time(), url, kind, detail) of the client's pool (the last
        known list once the client has closed)."""
        if not self._client.closed:
            try:
                self._events = self._client._request(("events",))
            except ProducerStopped:
                pass
        return self._events


@dataclass
class SpawnedClient:
    """A client process started ahead of its work: it imports torch,
    transformers and the pool while the servers start, and waits for a
    :class:`RolloutProcess` to send it its spec."""

    proc: subprocess.Popen
    conn: Connection

    @classmethod
    def spawn(cls) -> SpawnedClient:
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p))
        # Its own session, as the launched servers (launcher._spawn): torchrun's
        # signal to the worker's process group must not reach it; it exits when
        # the trainer closes the socket.
        proc = subprocess.Popen([sys.executable, "-m", CLIENT_MODULE, str(theirs.fileno())],
                                pass_fds=(theirs.fileno(),), env=env, start_new_session=True)
        theirs.close()
        return cls(proc, Connection(ours.detach()))

    def close(self) -> None:
        """Unless a RolloutProcess took it over: the client sees the socket close and exits."""
        self.conn.close()
        self.reap()

    def reap(self, grace_s: float = 15.0) -> None:
        """Wait for the client to exit on its own (it ignores SIGTERM); kill it after ``grace_s``."""
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("rollout client process did not exit; killing it")
            self.proc.kill()
            self.proc.wait(5)


class RolloutProcess:
    """The built-in rollout producer, run in a child process; the same
    trainer-side methods as :class:`RolloutProducer`. ``pool`` is its
    :class:`RemotePool`."""

    def __init__(self, spec: ProducerSpec, urls: list[str], pool_config: PoolConfig, *, pushing: bool,
                 startup_timeout_s: float = 300.0, reply_timeout_s: float = 300.0,
                 silent_timeout_s: float = 120.0, max_restarts: int = 0, spawned: SpawnedClient | None = None):
        """Starts the client (or takes over ``spawned``) and waits until it has
        built its side (tokenizer, prompts, reward); raises ProducerStopped
        with its error if it cannot. ``pushing``: weights are pushed, so
        replicas joining through the replica file are reported to
        ``pool.on_join``. A client is alive while it sends something (it
        says so every ``client_main.HEARTBEAT_S`` when it has nothing else to send);
        silent for ``silent_timeout_s`` (a stopped or wedged process) while
        the trainer waits for groups, or without a reply for
        ``reply_timeout_s``, it is lost, as it is when it exits. A lost
        client is started again from the prompt ledger's state up to
        ``max_restarts`` times (see ``_restart``); then the run stops."""
        self.prompts_per_step = spec.prompts_per_step
        self.reply_timeout_s = reply_timeout_s
        self.silent_timeout_s = silent_timeout_s
        self.max_restarts = max_restarts
        self.restarts = 0
        self._spec, self._urls, self._pool_config, self._pushing = spec, urls, pool_config, pushing
        self._startup_timeout_s = startup_timeout_s
        self._version: int | None = None
        """The version of the last ``start`` / ``published``: a restarted client starts from it."""
        self.pool = RemotePool(self)
        self.closed = False
        self._closing = False
        self._cond = threading.Condition()
        self._buffer: deque[ScoredGroup] = deque()
        self._error: str | None = None
        self._lost = False
        """The error is the client's process lost (exited, silent, no reply), not a generation failure."""
        self._send_lock = threading.Lock()
        self._request_lock = threading.Lock()
        self._taken: dict[str, float] | None = None
        """The last batch's metrics while the client's reply to its ``took`` is pending."""
        self._ledger_state: dict = {}
        self._handed_since: list[int] = []
        """Prompt indices handed over since ``_ledger_state`` was sent."""
        try:
            self._launch(spawned or SpawnedClient.spawn(), spec)
        except ProducerStopped as e:
            self.close()
            raise ProducerStopped(f"rollout client process could not start: {e}") from None

    def _launch(self, spawned: SpawnedClient, spec: ProducerSpec) -> None:
        """Hand ``spawned`` its work and wait until it is ready."""
        self._spawned = spawned
        self._proc, self._conn = spawned.proc, spawned.conn
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._last_heard = time.monotonic()
        self._send((spec, self._urls, self._pool_config, self._pushing))
        self._receiver = threading.Thread(target=self._receive, args=(self._conn, self._proc, self._replies),
                                          name="grpo-rollout-client", daemon=True)
        self._receiver.start()
        self._ledger_state = self._request(("ready",), timeout_s=self._startup_timeout_s)

    # ---------------------------------------------------------------- trainer side

    def start(self, version: int) -> None:
        self._version = version
        self._send(("start", version))

    def next_batch(self, stop: threading.Event | None = None) -> RolloutBatch | None:
        """The first ``prompts_per_step`` finished groups; None once ``stop`` is set."""
        t0 = time.monotonic()
        while True:
            try:
                return self._next_batch(stop, t0)
            except ProducerStopped:
                if not (self._restartable(self._lost) and not self.closed):
                    raise
            self._restart()

    def _restartable(self, lost: bool) -> bool:
        """Whether an error (``lost``: the process, not the generation) gets a new client."""
        return lost and self.restarts < self.max_restarts

    def _next_batch(self, stop: threading.Event | None, t0: float) -> RolloutBatch | None:
        n = self.prompts_per_step
        with self._cond:
            while len(self._buffer) < n and self._error is None and not self.closed:
                if stop is not None and stop.is_set():
                    return None
                self._cond.wait(timeout=0.2)
                silent = time.monotonic() - self._last_heard
                if silent > self.silent_timeout_s:
                    self._set_error(f"rollout client process silent for {silent:.0f} s (stopped or wedged)",
                                    lost=True)
            if self._error is not None:
                raise ProducerStopped(self._error)
            if self.closed:
                raise ProducerStopped("rollout producer closed")
            groups = [self._buffer.popleft() for _ in range(n)]
        wait_s = time.monotonic() - t0
        indices = [g.index for g in groups]
        # The client records the hand-over and computes the step's rollout
        # metrics (its pool's among them) while the trainer trains: no round
        # trip before the step; published() adds them to the batch's metrics.
        metrics = {"time/wait_s": wait_s}
        with self._request_lock:
            self._finish_take()  # a lost client raises here: these groups were not handed over
            self._send(("took", n, wait_s))
            self._taken = metrics
            self._handed_since += indices
        return RolloutBatch([s for g in groups for s in g.samples], metrics, indices)

    def published(self, version: int) -> None:
        """Also completes the last batch's ``metrics`` (read them after this).
        Never raises: a client that died is reported by the next ``next_batch``."""
        self._version = version
        with self._request_lock:
            try:
                self._finish_take()
            except ProducerStopped as e:
                logger.warning("rollout metrics of the last step lost: %s", e)
        self._send(("published", version))

    def _restart(self) -> None:
        """Start a new client from the ledger's state (the one a checkpoint
        would save now): the prompts handed over stay handed; the groups
        in flight and the mirrored groups not yet taken are generated again.
        Its pool is told what this one's was (started, pushing, replicas
        retired or ejected) and it starts from the last published version.
        The old client is killed first: its requests still running on the
        servers end as its connections close (the built-in server aborts a
        request whose client is gone, as SGLang and vLLM do)."""
        self.restarts += 1
        if self._proc.poll() is None:
            self._proc.kill()  # stopped or wedged: it must not come back beside the new one
        self._proc.wait()
        self._receiver.join(timeout=10)
        state = self.state_dict()  # the reply to a pending hand-over is not coming: last state + taken since
        self._conn.close()
        with self._cond:
            dropped = len(self._buffer)
            self._buffer.clear()
            self._error, self._lost = None, False
        self._taken, self._handed_since = None, []
        # (why it was lost was logged when it was found out)
        logger.warning("restarting the rollout client process (%d of %d) from the prompt ledger's state: its "
                       "groups in flight and the %d finished here but not yet trained are generated again",
                       self.restarts, self.max_restarts, dropped)
        try:
            self._launch(SpawnedClient.spawn(), dataclasses.replace(self._spec, resume_prompts=state))
            if self.pool.started:
                self.pool.start()
            if self.pool.pushing_on:
                self.pool.pushing()
            for url, why in list(self.pool.retired.items()):  # the pusher's thread may add some meanwhile
                self.pool.retire(url, why)
            for url, name in list(self.pool.adapters.items()):
                self._send(("set_adapter", url, name))
            for url in list(self.pool.ejected):
                self.pool.eject(url)
            if self._version is not None:
                self.start(self._version)
        except (ProducerStopped, OSError) as e:
            self._set_error(f"rollout client process could not be restarted: {e}")

    def state_dict(self) -> dict:
        """The ledger's state as of the last hand-over: the client's copy from
        its reply to that ``took``, plus any batch taken since (so a checkpoint
        is exact even if the client has died meanwhile)."""
        with self._request_lock:
            try:
                self._finish_take()
            except ProducerStopped:
                pass
            state = dict(self._ledger_state)
            if self._handed_since and "handed" in state:
                first = int(state["first_index"])
                state["handed"] = sorted(set(state["handed"]) | {i for i in self._handed_since if i >= first})
            return state

    def close(self) -> None:
        if self.closed:
            return
        self._closing = True  # the client's exit from here on is expected
        try:
            self.pool._events = self._request(("close",), timeout_s=30)
        except (ProducerStopped, OSError):
            pass
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        self._spawned.reap()
        self._conn.close()

    # ---------------------------------------------------------------- messaging

    def _send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except OSError as e:  # the client is gone: the receiver reports it
            if not self.closed:
                logger.warning("rollout client process unreachable (%s): %s dropped", e, msg[0])

    def _request(self, msg: tuple, timeout_s: float | None = None) -> Any:
        """Send ``msg`` and wait for the client's reply (trainer's thread)."""
        with self._request_lock:
            self._finish_take()
            self._send(msg)
            return self._reply(msg[0], timeout_s or self.reply_timeout_s)

    def _finish_take(self) -> None:
        """The reply to the last ``took``: the step's metrics, merged into its
        batch's, and the ledger's state after the hand-over."""
        if self._taken is not None:
            metrics, self._taken = self._taken, None
            step_metrics, self._ledger_state = self._reply("took", self.reply_timeout_s)
            self._handed_since = []
            metrics |= {k: v for k, v in step_metrics.items() if k != "time/wait_s"}

    def _reply(self, what: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                kind, value = self._replies.get(timeout=0.5)
                break
            except queue.Empty:
                if self._error is not None and self._proc.poll() is not None:
                    raise ProducerStopped(self._error) from None
                if time.monotonic() > deadline:
                    # A late reply would answer the wrong request: this client is done.
                    self._set_error(f"rollout client process did not answer {what!r} within {timeout_s:.0f} s",
                                    lost=True)
                    raise ProducerStopped(self._error) from None
        if kind == "reply_error":
            raise ProducerStopped(f"{value} (rollout client process, {what!r})")
        return value

    def _receive(self, conn: Connection, proc: subprocess.Popen, replies: queue.SimpleQueue) -> None:
        """The receiving thread of one client process: its groups, pool
        events and replies."""
        try:
            while True:
                msg = conn.recv()
                if conn is not self._conn:  # a client given up for a restarted one
                    return
                self._last_heard = time.monotonic()
                kind = msg[0]
                if kind == "alive":
                    continue
                if kind == "groups":
                    with self._cond:
                        self._buffer.extend(msg[1])
                        self._cond.notify_all()
                elif kind in ("reply", "reply_error"):
                    replies.put((kind, msg[1]))
                elif kind == "down":
                    if self.pool.on_down is not None:
                        self.pool.on_down(msg[1], msg[2])
                elif kind == "join":
                    url, assumed = msg[1], msg[2]
                    stale = bool(self.pool.on_join(url)) if self.pool.on_join is not None else False
                    # A restarted client's pool meets the replica file's replicas again: one the
                    # pusher has ejected (catching up) stays out until it readmits it.
                    stale = stale or url in self.pool.ejected
                    if stale != assumed:  # the pusher connected while the client decided
                        (self.pool.eject if stale else self.pool.readmit)(url)  # recorded for a restart
                elif kind == "error":
                    self._set_error(f"rollout generation failed: {msg[1]}")
        except (EOFError, OSError):
            if conn is self._conn:
                code = proc.wait()
                if not self._closing:
                    self._set_error(f"rollout client process exited ({describe_exit(code)}); its log is above",
                                    lost=True)
                # Also while closing: a client that exited on its own (one that could not start)
                # will not answer the close, and that wait must not run to its timeout.
                replies.put(("reply_error", "the process exited"))
        except Exception as e:  # noqa: BLE001  (a hook that raised: reported, not lost on this thread)
            self._set_error(f"rollout client messages: {type(e).__name__}: {e}")

    def _set_error(self, text: str, lost: bool = False) -> None:
        with self._cond:
            if self._error is None:
                self._error, self._lost = text, lost
                if self._restartable(lost):
                    logger.warning("%s", text)  # restarted by the trainer's next take
                # else the run stops on it: the trainer's stop line says it, once
            self._cond.notify_all()
