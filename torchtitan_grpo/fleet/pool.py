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

Replica states (``states()``, ``metrics()``) and the machine that moves a
replica between them live in ``fleet/replicas.py`` (:class:`ReplicaSet`, the
pool's ``fleet``); this module dispatches requests over it:

* ``healthy``: routable.
* ``slow``: routable but deprioritised (``fleet/replicas.py`` says when). Each
  outstanding request on a slow replica counts ``slow_weight`` times in
  routing, and an idle slow replica gets one request every
  ``slow_probe_interval_s`` so that its latency is re-measured: that is how
  it becomes healthy again.
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
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp

from torchtitan_grpo import jsonfast
from torchtitan_grpo.fleet import sglang
from torchtitan_grpo.fleet.replicas import CATCHING_UP, DOWN, HEALTHY, REMOVED, SLOW, STATE_CODES, Replica, ReplicaSet, read_replica_file
from torchtitan_grpo.fleet.types import Completion, MalformedResponse, SamplingParams
from torchtitan_grpo.reasons import typed_reason

__all__ = [
    "BACKENDS", "CATCHING_UP", "DOWN", "HEALTHY", "REMOVED", "SLOW", "STATE_CODES", "Backend", "GenerationFailed",
    "InferencePool", "NoHealthyReplica", "PoolConfig", "PoolError", "Replica", "percentile", "read_replica_file",
]

logger = logging.getLogger(__name__)


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
    adapter: Callable[[dict[str, Any], str], dict[str, Any]] | None = None
    """(body, adapter name) -> the body run on that LoRA adapter (``InferencePool.set_adapter``)."""


def _sglang_backend() -> Backend:
    from torchtitan_grpo.protocol.sglang import name_adapter

    return Backend("/generate", lambda ids, n, p, model: sglang.generate_request(ids, n, p), sglang.parse_generate,
                   adapter=name_adapter)


def _vllm_backend() -> Backend:
    # Imported on use: a pool that speaks SGLang must not depend on this module.
    from torchtitan_grpo.fleet import vllm

    from torchtitan_grpo.protocol.vllm import name_adapter

    return Backend("/v1/completions", vllm.completions_request, vllm.parse_completions, adapter=name_adapter)


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
    route_shape: tuple[int, int] | None = None
    """(MoE layers, top_k) of the served model: ask every request for its routed
    experts and decode them into ``Completion.routed_experts`` (router replay,
    ``route_backend.route_shape`` reads it from config.json). None: no routes."""

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
        if self.config.route_shape is not None:  # router replay: every request asks for its routed experts
            from torchtitan_grpo.fleet.route_backend import with_routes

            self.backend = with_routes(self.config.backend, self.backend, self.config.route_shape)
        self.fleet = ReplicaSet(urls, self.config, self.backend.health_path)
        """The replicas and their health / state machine."""
        self._busy_mark = (time.monotonic(), {})  # (time, {index: busy_s}) at the last metrics()
        self._closed = False
        self._latency: deque[float] = deque(maxlen=4096)  # end-to-end, successful requests
        self.counters: dict[str, int] = dict.fromkeys(
            ("requests", "failed_requests", "attempts", "retries", "failures", "timeouts", "malformed",
             "connection_errors", "http_errors", "rejected", "aborts", "waits", "resent"), 0)
        self.adapters: dict[str, str] = {}
        """Per replica URL, the LoRA adapter its requests name (``set_adapter``)."""

    def set_adapter(self, url: str, name: str) -> None:
        """From now on, name the LoRA adapter ``name`` in every attempt sent to
        ``url`` (weight_sync.lora_push = "adapter": the adapter push calls it
        once the replica serves the new adapter; any thread)."""
        self.adapters[url.rstrip("/")] = name

    # ---- the fleet, as the pool's callers see it --------------------------- #

    @property
    def replicas(self) -> list[Replica]:
        return self.fleet.replicas

    @property
    def events(self) -> list[tuple[float, str, str, str]]:
        """(time.time(), url, kind, detail) for each replica going down, coming
        back, ejected, readmitted or retired: the run's summary lists them."""
        return self.fleet.events

    @property
    def on_join(self) -> Callable[[str], bool] | None:
        """Set by the weight pusher: called with each replica that joins through
        the replica file; True means "it holds stale weights: route to it only
        after readmit()"."""
        return self.fleet.on_join

    @on_join.setter
    def on_join(self, hook: Callable[[str], bool] | None) -> None:
        self.fleet.on_join = hook

    @property
    def on_down(self) -> Callable[[str, str], None] | None:
        """Set by the weight pusher: called (on the pool's loop) with a replica's
        URL and the reason when it is marked down."""
        return self.fleet.on_down

    @on_down.setter
    def on_down(self, hook: Callable[[str, str], None] | None) -> None:
        self.fleet.on_down = hook

    def mark_down(self, url: str, reason: str) -> None:
        """Out of routing now (its process exited): see :meth:`ReplicaSet.mark_down`."""
        self.fleet.mark_down(url, reason)

    def retire(self, url: str, reason: str) -> None:
        """Gone for good: see :meth:`ReplicaSet.retire`."""
        self.fleet.retire(url, reason)

    def eject(self, url: str) -> None:
        """Stop routing to ``url`` until ``readmit(url)`` (it holds stale weights)."""
        self.fleet.eject(url)

    def readmit(self, url: str) -> None:
        """Route to ``url`` again (the pusher confirmed it holds the newest weights)."""
        self.fleet.readmit(url)

    def states(self) -> dict[str, str]:
        return self.fleet.states()

    # ---- lifecycle -------------------------------------------------------- #

    async def start(self) -> None:
        await self.fleet.start()

    async def close(self) -> None:
        self._closed = True
        await self.fleet.close()

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
                # (``ReplicaSet._mark_down``), and that must end this attempt, not this request.
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
                self.fleet.succeeded(r, time.monotonic() - t_attempt)
                with self.fleet.lock:
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
        adapter = self.adapters.get(r.url)
        if adapter and self.backend.adapter is not None:  # per attempt: a retry names its new replica's adapter
            body = self.backend.adapter(body, adapter)
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s)
        try:
            async with r.session.post(r.url + self.backend.path, json=body, timeout=timeout) as resp:
                raw = await resp.read()
                status = resp.status
        except asyncio.TimeoutError:  # before ClientError: aiohttp's timeouts are both
            raise _ReplicaFailure("timeout", f"no reply within {cfg.request_timeout_s}s") from None
        except aiohttp.ClientError as e:
            raise _ReplicaFailure("connection", typed_reason(e)) from None
        if status == 503:
            raise _Aborted(f"HTTP 503 (paused or overloaded): {raw[:200]!r}")
        if status in (400, 422):
            raise _Rejected(f"HTTP {status}: {raw[:300].decode(errors='replace')}")
        if status != 200:
            raise _ReplicaFailure("http", f"HTTP {status}: {raw[:300].decode(errors='replace')}")
        try:
            data = jsonfast.loads(raw)
        except ValueError:
            try:  # NaN / Infinity: not JSON, but what Python's encoder writes; orjson refuses them
                data = json.loads(raw)
            except ValueError:
                raise _ReplicaFailure("malformed", f"reply is not JSON: {raw[:100]!r}") from None
        try:
            out = self.backend.parse(data, n, r.url)
        except MalformedResponse as e:
            raise _ReplicaFailure("malformed", str(e)) from None
        except Exception as e:  # a parser tripping over hostile input is still a bad reply
            logger.exception("parser failed on a reply from %s", r.url)
            raise _ReplicaFailure("malformed", f"unparseable reply: {typed_reason(e)}") from None
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
        assert self.fleet.changed is not None, "InferencePool.start() was not awaited"
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
            event = self.fleet.changed
            if self.fleet.routable():
                await event.wait()  # all at max_connections: plain queueing
                continue
            if self.fleet.all_retired():
                raise NoHealthyReplica("every inference replica is gone for good: " + self.fleet.describe())
            if not counted:
                self.counters["waits"] += 1
                counted = True
            if wait_budget[0] <= 0:
                raise NoHealthyReplica(
                    f"no routable inference replica within {self.config.request_timeout_s}s: " + self.fleet.describe())
            t = time.monotonic()
            try:
                await asyncio.wait_for(event.wait(), wait_budget[0])
            except asyncio.TimeoutError:
                pass
            wait_budget[0] -= time.monotonic() - t

    def _release(self, r: Replica) -> None:
        r.outstanding -= 1
        if r.outstanding == 0 and r.busy_since is not None:
            with self.fleet.lock:
                r.busy_s += time.monotonic() - r.busy_since
                r.busy_since = None
        self.fleet.notify()

    # ---- outcomes --------------------------------------------------------- #

    def _failed(self, r: Replica, e: _ReplicaFailure, epoch: int) -> None:
        self.counters["failures"] += 1
        self.counters[{"timeout": "timeouts", "malformed": "malformed", "connection": "connection_errors",
                       "http": "http_errors", "down": "resent"}[e.kind]] += 1
        self.fleet.failed(r, f"{e.kind}: {e}", epoch)

    # ---- introspection (any thread) --------------------------------------- #

    def metrics(self) -> dict[str, float]:
        """Counters and states; ``pool/replica{i}_busy_frac`` is the share of the
        time since the previous call during which replica i had a request outstanding."""
        now = time.monotonic()
        with self.fleet.lock:
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
