"""The replica fleet of an :class:`~torchtitan_grpo.fleet.pool.InferencePool`:
each replica's state and the machine that moves it between states (health
checks, back-off, slow detection, the replica file, the launcher's and the
weight pusher's hooks). Request dispatch (which replica gets a request,
retries, the HTTP call) is ``fleet/pool.py``'s; it asks this module which replicas
are routable and tells it how each attempt went.

Replica states (``ReplicaSet.states()``):

* ``healthy``: routable.
* ``slow``: routable but deprioritised. Its median latency over the last
  ``latency_window`` successful requests is more than ``slow_factor`` times
  the median of the other replicas' medians (the others, so that a fleet of
  two can tell which one is slow). A new verdict must hold ``slow_hold_s``.
* ``down``: not routed to. Entered on a failed request or a failed health
  check; its requests in flight are cancelled at once (the pool re-sends
  them) and ``on_down`` tells the weight pusher. The background health check
  (GET ``health_path`` every ``health_interval_s``) returns it to routing
  once it answers 200, but not before a back-off of ``backoff_s * 2**(k-1)``
  (capped at ``backoff_max_s``) after its k-th consecutive failed request.
* ``catching-up``: ejected by the weight pusher (``eject(url)``, it holds
  stale weights). Only ``readmit(url)`` ends it; a passing health check does
  not. Health checks still run meanwhile, so a readmitted replica that died
  in between comes back as ``down``.
* ``removed``: no longer listed in ``replica_file``; in-flight requests
  finish, nothing new is sent. It returns (as ``down``, until its first
  health check) if the file lists it again. ``retire(url)`` removes it for good.

Every change that can make a waiting request routable sets the current
``changed`` event (:meth:`ReplicaSet.notify`). Threading: start and use it on
one event loop; ``eject``, ``readmit``, ``mark_down``, ``retire`` and
``states`` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp

from torchtitan_grpo.reasons import typed_reason

logger = logging.getLogger("torchtitan_grpo.fleet.pool")  # the pool's log, as before the split

HEALTHY, SLOW, DOWN, CATCHING_UP, REMOVED = "healthy", "slow", "down", "catching-up", "removed"
STATE_CODES: dict[str, float] = {HEALTHY: 0.0, SLOW: 1.0, DOWN: 2.0, CATCHING_UP: 3.0, REMOVED: 4.0}
"""``pool/replica{i}_state`` holds these codes (metrics are floats)."""


@dataclass(eq=False)
class Replica:
    index: int
    """Position in ``pool.replicas`` (stable: metric names use it)."""
    url: str
    static: bool = True
    """Given to the constructor, so never removed by ``replica_file``."""
    session: aiohttp.ClientSession | None = None
    outstanding: int = 0
    down: bool = False
    down_reason: str = ""
    retry_at: float = 0.0
    """Monotonic time before which a passing health check does not readmit."""
    epoch: int = 0
    """Bumped when marked down: failures of requests sent before that do not
    lengthen the back-off (one crash fails every in-flight request at once)."""
    consecutive_failures: int = 0
    ejected: bool = False
    slow: bool = False
    removed: bool = False
    checking: bool = False
    last_dispatch: float = -math.inf
    latencies: deque = field(default_factory=deque)
    dispatched: int = 0
    served: int = 0
    failures: int = 0
    downs: int = 0
    """Times it went down (a flapping replica shows here)."""
    last_error: str = ""
    attempts: set = field(default_factory=set)
    """Its requests in flight (asyncio tasks): cancelled, and so re-sent
    elsewhere, the moment it is marked down."""
    busy_since: float | None = None
    """Monotonic time its outstanding count last went from 0 to 1 (None: idle)."""
    busy_s: float = 0.0
    """Seconds with at least one request outstanding, up to ``busy_since``."""
    slow_verdict_since: float | None = None
    """Since when the latest slow/not-slow verdict differs from ``slow`` (hysteresis)."""
    retired: bool = False
    """Given up by its launcher: removed for good, whatever the replica file says."""

    @property
    def state(self) -> str:
        if self.removed:
            return REMOVED
        if self.ejected:
            return CATCHING_UP
        if self.down:
            return DOWN
        return SLOW if self.slow else HEALTHY

    @property
    def routable(self) -> bool:
        return not (self.removed or self.ejected or self.down)


def _transition(before: str, r: Replica) -> str:
    """``"down -> healthy"``; a replica out of routing after the change says
    what it still waits for (a restarted server can be caught up on weights
    before its health check has passed, or pass it before it is caught up)."""
    after = r.state
    waits = {DOWN: " (routed again once it passes its health check)",
             CATCHING_UP: " (routed again once it holds the newest weights)"}.get(after, "")
    return f"{before} -> {after}{waits}"


def _norm(url: str) -> str:
    return url.strip().rstrip("/")


def read_replica_file(path: str) -> list[str]:
    """URLs listed in ``path`` (one per line; blanks and ``#`` comments skipped)."""
    urls = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            if not line.startswith(("http://", "https://")):
                raise ValueError(f"{path}: {line!r} is not an http(s) URL")
            urls.append(_norm(line))
    return urls


class ReplicaSet:
    """The replicas and their state machine. ``config`` is the pool's
    ``PoolConfig`` (its health, back-off, slow, connection and replica-file
    settings); ``health_path`` the backend's health route."""

    def __init__(self, urls: list[str], config: Any, health_path: str = "/health"):
        self.config = config
        self.health_path = health_path
        self.replicas: list[Replica] = []
        self._by_url: dict[str, Replica] = {}
        self.lock = threading.Lock()  # replica list, eject flags, latency windows, busy times
        self._pending_eject: set[str] = set()  # ejected before the replica joined
        self.on_join: Callable[[str], bool] | None = None
        """Set by the weight pusher: called with each replica that joins through
        the replica file; True means "it holds stale weights: route to it only
        after readmit()"."""
        self.events: list[tuple[float, str, str, str]] = []
        """(time.time(), url, kind, detail) for each replica going down, coming
        back, ejected, readmitted or retired: the run's summary lists them."""
        self.on_down: Callable[[str, str], None] | None = None
        """Set by the weight pusher: called (on the pool's loop) with a replica's
        URL and the reason when it is marked down."""
        for u in dict.fromkeys(_norm(u) for u in urls):
            self._add(u, static=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.changed: asyncio.Event | None = None
        """Set (and replaced) whenever a replica may have become routable."""
        self._health_session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._checks: set[asyncio.Task] = set()
        self._file_mtime: float | None = None

    # ---- lifecycle -------------------------------------------------------- #

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.changed = asyncio.Event()
        # Health checks get their own small session: a replica busy with
        # max_connections generations must still answer its health check.
        self._health_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=2, keepalive_timeout=self.config.keepalive_s),
            headers=self._headers())
        for r in self.replicas:
            self._open(r)
        if self.config.replica_file:
            self._reread_file()
            self._tasks.append(asyncio.create_task(self._file_loop(), name="pool-replica-file"))
        self._tasks.append(asyncio.create_task(self._health_loop(), name="pool-health"))

    async def close(self) -> None:
        self.notify()  # requests still waiting for a replica fail now, not at their timeout
        tasks = self._tasks + list(self._checks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks, self._checks = [], set()
        for r in self.replicas:
            if r.session is not None:
                await r.session.close()
                r.session = None
        if self._health_session is not None:
            await self._health_session.close()
            self._health_session = None

    def _open(self, r: Replica) -> None:
        if r.session is None:
            cfg = self.config
            r.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=cfg.max_connections, keepalive_timeout=cfg.keepalive_s),
                headers=self._headers())

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    def _add(self, url: str, static: bool) -> Replica:
        stale = not static and self.on_join is not None and self.on_join(url)
        with self.lock:
            r = Replica(len(self.replicas), url, static=static,
                        latencies=deque(maxlen=self.config.latency_window))
            r.ejected = stale or url in self._pending_eject
            self._pending_eject.discard(url)
            self.replicas.append(r)
            self._by_url[url] = r
        return r

    # ---- queries and wake-ups (on the loop) -------------------------------- #

    def routable(self) -> bool:
        return any(r.routable for r in self.replicas)

    def all_retired(self) -> bool:
        return bool(self.replicas) and all(r.retired for r in self.replicas)

    def notify(self) -> None:
        """Wake every request waiting for a replica (call on the loop)."""
        if self.changed is not None:
            event, self.changed = self.changed, asyncio.Event()
            event.set()

    def notify_threadsafe(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self.notify()
        else:
            loop.call_soon_threadsafe(self.notify)

    def describe(self) -> str:
        return "; ".join(f"{r.url} {r.state}" + (f" ({r.last_error})" if r.last_error else "")
                         for r in self.replicas)

    # ---- outcomes --------------------------------------------------------- #

    def failed(self, r: Replica, reason: str, epoch: int) -> None:
        """An attempt sent while the replica was at ``epoch`` failed: down,
        with a back-off that doubles per consecutive failed request."""
        cfg = self.config
        r.failures += 1
        r.last_error = reason
        if epoch != r.epoch:
            return  # sent before the replica was marked down: same incident
        r.consecutive_failures += 1
        backoff = min(cfg.backoff_s * 2 ** (r.consecutive_failures - 1), cfg.backoff_max_s)
        self._mark_down(r, r.last_error, backoff)

    def _mark_down(self, r: Replica, reason: str, backoff_s: float) -> None:
        r.retry_at = max(r.retry_at, time.monotonic() + backoff_s)
        if r.down:
            return
        r.down, r.down_reason = True, reason
        r.downs += 1
        r.epoch += 1
        r.slow = False
        with self.lock:
            r.latencies.clear()  # it may come back as a different process
            self.events.append((time.time(), r.url, "down", reason))
        logger.warning("inference replica %s is down (%s)", r.url, reason)
        # Down means out at once: its groups in flight go to another replica now
        # (a hung replica would otherwise hold them for request_timeout_s), and
        # the weight pusher stops waiting for it.
        for t in list(r.attempts):
            t.cancel()
        if self.on_down is not None:
            try:
                self.on_down(r.url, reason)
            except Exception:  # a hook's bug must not stop routing
                logger.exception("on_down hook failed for %s", r.url)

    def succeeded(self, r: Replica, latency_s: float) -> None:
        r.served += 1
        if r.routable:
            r.consecutive_failures = 0
        with self.lock:
            r.latencies.append(latency_s)
        self.update_slow()

    def update_slow(self) -> None:
        cfg = self.config
        with self.lock:
            medians = {r: statistics.median(r.latencies) for r in self.replicas
                       if not r.removed and len(r.latencies) >= cfg.slow_min_samples}
        now = time.monotonic()
        for r in self.replicas:
            others = [m for o, m in medians.items() if o is not r]
            slow = r in medians and bool(others) and medians[r] > cfg.slow_factor * statistics.median(others)
            if slow == r.slow:
                r.slow_verdict_since = None
                continue
            # Hysteresis: a new verdict must hold for slow_hold_s before it is
            # applied (and logged), so a loaded box does not flap several times a second.
            if r.slow_verdict_since is None:
                r.slow_verdict_since = now
            if now - r.slow_verdict_since >= cfg.slow_hold_s:
                r.slow, r.slow_verdict_since = slow, None
                logger.warning("inference replica %s is %s (median latency %.3fs, fleet %.3fs)", r.url,
                               "slow" if slow else "no longer slow", medians.get(r, 0.0),
                               statistics.median(others) if others else 0.0)

    # ---- health checks and replica file ----------------------------------- #

    async def _health_loop(self) -> None:
        while True:
            for r in list(self.replicas):
                if not r.removed and not r.checking:
                    r.checking = True  # a hung replica must not delay the others' checks
                    t = asyncio.create_task(self._check(r))
                    self._checks.add(t)
                    t.add_done_callback(self._checks.discard)
            await asyncio.sleep(self.config.health_interval_s)

    async def _check(self, r: Replica) -> None:
        assert self._health_session is not None
        ok, why = False, ""
        try:
            async with self._health_session.get(
                    r.url + self.health_path,
                    timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s)) as resp:
                await resp.read()
                ok, why = resp.status == 200, f"health check: HTTP {resp.status}"
        except asyncio.TimeoutError:
            why = f"health check: no reply within {self.config.health_timeout_s}s"
        except aiohttp.ClientError as e:
            why = f"health check: {typed_reason(e)}"
        finally:
            r.checking = False
        if r.removed:
            return
        if not ok:
            r.last_error = why
            self._mark_down(r, why, 0.0)
        elif r.down and time.monotonic() >= r.retry_at:
            before = r.state
            r.down, r.down_reason = False, ""
            self._open(r)
            with self.lock:
                self.events.append((time.time(), r.url, "back", "passed its health check"))
            # catching-up replicas stay out of routing until readmit().
            logger.warning("inference replica %s passed its health check: %s", r.url, _transition(before, r))
            self.notify()

    async def _file_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.replica_file_interval_s)
            self._reread_file()

    def _reread_file(self) -> None:
        path = self.config.replica_file
        assert path is not None
        try:
            mtime = os.stat(path).st_mtime_ns
            if mtime == self._file_mtime:
                return
            urls = read_replica_file(path)
        except (OSError, ValueError) as e:
            # A launcher may not have written it yet; keep the replicas we know.
            logger.warning("cannot read replica file %s: %s", path, e)
            return
        self._file_mtime = mtime
        listed = set(urls)
        for u in urls:
            r = self._by_url.get(u)
            if r is None:
                r = self._add(u, static=False)
                logger.warning("inference replica %s joined from %s", u, path)
            elif r.retired:
                continue
            elif r.removed:
                r.removed = False
                logger.warning("inference replica %s is listed again in %s", u, path)
            else:
                continue
            # Joining replicas are routed to only after a passing health check.
            r.down, r.down_reason, r.retry_at = True, "joining", 0.0
            r.epoch += 1
            self._open(r)
        for r in self.replicas:
            if not r.static and not r.removed and r.url not in listed:
                r.removed = True
                logger.warning("inference replica %s is no longer listed in %s: removed", r.url, path)
        self.notify()

    # ---- launcher and weight pusher hooks (any thread) --------------------- #

    def mark_down(self, url: str, reason: str) -> None:
        """Take ``url`` out of routing now (its process exited): its groups in
        flight are re-sent and ``on_down`` is called; a passing health check
        brings it back (after the pusher readmits it, if it ejected it)."""
        self._on_loop(self._down_now, _norm(url), reason)

    def retire(self, url: str, reason: str) -> None:
        """``url`` will never come back (its launcher gave up on it): removed
        for good. Once every replica is retired, requests fail at once instead
        of waiting ``request_timeout_s`` for one."""
        self._on_loop(self._retire_now, _norm(url), reason)

    def _on_loop(self, fn: Callable, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(fn, *args)

    def _down_now(self, url: str, reason: str) -> None:
        r = self._by_url.get(url)
        if r is not None and not r.removed:
            self._mark_down(r, reason, self.config.backoff_s)
            self.notify()

    def _retire_now(self, url: str, reason: str) -> None:
        r = self._by_url.get(url)
        if r is None:
            return
        self._down_now(url, reason)
        r.removed = r.retired = True
        r.last_error = reason
        with self.lock:
            self.events.append((time.time(), url, "retired", reason))
        self.notify()

    def eject(self, url: str) -> None:
        """Stop routing to ``url`` until ``readmit(url)`` (it holds stale weights)."""
        url = _norm(url)
        with self.lock:
            r = self._by_url.get(url)
            if r is None:
                self._pending_eject.add(url)  # applies if it joins later
                return
            if r.ejected:
                return
            r.ejected = True
            # Said as a state, not a plan: a server that never comes back is ejected too.
            self.events.append((time.time(), url, "ejected", "its weights are out of date"))
        logger.warning("inference replica %s ejected (its weights are out of date)", url)
        self.notify_threadsafe()

    def readmit(self, url: str) -> None:
        """Route to ``url`` again (the pusher confirmed it holds the newest weights)."""
        url = _norm(url)
        with self.lock:
            self._pending_eject.discard(url)
            r = self._by_url.get(url)
            if r is None or not r.ejected:
                return
            before = r.state
            r.ejected = False
            self.events.append((time.time(), url, "readmitted", "holds the newest weights"))
            change = _transition(before, r)
        logger.warning("inference replica %s readmitted (holds the newest weights): %s", url, change)
        self.notify_threadsafe()

    # ---- introspection (any thread) --------------------------------------- #

    def states(self) -> dict[str, str]:
        with self.lock:
            return {r.url: r.state for r in self.replicas}
