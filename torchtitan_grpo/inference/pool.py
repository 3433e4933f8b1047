"""InferencePool: generation requests over a fleet of inference replicas.

A request is one prompt with its whole group of ``n`` samples and goes to one
replica in one HTTP call, so a retry regenerates the whole group: a group is
never assembled from two attempts, and no sample is counted twice. The request
body (seed included) is built once, so a retried group asks the next replica
for exactly what the first one was asked.

Routing. One aiohttp session per replica (at most ``max_connections``
connections, kept alive). A request goes to the routable replica with the
fewest outstanding requests, preferring replicas it has not tried yet; a
replica never gets more than ``max_connections`` outstanding requests (extra
requests queue in the pool, where they do not burn their timeout).

Replica states (``states()``, ``metrics()``):

* ``healthy``: routable.
* ``slow``: routable but deprioritised. Its median latency over the last
  ``latency_window`` successful requests is more than ``slow_factor`` times
  the median of the other replicas' medians (the others, so that a fleet of
  two can tell which one is slow). Each outstanding request on a slow replica
  counts ``slow_weight`` times in routing, and an idle slow replica gets one
  request every ``slow_probe_interval_s`` so that its latency is re-measured:
  that is how it becomes healthy again.
* ``down``: not routed to. Entered on a failed request (connection error,
  timeout, an HTTP status other than 200/400/422/503, a malformed response)
  or a failed health check. Its requests in flight are cancelled at once
  and re-sent to another replica (a hung replica would otherwise hold them
  for ``request_timeout_s``), and ``on_down`` tells the weight pusher. The background health check (GET /health every
  ``health_interval_s``) returns it to routing once it answers 200, but not
  before a back-off of ``backoff_s * 2**(k-1)`` (capped at
  ``backoff_max_s``) after its k-th consecutive failed request, so a replica
  that passes /health yet answers garbage is retried ever more rarely instead
  of costing a retry every health interval.
* ``catching-up``: ejected by the weight pusher (``eject(url)``, it holds
  stale weights). Only ``readmit(url)`` ends it; a passing health check does
  not. Health checks still run meanwhile, so a readmitted replica that died
  in between comes back as ``down``.
* ``removed``: no longer listed in ``replica_file``; in-flight requests
  finish, nothing new is sent. It returns (as ``down``, until its first
  health check) if the file lists it again.

Results are validated by the backend's parser (``BACKENDS``); a malformed
reply is a replica failure. A group with any sample finished by ``"abort"``
(the replica was paused for a weight update), or an HTTP 503 (vLLM while
paused), is retried without blaming the replica, on a budget of its own
(``max_aborts``). HTTP 400/422 means the request itself was refused: retried
on another replica (its limits may differ) without marking anyone down.

If no replica is routable, a request waits for one to come back (health
check, ``readmit``, a new line in ``replica_file``) for at most
``request_timeout_s`` in all, then raises :class:`NoHealthyReplica`.

Replicas come from ``urls`` (routable at once: the caller started them and
waited for them) and/or ``PoolConfig.replica_file`` (routable after their
first passing health check), see there.

Threading: create and use the pool on one event loop (see ``aio.LoopThread``);
``eject``, ``readmit``, ``states`` and ``metrics`` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import json
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

from torchtitan_grpo.inference import sglang
from torchtitan_grpo.inference.types import Completion, MalformedResponse, SamplingParams

logger = logging.getLogger(__name__)

HEALTHY, SLOW, DOWN, CATCHING_UP, REMOVED = "healthy", "slow", "down", "catching-up", "removed"
STATE_CODES: dict[str, float] = {HEALTHY: 0.0, SLOW: 1.0, DOWN: 2.0, CATCHING_UP: 3.0, REMOVED: 4.0}
"""``pool/replica{i}_state`` holds these codes (metrics are floats)."""


# --------------------------------------------------------------------------- #
# Backends: (path, request builder, response parser) per engine protocol
# --------------------------------------------------------------------------- #

BuildFn = Callable[[list[int], int, SamplingParams, str], dict[str, Any]]
ParseFn = Callable[[Any, int, str], list[Completion]]


@dataclass(frozen=True)
class Backend:
    path: str
    """Generation route, POSTed with the JSON body from ``build``."""
    build: BuildFn
    """(prompt_ids, n, params, model) -> request body for one prompt and n samples."""
    parse: ParseFn
    """(json body, n, replica url) -> n completions; raises MalformedResponse."""
    health_path: str = "/health"


def _sglang_backend() -> Backend:
    return Backend("/generate", lambda ids, n, p, model: sglang.generate_request(ids, n, p), sglang.parse_generate)


def _vllm_backend() -> Backend:
    # Imported on use: a pool that speaks SGLang must not depend on this module.
    from torchtitan_grpo.inference import vllm

    return Backend("/v1/completions", vllm.completions_request, vllm.parse_completions)


BACKENDS: dict[str, Callable[[], Backend]] = {
    "sglang": _sglang_backend,
    "builtin": _sglang_backend,  # the built-in server speaks SGLang's /generate
    "vllm": _vllm_backend,
}


# --------------------------------------------------------------------------- #
# Configuration and errors
# --------------------------------------------------------------------------- #


@dataclass
class PoolConfig:
    backend: str = "sglang"
    """Protocol spoken to the replicas: "sglang", "builtin" (= sglang) or "vllm"."""
    model: str = ""
    """Model name sent in vLLM requests (``--served-model-name``); unused by SGLang."""
    request_timeout_s: float = 120.0
    """Timeout of one attempt (one HTTP round trip); also the most time one
    request may spend waiting for a routable replica."""
    connect_timeout_s: float = 10.0
    """TCP connect timeout, so an unreachable host fails fast."""
    max_retries: int = 3
    """Attempts (the first included) that may end in a replica failure."""
    max_aborts: int = 20
    """Further attempts for groups aborted by a weight update (or HTTP 503);
    not failures, so they have their own budget."""
    abort_backoff_s: float = 0.1
    """Pause before re-sending an aborted group to a replica it already tried
    (doubles each time, at most 2 s): a paused replica is not hammered."""
    max_connections: int = 64
    """Connections (= most outstanding requests) per replica."""
    keepalive_s: float = 60.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    backoff_s: float = 2.0
    """Least time a replica stays down after a failed request (doubles per
    consecutive failed request)."""
    backoff_max_s: float = 60.0
    slow_factor: float = 3.0
    """Slow = median latency above slow_factor x the other replicas' median."""
    slow_weight: float = 4.0
    """Routing weight of an outstanding request on a slow replica."""
    slow_probe_interval_s: float = 5.0
    """An idle slow replica gets a request at least this often (re-measures it)."""
    slow_hold_s: float = 5.0
    """A replica becomes slow, or healthy again, only once the new verdict has
    held this long: one log line per change that lasts."""
    slow_min_samples: int = 8
    """Latencies a replica needs before it can be judged slow (or compared
    against): a few unlucky requests must not flag a replica."""
    latency_window: int = 16
    """Recent successful requests per replica used for its median latency."""
    replica_file: str | None = None
    """File with one replica URL per line (blank lines and ``#`` comments
    ignored), written by a launcher. Re-read every ``replica_file_interval_s``:
    new URLs join (after a passing health check), URLs that disappear are
    removed (``urls`` given to the constructor are never removed). Replace it
    atomically (write + rename) so that a half-written file is never read."""
    replica_file_interval_s: float = 5.0
    api_key: str = ""
    """Sent as ``Authorization: Bearer <key>`` on every request (servers started with ``--api-key``)."""

    def __post_init__(self) -> None:
        def need(ok: bool, key: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"PoolConfig.{key} = {getattr(self, key)!r}: {msg}")

        need(self.backend in BACKENDS, "backend", f"must be one of {sorted(BACKENDS)}")
        for key in ("request_timeout_s", "connect_timeout_s", "health_interval_s", "health_timeout_s",
                    "keepalive_s", "replica_file_interval_s", "slow_probe_interval_s"):
            need(getattr(self, key) > 0, key, "must be > 0")
        for key in ("abort_backoff_s", "backoff_s", "backoff_max_s", "max_aborts", "slow_hold_s"):
            need(getattr(self, key) >= 0, key, "must be >= 0")
        need(self.max_retries >= 1, "max_retries", "must be >= 1")
        need(self.max_connections >= 1, "max_connections", "must be >= 1")
        need(self.slow_factor > 1, "slow_factor", "must be > 1")
        need(self.slow_weight >= 1, "slow_weight", "must be >= 1")
        need(self.slow_min_samples >= 1, "slow_min_samples", "must be >= 1")
        need(self.latency_window >= self.slow_min_samples, "latency_window", "must be >= slow_min_samples")


class PoolError(RuntimeError):
    pass


class NoHealthyReplica(PoolError):
    """No replica became routable within ``request_timeout_s``."""


class GenerationFailed(PoolError):
    """Every allowed attempt of one request failed."""


class _ReplicaFailure(Exception):
    """The replica misbehaved: mark it down and retry elsewhere."""

    def __init__(self, kind: str, msg: str):
        super().__init__(msg)
        self.kind = kind  # "timeout" | "connection" | "http" | "malformed" | "down" (cancelled, re-sent)


class _Aborted(Exception):
    """The replica is fine but did not finish the group (paused): retry."""


class _Rejected(Exception):
    """HTTP 400/422: the replica refused this request."""


# --------------------------------------------------------------------------- #
# Replica
# --------------------------------------------------------------------------- #


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


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of an ascending list."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[k]


# --------------------------------------------------------------------------- #
# Pool
# --------------------------------------------------------------------------- #


class InferencePool:
    """Create, ``await start()``, ``await generate(...)`` from many tasks, ``await close()``."""

    def __init__(self, urls: list[str], config: PoolConfig | None = None):
        self.config = config or PoolConfig()
        if not urls and not self.config.replica_file:
            raise ValueError("InferencePool needs replica URLs or PoolConfig.replica_file")
        self.backend = BACKENDS[self.config.backend]()
        self.replicas: list[Replica] = []
        self._by_url: dict[str, Replica] = {}
        self._lock = threading.Lock()  # replica list, eject flags, latency windows
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
        self._busy_mark = (time.monotonic(), {})  # (time, {index: busy_s}) at the last metrics()
        for u in dict.fromkeys(_norm(u) for u in urls):
            self._add(u, static=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._health_session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._checks: set[asyncio.Task] = set()
        self._file_mtime: float | None = None
        self._closed = False
        self._latency: deque[float] = deque(maxlen=4096)  # end-to-end, successful requests
        self.counters: dict[str, int] = dict.fromkeys(
            ("requests", "failed_requests", "attempts", "retries", "failures", "timeouts", "malformed",
             "connection_errors", "http_errors", "rejected", "aborts", "waits", "resent"), 0)

    # ---- lifecycle -------------------------------------------------------- #

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
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
        self._closed = True
        self._notify()  # requests still waiting for a replica fail now, not at their timeout
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
        with self._lock:
            r = Replica(len(self.replicas), url, static=static,
                        latencies=deque(maxlen=self.config.latency_window))
            r.ejected = stale or url in self._pending_eject
            self._pending_eject.discard(url)
            self.replicas.append(r)
            self._by_url[url] = r
        return r

    # ---- generation ------------------------------------------------------- #

    async def generate(self, prompt_ids: list[int], n: int, params: SamplingParams) -> list[Completion]:
        """``n`` samples of one prompt, all from one replica and one attempt."""
        cfg = self.config
        t0 = time.monotonic()
        body = self.backend.build(list(prompt_ids), n, params, cfg.model)
        tried: set[str] = set()
        errors: list[str] = []
        failures = aborts = 0
        wait_budget = [cfg.request_timeout_s]
        attempt = 0
        while True:
            try:
                r = await self._acquire(tried, wait_budget)
            except NoHealthyReplica:
                self.counters["failed_requests"] += 1
                raise
            attempt += 1
            self.counters["attempts"] += 1
            if attempt > 1:
                self.counters["retries"] += 1
            tried.add(r.url)
            epoch = r.epoch
            t_attempt = time.monotonic()
            outcome: Exception | None = None
            task = asyncio.ensure_future(self._attempt(r, body, n))
            r.attempts.add(task)
            try:
                # Not ``await task``: a replica marked down cancels its attempts
                # (``_mark_down``), and that must end this attempt, not this request.
                await asyncio.wait({task})
                if task.cancelled():
                    raise _ReplicaFailure("down", f"re-sent: the replica went down ({r.down_reason})")
                out = task.result()
            except (_ReplicaFailure, _Rejected, _Aborted) as e:
                outcome = e
            except asyncio.CancelledError:
                task.cancel()  # the request itself was cancelled (the producer closing)
                raise
            finally:
                r.attempts.discard(task)
                self._release(r)
            if outcome is None:
                self._succeeded(r, time.monotonic() - t_attempt)
                with self._lock:
                    self._latency.append(time.monotonic() - t0)
                self.counters["requests"] += 1
                return out
            errors.append(f"{r.url}: {outcome}")
            if isinstance(outcome, _Aborted):
                aborts += 1
                self.counters["aborts"] += 1
                if aborts > cfg.max_aborts:
                    self.counters["failed_requests"] += 1
                    raise GenerationFailed(f"group aborted {aborts} times: " + " | ".join(errors[-3:]))
                if not self._has_untried(tried):
                    # Every routable replica was tried: they are all paused for
                    # a weight update; give it a moment instead of spinning.
                    await asyncio.sleep(min(cfg.abort_backoff_s * 2 ** (aborts - 1), 2.0))
                continue
            failures += 1
            if isinstance(outcome, _ReplicaFailure):
                self._failed(r, outcome, epoch)
            else:
                self.counters["rejected"] += 1
            if failures >= cfg.max_retries:
                self.counters["failed_requests"] += 1
                raise GenerationFailed(f"generation failed after {failures} failed attempt(s): " + " | ".join(errors))

    async def _attempt(self, r: Replica, body: dict[str, Any], n: int) -> list[Completion]:
        """One HTTP call; raises one of the private exceptions on anything but a full group."""
        cfg = self.config
        assert r.session is not None, "InferencePool.start() was not awaited"
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s)
        try:
            async with r.session.post(r.url + self.backend.path, json=body, timeout=timeout) as resp:
                raw = await resp.read()
                status = resp.status
        except asyncio.TimeoutError:  # before ClientError: aiohttp's timeouts are both
            raise _ReplicaFailure("timeout", f"no reply within {cfg.request_timeout_s}s") from None
        except aiohttp.ClientError as e:
            raise _ReplicaFailure("connection", f"{type(e).__name__}: {e}") from None
        if status == 503:
            raise _Aborted(f"HTTP 503 (paused or overloaded): {raw[:200]!r}")
        if status in (400, 422):
            raise _Rejected(f"HTTP {status}: {raw[:300].decode(errors='replace')}")
        if status != 200:
            raise _ReplicaFailure("http", f"HTTP {status}: {raw[:300].decode(errors='replace')}")
        try:
            data = json.loads(raw)
        except ValueError:
            raise _ReplicaFailure("malformed", f"reply is not JSON: {raw[:100]!r}") from None
        try:
            out = self.backend.parse(data, n, r.url)
        except MalformedResponse as e:
            raise _ReplicaFailure("malformed", str(e)) from None
        except Exception as e:  # a parser tripping over hostile input is still a bad reply
            logger.exception("parser failed on a reply from %s", r.url)
            raise _ReplicaFailure("malformed", f"unparseable reply: {type(e).__name__}: {e}") from None
        if len(out) != n:  # parsers check this; a group must never be short or long
            raise _ReplicaFailure("malformed", f"{len(out)} completions for n={n}")
        if any(c.finish_reason == "abort" for c in out):
            # Paused with mode "abort" for a weight update: the whole group is
            # regenerated, never completed from the samples that did finish.
            raise _Aborted("group aborted (weight update)")
        return out

    # ---- routing ---------------------------------------------------------- #

    def _has_untried(self, tried: set[str]) -> bool:
        return any(r.routable and r.url not in tried for r in self.replicas)

    def _pick(self, tried: set[str]) -> Replica | None:
        cfg = self.config
        cands = [r for r in self.replicas if r.routable and r.outstanding < cfg.max_connections]
        if not cands:
            return None
        fresh = [r for r in cands if r.url not in tried] or cands
        now = time.monotonic()
        for r in fresh:
            if r.slow and r.outstanding == 0 and now - r.last_dispatch >= cfg.slow_probe_interval_s:
                return r  # probe: the only way a deprioritised replica can prove it recovered
        # Least outstanding (a slow replica's requests weigh more); ties go to
        # the replica that waited longest, i.e. round-robin when idle.
        return min(fresh, key=lambda r: ((r.outstanding + 1) * (cfg.slow_weight if r.slow else 1.0),
                                         r.last_dispatch))

    async def _acquire(self, tried: set[str], wait_budget: list[float]) -> Replica:
        """A replica with one more outstanding request, waiting if none is routable."""
        assert self._changed is not None, "InferencePool.start() was not awaited"
        counted = False
        while True:
            if self._closed:
                raise PoolError("InferencePool is closed")
            r = self._pick(tried)
            if r is not None:
                if r.outstanding == 0:
                    r.busy_since = time.monotonic()
                r.outstanding += 1
                r.dispatched += 1
                r.last_dispatch = time.monotonic()
                return r
            event = self._changed
            if any(x.routable for x in self.replicas):
                await event.wait()  # all at max_connections: plain queueing
                continue
            if self.replicas and all(x.retired for x in self.replicas):
                raise NoHealthyReplica("every inference replica is gone for good: " + self._describe())
            if not counted:
                self.counters["waits"] += 1
                counted = True
            if wait_budget[0] <= 0:
                raise NoHealthyReplica(
                    f"no routable inference replica within {self.config.request_timeout_s}s: " + self._describe())
            t = time.monotonic()
            try:
                await asyncio.wait_for(event.wait(), wait_budget[0])
            except asyncio.TimeoutError:
                pass
            wait_budget[0] -= time.monotonic() - t

    def _release(self, r: Replica) -> None:
        r.outstanding -= 1
        if r.outstanding == 0 and r.busy_since is not None:
            with self._lock:
                r.busy_s += time.monotonic() - r.busy_since
                r.busy_since = None
        self._notify()

    def _notify(self) -> None:
        """Wake every request waiting for a replica (call on the loop)."""
        if self._changed is not None:
            event, self._changed = self._changed, asyncio.Event()
            event.set()

    def _notify_threadsafe(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._notify()
        else:
            loop.call_soon_threadsafe(self._notify)

    def _describe(self) -> str:
        return "; ".join(f"{r.url} {r.state}" + (f" ({r.last_error})" if r.last_error else "")
                         for r in self.replicas)

    # ---- outcomes --------------------------------------------------------- #

    def _failed(self, r: Replica, e: _ReplicaFailure, epoch: int) -> None:
        cfg = self.config
        self.counters["failures"] += 1
        self.counters[{"timeout": "timeouts", "malformed": "malformed", "connection": "connection_errors",
                       "http": "http_errors", "down": "resent"}[e.kind]] += 1
        r.failures += 1
        r.last_error = f"{e.kind}: {e}"
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
        with self._lock:
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

    def _succeeded(self, r: Replica, latency_s: float) -> None:
        r.served += 1
        if r.routable:
            r.consecutive_failures = 0
        with self._lock:
            r.latencies.append(latency_s)
        self._update_slow()

    def _update_slow(self) -> None:
        cfg = self.config
        with self._lock:
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
                    r.url + self.backend.health_path,
                    timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s)) as resp:
                await resp.read()
                ok, why = resp.status == 200, f"health check: HTTP {resp.status}"
        except asyncio.TimeoutError:
            why = f"health check: no reply within {self.config.health_timeout_s}s"
        except aiohttp.ClientError as e:
            why = f"health check: {type(e).__name__}: {e}"
        finally:
            r.checking = False
        if r.removed:
            return
        if not ok:
            r.last_error = why
            self._mark_down(r, why, 0.0)
        elif r.down and time.monotonic() >= r.retry_at:
            r.down, r.down_reason = False, ""
            self._open(r)
            with self._lock:
                self.events.append((time.time(), r.url, "back", "passed its health check"))
            # catching-up replicas stay out of routing until readmit().
            logger.warning("inference replica %s passed its health check: %s", r.url, r.state)
            self._notify()

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
        self._notify()

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
            self._notify()

    def _retire_now(self, url: str, reason: str) -> None:
        r = self._by_url.get(url)
        if r is None:
            return
        self._down_now(url, reason)
        r.removed = r.retired = True
        r.last_error = reason
        with self._lock:
            self.events.append((time.time(), url, "retired", reason))
        self._notify()

    def eject(self, url: str) -> None:
        """Stop routing to ``url`` until ``readmit(url)`` (it holds stale weights)."""
        url = _norm(url)
        with self._lock:
            r = self._by_url.get(url)
            if r is None:
                self._pending_eject.add(url)  # applies if it joins later
                return
            if r.ejected:
                return
            r.ejected = True
            self.events.append((time.time(), url, "ejected", "catching up on weights"))
        logger.warning("inference replica %s ejected (catching up on weights)", url)
        self._notify_threadsafe()

    def readmit(self, url: str) -> None:
        """Route to ``url`` again (the pusher confirmed it holds the newest weights)."""
        url = _norm(url)
        with self._lock:
            self._pending_eject.discard(url)
            r = self._by_url.get(url)
            if r is None or not r.ejected:
                return
            r.ejected = False
            self.events.append((time.time(), url, "readmitted", "holds the newest weights"))
        logger.warning("inference replica %s readmitted: %s", url, r.state)
        self._notify_threadsafe()

    # ---- introspection (any thread) --------------------------------------- #

    def states(self) -> dict[str, str]:
        with self._lock:
            return {r.url: r.state for r in self.replicas}

    def metrics(self) -> dict[str, float]:
        """Counters and states; ``pool/replica{i}_busy_frac`` is the share of the
        time since the previous call during which replica i had a request outstanding."""
        now = time.monotonic()
        with self._lock:
            replicas = list(self.replicas)
            latency = sorted(self._latency)
            medians = {r.index: statistics.median(r.latencies) if r.latencies else 0.0 for r in replicas}
            busy = {r.index: r.busy_s + (now - r.busy_since if r.busy_since is not None else 0.0) for r in replicas}
            (t_prev, busy_prev), self._busy_mark = self._busy_mark, (now, busy)
        m: dict[str, float] = {f"pool/{k}": float(v) for k, v in self.counters.items()}
        states = [r.state for r in replicas]
        m["pool/replicas"] = float(sum(s != REMOVED for s in states))
        for s in (HEALTHY, SLOW, DOWN, CATCHING_UP):
            m[f"pool/replicas_{s.replace('-', '_')}"] = float(states.count(s))
        m["pool/outstanding"] = float(sum(r.outstanding for r in replicas))
        m["pool/latency_p50_s"] = percentile(latency, 50)
        m["pool/latency_p99_s"] = percentile(latency, 99)
        for r, s in zip(replicas, states):
            m[f"pool/replica{r.index}_state"] = STATE_CODES[s]
            m[f"pool/replica{r.index}_outstanding"] = float(r.outstanding)
            m[f"pool/replica{r.index}_served"] = float(r.served)
            m[f"pool/replica{r.index}_failures"] = float(r.failures)
            m[f"pool/replica{r.index}_downs"] = float(r.downs)
            m[f"pool/replica{r.index}_latency_s"] = medians[r.index]
            if now > t_prev:
                m[f"pool/replica{r.index}_busy_frac"] = (busy[r.index] - busy_prev.get(r.index, 0.0)) / (now - t_prev)
        return m
