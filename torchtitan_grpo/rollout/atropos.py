"""Atropos as the rollout source: environments generate, the trainer pulls.

`Atropos <https://github.com/NousResearch/atropos>`_ environments sample from
the inference servers themselves, score whole trajectories (multi-turn,
tool-using) and post *scored groups* to Atropos's trajectory API. This module
is the trainer's side of that API, on rank 0, behind the same interface as
:class:`~torchtitan_grpo.rollout.producer.RolloutProducer` (``start``,
``next_batch``, ``published``, ``state_dict``, ``close``, ``pool``):

* **registration**: ``POST /register`` with the batch size (in *sequences*,
  Atropos's unit), the longest sequence the trainer takes, the checkpoint
  folder and interval (environments save their own state there), the step to
  start from (a resumed run's) and the number of steps. Until a trainer has
  asked for a batch once, Atropos refuses environments' ``/register-env``.
* **pulling**: ``GET /batch`` until it holds data. ``{"batch": null}`` means
  not enough sequences yet: the poll backs off (``poll_min_s`` doubling to
  ``poll_max_s``) and ``waiting for Atropos: queue N`` (N groups queued, from
  ``/status``) is logged at most every ``log_every_s``; a wait longer than
  ``startup_timeout_s`` adds one line (again every as long) saying what the
  API knows: no environment registered, none posted yet, or groups short of
  a batch (``atropos_hints.py``). Atropos counts its
  step as batches handed out; environments read it from ``/status`` (and
  ``/status-env``) and bound their own off-policy lag with it.
* **prefetching** (``AtroposConfig.prefetch``, on by default): once a batch
  is handed to the trainer, a background thread polls ``/batch`` for the next
  one and converts it, so that the request (the API builds and encodes the
  batch), its JSON and the conversion overlap the trainer's step instead of
  adding to it. Atropos's step therefore counts a batch while the trainer
  still trains the previous one, as with a pipelined loop. The thread only
  polls: anything but data or ``{"batch": null}`` (an outage, an API that
  restarted) ends it, and the trainer's own pull handles that as it always
  does. Nothing is prefetched after the last step; a batch prefetched when
  the run stops is not trained (Atropos has already handed it out).
* **faults**: an API that does not answer (refused, reset, a request past
  ``request_timeout_s``, a 5xx) is retried with back-off and logged once per
  outage; once it answers again the trainer registers again (a restarted API
  forgets everything), with the step it has reached, so the environments'
  step does not go back. An API that answers ``/batch`` with "Trainer not
  registered" (it restarted between two polls) is re-registered at once;
  one that cannot register a trainer (atroposlib 0.4 sets a registration up
  only while it holds no queue, and an environment that posted to it first
  created one) is reset with ``/reset_data`` (those groups are lost) and
  registered again.
  A ``/batch`` that answers 500 is not an outage: atroposlib lost that
  batch (it could not encode it, most likely a NaN or inf score); one line
  says so each time (``atropos/lost_batches``) and the pull goes on.
  Unreachable at start for ``startup_timeout_s``, or mid-run for
  ``unreachable_timeout_s``: :class:`ProducerStopped` naming
  ``rollout.atropos_url``, which ends the run cleanly at a step boundary.
* **conversion** and **malformed groups**: ``atropos_groups.py``
  (:func:`convert_groups`, vectorised over a batch's sequences; a malformed
  group is dropped and counted in ``atropos/dropped_<kind>``, never fatal;
  ``atropos_batch.py`` makes a batch of them). A batch with no sample left
  (every group dropped, or filtered as constant) is not handed to the
  trainer: one line says how many groups and why, and the next batch is
  pulled (``atropos/skipped_batches``; Atropos counted it as a step).
Mixed group sizes and groups larger than a batch are Atropos's to handle (it
packs groups into batches of exactly ``batch_size`` sequences and buffers an
environment's off-size groups until they sum to its group size); every group
that arrives is converted as it is. Only HTTP and JSON are used here:
``atroposlib`` is needed by the API server and the environments, not by the
trainer.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from torchtitan_grpo.rollout import atropos_hints
from torchtitan_grpo.rollout.atropos_batch import BatchConverter
from torchtitan_grpo.rollout.atropos_groups import MALFORMED_KINDS
from torchtitan_grpo.rollout.producer import ProducerStopped, RolloutBatch

logger = logging.getLogger("torchtitan_grpo")

@dataclass
class AtroposConfig:
    url: str
    """Atropos API base URL (``rollout.atropos_url``)."""
    batch_size: int
    """Sequences per trainer step (Atropos's unit): ``prompts_per_step * group_size``."""
    max_token_len: int
    """Longest sequence the trainer takes (``training.seq_len``); environments drop longer groups."""
    num_steps: int
    """``training.steps``."""
    checkpoint_dir: str = ""
    """Where environments save their state (``env_checkpoints/`` under it)."""
    checkpoint_interval: int = -1
    """Trainer checkpoint interval in steps (-1: none)."""
    wandb_project: str = "torchtitan-grpo"
    wandb_group: str = ""
    startup_timeout_s: float = 60.0
    """At start: the API must answer ``/register`` within this, or the run stops naming the URL.
    Also, once a wait for a batch (the API answering) lasts this long: one line
    saying what the API knows of environments, again every as long; the
    trainer keeps waiting."""
    unreachable_timeout_s: float = 600.0
    """Mid-run: stop after the API has not answered for this long (0: retry for ever)."""
    request_timeout_s: float = 10.0
    """One HTTP request; a stalled API counts as unreachable after it (and a
    stop request waits at most this long for the request in flight)."""
    poll_min_s: float = 0.05
    poll_max_s: float = 2.0
    log_every_s: float = 5.0
    prefetch: bool = True
    """Pull and convert the next batch on a background thread as soon as one
    is handed to the trainer (not after the last step), so that the ``/batch``
    request, its JSON and the conversion overlap the trainer's step. The
    prefetch only polls ``/batch``: an outage, an unknown trainer or a reset is
    left to the trainer's own pull, which logs, retries and registers as
    without it."""


class _Unreachable(Exception):
    """The API did not answer (or answered a 5xx / not JSON)."""


class _LostBatch(_Unreachable):
    """``/batch`` answered 500: atroposlib took a batch off its queue and failed to encode it."""


class _NoPool:
    """What ``RolloutSide.summary()`` reads of a source's pool when none is given."""

    events: list = []

    def metrics(self) -> dict[str, float]:
        return {}


@dataclass
class _Pulled:
    """One batch from ``/batch``, converted (by the trainer's thread or the prefetch thread)."""

    batch: RolloutBatch
    """Its ``indices`` count from the batch's first group (offset at hand-out)."""
    num_groups: int
    pull_s: float
    """The ``/batch`` request that brought the data."""
    polls: int
    request_t: float
    """``time.monotonic()`` when that request was sent."""
    convert_s: float
    ready_t: float
    """``time.monotonic()`` when the conversion ended."""
    first_drop: str = ""
    """The first dropped group's kind and reason ("" if none was dropped)."""


class _Prefetch:
    """The background pull of the next batch: ``result`` (None: nothing, the
    trainer's own pull takes over) or ``error`` once ``done`` is set."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.asked = threading.Event()
        """Set when the trainer waits for this batch (or the source closes): poll at once and often."""
        self.result: _Pulled | None = None
        self.error: BaseException | None = None


class AtroposSource:
    """``start``, ``next_batch``, ``published``, ``state_dict``, ``close`` from
    the trainer's thread (rank 0), like :class:`RolloutProducer`; the HTTP
    calls run in ``next_batch`` (a poll sleeps at most ``poll_max_s`` and
    returns None soon after ``stop`` is set) and, with ``cfg.prefetch``, on a
    background thread that pulls the next batch while the trainer trains.

    ``pool``: the inference pool the trainer pushes to (its replica events go
    into the run's summary); environments sample from those servers directly.
    ``starting_step``: the trainer step a resumed run starts after.
    """

    def __init__(self, cfg: AtroposConfig, *, scale_rewards: bool = True, filter_constant_groups: bool = False,
                 temperature: float = 1.0, vocab_size: int = 0, allow_missing_logprobs: bool = False,
                 starting_step: int = 0, pool=None):
        if cfg.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {cfg.batch_size}")
        self.cfg = cfg
        self.url = cfg.url.rstrip("/")
        self.scale_rewards = scale_rewards
        self.filter_constant_groups = filter_constant_groups
        self.temperature = temperature
        self.vocab_size = vocab_size
        self.allow_missing_logprobs = allow_missing_logprobs
        self.pool = pool if pool is not None else _NoPool()
        self.step = starting_step
        """Batches handed to the trainer over the run (resumes included): the step Atropos shows."""
        self._registered = False
        self._ever_registered = False
        self._started = False
        self._closed = threading.Event()
        self._version = 0
        self._groups_seen = 0
        self._last_take = time.monotonic()
        self._convert = BatchConverter(scale_rewards=scale_rewards, filter_constant_groups=filter_constant_groups,
                                       max_len=cfg.max_token_len, vocab_size=vocab_size,
                                       allow_missing_logprobs=allow_missing_logprobs, temperature=temperature)
        self.reregistrations = 0
        self.dropped = dict.fromkeys(MALFORMED_KINDS, 0)
        """Groups dropped over the run, per kind."""
        self.lost_batches = 0
        """``/batch`` answers of HTTP 500 (batches atroposlib lost)."""
        self.skipped_batches = 0
        """Batches with no sample left (every group dropped or filtered): counted in ``step``, never trained."""
        self._wait_t0 = self._last_hint = 0.0
        self._prefetch: _Prefetch | None = None

    # ---------------------------------------------------------------- trainer side

    def start(self, version: int) -> None:
        """Registration happens in the first ``next_batch`` (it can wait on the API, and honours ``stop``)."""
        self._version = version
        self._started = True
        self._last_take = time.monotonic()

    def next_batch(self, stop: threading.Event | None = None) -> RolloutBatch | None:
        """The next batch Atropos hands out, converted; None once ``stop`` is set."""
        if not self._started:
            raise RuntimeError("AtroposSource.start() was not called")
        t0 = self._wait_t0 = self._last_hint = time.monotonic()
        while True:
            pulled = self._next_pulled(stop, t0)
            if pulled is None:
                return None
            if pulled.batch.samples:
                break
            self._skip(pulled)  # nothing to train: a step with no sample would be a NaN loss and a new version
        batch = self._hand_out(pulled, t0)
        trained = self.step - self.skipped_batches
        if self.cfg.prefetch and trained < self.cfg.num_steps and not self._closed.is_set():
            self._prefetch = _Prefetch()
            threading.Thread(target=self._prefetch_run, args=(self._prefetch,), name="atropos-prefetch",
                             daemon=True).start()
        return batch

    def _next_pulled(self, stop: threading.Event | None, t0: float) -> _Pulled | None:
        """The prefetched batch, else one pulled now; None on ``stop``."""
        pf = self._prefetch
        if pf is not None:
            if not self._wait_prefetch(pf, stop, t0):
                return None  # the prefetch goes on; the next call takes its batch
            self._prefetch = None
            if pf.error is not None:
                raise pf.error
            if pf.result is not None:
                return pf.result
            # None: it left an outage or a re-registration to the pull below
        return self._pull_and_convert(stop)

    def _count(self, pulled: _Pulled) -> None:
        """A batch Atropos handed out: its groups and drops count, and Atropos's step moved."""
        self._groups_seen += pulled.num_groups
        for kind in MALFORMED_KINDS:
            self.dropped[kind] += int(pulled.batch.metrics[f"atropos/dropped_{kind}"])
        self.step += 1

    def _skip(self, pulled: _Pulled) -> None:
        self._count(pulled)
        self.skipped_batches += 1
        m = pulled.batch.metrics
        dropped = {kind: int(m[f"atropos/dropped_{kind}"]) for kind in MALFORMED_KINDS}
        logger.warning(atropos_hints.skipped_batch(pulled.num_groups, dropped, int(m["rollout/constant_groups"]),
                                                   pulled.first_drop))

    def _hand_out(self, pulled: _Pulled, t0: float) -> RolloutBatch:
        now = time.monotonic()
        batch = pulled.batch
        batch.indices = [self._groups_seen + k for k in batch.indices]
        self._count(pulled)
        since, self._last_take = self._last_take, now
        batch.metrics |= {
            "time/wait_s": now - t0,
            "time/generate_s": now - since,
            "atropos/pull_s": pulled.pull_s,  # the /batch request that brought the data
            "atropos/polls": float(pulled.polls),
            "atropos/convert_s": pulled.convert_s,
            # what of that request and the conversion the trainer waited through (0: done before it asked)
            "atropos/exposed_s": max(0.0, min(now, pulled.ready_t) - max(pulled.request_t, t0)),
            "atropos/prefetched": float(pulled.request_t < t0),
            "atropos/step": float(self.step),
            "atropos/reregistrations": float(self.reregistrations),
            "atropos/lost_batches": float(self.lost_batches),
            "atropos/skipped_batches": float(self.skipped_batches),
        }
        tokens = batch.metrics.pop("_trained_tokens")
        batch.metrics["rollout/tokens_per_s"] = tokens / (now - since) if now > since else 0.0
        return batch

    def _pull_and_convert(self, stop: threading.Event | None) -> _Pulled | None:
        pulled = self._pull(stop)
        return None if pulled is None else self._converted(*pulled)

    def _converted(self, groups: list[dict], pull_s: float, polls: int, request_t: float) -> _Pulled:
        t1 = time.monotonic()
        batch, first_drop = self._convert(groups)
        ready = time.monotonic()
        return _Pulled(batch, len(groups), pull_s, polls, request_t, ready - t1, ready, first_drop)

    def _wait_prefetch(self, pf: _Prefetch, stop: threading.Event | None, t0: float) -> bool:
        """Wait for the prefetch thread; False on ``stop``."""
        pf.asked.set()
        last_log = t0
        while not pf.done.wait(0.02):
            if stop is not None and stop.is_set():
                return False
            if self._closed.is_set():
                raise ProducerStopped("Atropos source closed")
            last_log = self._log_waiting(last_log)
        return True

    def _log_waiting(self, last_log: float) -> float:
        """The "waiting for Atropos" line every ``log_every_s`` and, once this
        wait passes ``startup_timeout_s`` (and every as long after), why no
        batch comes; returns when the waiting line was last logged."""
        now = time.monotonic()
        if now - last_log >= self.cfg.log_every_s:
            last_log = now
            logger.info("waiting for Atropos: queue %s", self._queue_size())
        hint_s = self.cfg.startup_timeout_s
        if now - self._last_hint >= hint_s and now - self._wait_t0 >= hint_s:
            self._last_hint = now
            logger.warning(atropos_hints.idle_hint(self._request_or_none, self.url, self.cfg.batch_size,
                                                   now - self._wait_t0))
        return last_log

    def _prefetch_run(self, pf: _Prefetch) -> None:
        try:
            pulled = self._prefetch_pull(pf)
            if pulled is not None:
                pf.result = self._converted(*pulled)
        except BaseException as e:  # noqa: BLE001  (raised in the trainer's thread)
            pf.error = e
        finally:
            pf.done.set()

    def _prefetch_pull(self, pf: _Prefetch) -> tuple[list[dict], float, int, float] | None:
        """``/batch`` until it holds data, backing off like :meth:`_pull`; None
        when the API does not answer as a registered trainer expects (the
        trainer's own pull deals with it) or the source closes."""
        poll = self.cfg.poll_min_s
        polls = 0
        hurried = False
        while not self._closed.is_set():
            r0 = time.monotonic()
            try:
                reply = self._request("GET", "/batch")
            except _LostBatch:
                self._lost_batch()
                self._closed.wait(poll)
                continue
            except (_Unreachable, ProducerStopped):
                return None
            polls += 1
            request_s = time.monotonic() - r0
            if not isinstance(reply, dict) or reply.get("status") == "error":
                return None
            groups = reply.get("batch")
            if groups:
                return self._check_groups(groups), request_s, polls, r0
            if not hurried and pf.asked.wait(poll):
                hurried = True  # the trainer waits from now on: poll at once, then back off from the start
                poll = self.cfg.poll_min_s
                continue
            if hurried:
                self._closed.wait(poll)
            poll = min(poll * 2, self.cfg.poll_max_s)
        return None

    def _check_groups(self, groups: Any) -> list[dict]:
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise ProducerStopped(f"Atropos API at {self.url}: /batch holds {type(groups).__name__}, "
                                  "not a list of groups")
        return groups

    def published(self, version: int) -> None:
        self._version = version

    def state_dict(self) -> dict:
        """What a checkpoint records: the step Atropos is told on (re-)registration."""
        return {"source": "atropos", "step": self.step, "groups": self._groups_seen}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint of this source sets the step; one of the built-in source is ignored
        (``starting_step`` stands)."""
        if state.get("source") == "atropos":
            self.step = int(state["step"])
            self._groups_seen = int(state.get("groups", 0))

    def close(self) -> None:
        self._closed.set()
        if self._prefetch is not None:
            self._prefetch.asked.set()  # wakes its back-off; it sees the close and ends

    # ---------------------------------------------------------------- HTTP

    def _request(self, method: str, path: str, body: dict | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.request_timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            if e.code == 500 and path == "/batch":
                raise _LostBatch(f"HTTP 500 from {path}") from None
            if e.code >= 500:
                raise _Unreachable(f"HTTP {e.code} from {path}") from None
            detail = e.read()[:300].decode(errors="replace")
            raise ProducerStopped(f"Atropos API at {self.url} (rollout.atropos_url) refused {method} {path}: "
                                  f"HTTP {e.code} {detail}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", e)
            raise _Unreachable(f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise _Unreachable(f"{path} answered something that is not JSON: {raw[:80]!r}") from None

    def _register(self) -> None:
        c = self.cfg
        self._request("POST", "/register", {
            "wandb_group": c.wandb_group, "wandb_project": c.wandb_project,
            "batch_size": c.batch_size, "max_token_len": c.max_token_len,
            "checkpoint_dir": c.checkpoint_dir, "save_checkpoint_interval": c.checkpoint_interval,
            "starting_step": self.step, "num_steps": c.num_steps,
        })
        if self._ever_registered:
            self.reregistrations += 1
            logger.warning("re-registered with Atropos at %s (step %d)", self.url, self.step)
        else:
            logger.info("registered with Atropos at %s: %d sequences per step, max %d tokens, from step %d of %d",
                        self.url, c.batch_size, c.max_token_len, self.step, c.num_steps)
        self._registered = self._ever_registered = True

    def _sleep(self, seconds: float, stop: threading.Event | None) -> bool:
        """Sleep; False as soon as ``stop`` is set or the source is closed."""
        end = time.monotonic() + seconds
        while True:
            if (stop is not None and stop.is_set()) or self._closed.is_set():
                return False
            left = end - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(left, 0.05))

    def _pull(self, stop: threading.Event | None) -> tuple[list[dict], float, int, float] | None:
        """Groups of the next batch, the seconds its ``/batch`` request took,
        how many ``/batch`` requests it took and when that request was sent;
        None on ``stop``."""
        poll = self.cfg.poll_min_s
        down_since: float | None = None
        last_log = time.monotonic()
        polls = 0
        while True:
            if self._closed.is_set():
                raise ProducerStopped("Atropos source closed")
            if stop is not None and stop.is_set():
                return None
            registered_now = False
            try:
                if not self._registered:
                    self._register()
                    registered_now = True
                r0 = time.monotonic()
                reply = self._request("GET", "/batch")
                polls += 1
                request_s = time.monotonic() - r0
            except _LostBatch:
                self._lost_batch()  # the API answered: not an outage, and it still knows the trainer
                self._sleep(poll, stop)
                continue
            except _Unreachable as e:
                now = time.monotonic()
                if down_since is None:
                    down_since = now
                    what = "at start" if not self._ever_registered else "mid-run"
                    logger.warning("Atropos API at %s does not answer (%s, %s); retrying with back-off", self.url, e,
                                   what)
                self._registered = False  # a restarted API forgets the trainer: register again once it answers
                limit = self.cfg.startup_timeout_s if not self._ever_registered else self.cfg.unreachable_timeout_s
                if limit > 0 and now - down_since > limit:
                    raise ProducerStopped(f"Atropos API at {self.url} (rollout.atropos_url) did not answer for "
                                          f"{now - down_since:.0f}s: {e}") from None
                poll = min(max(poll * 2, 0.2), max(self.cfg.poll_max_s, 1.0))
                self._sleep(poll, stop)  # the loop's top sees a stop or a close
                continue
            if down_since is not None:
                logger.warning("Atropos API at %s answers again after %.1fs", self.url, time.monotonic() - down_since)
                down_since = None
            if not isinstance(reply, dict):
                raise ProducerStopped(f"Atropos API at {self.url} answered /batch with {str(reply)[:80]}")
            if reply.get("status") == "error":
                if registered_now:
                    # atroposlib 0.4 sets a trainer's registration up only while it has no
                    # queue, and an environment that posts to a fresh API (one restarted
                    # under it) creates one: no trainer can register until it is reset.
                    logger.warning("Atropos API at %s cannot register this trainer: it holds groups posted "
                                   "before any trainer registered; resetting it (/reset_data drops them)", self.url)
                    self._request_or_none("GET", "/reset_data")
                else:
                    # "Trainer not registered": the API restarted between two polls.
                    logger.warning("Atropos API at %s does not know this trainer (%s): it restarted; "
                                   "registering again", self.url, reply.get("message", ""))
                self._registered = False
                self._sleep(self.cfg.poll_min_s if not registered_now else poll, stop)
                continue
            groups = reply.get("batch")
            if groups:
                return self._check_groups(groups), request_s, polls, r0
            last_log = self._log_waiting(last_log)
            self._sleep(poll, stop)
            poll = min(poll * 2, self.cfg.poll_max_s)

    def _request_or_none(self, method: str, path: str, body: dict | None = None) -> Any:
        try:
            return self._request(method, path, body)
        except (_Unreachable, ProducerStopped):
            return None

    def _lost_batch(self) -> None:
        self.lost_batches += 1
        logger.warning(atropos_hints.LOST_BATCH, self.url, self.lost_batches)

    def _queue_size(self) -> str:
        status = self._request_or_none("GET", "/status")
        if not isinstance(status, dict):
            return "unknown (/status did not answer)"
        return (f"{status.get('queue_size', '?')} groups (step {status.get('current_step', '?')}; "
                f"a batch is {self.cfg.batch_size} sequences)")
