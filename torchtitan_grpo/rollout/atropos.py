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
  ``/status``) is logged at most every ``log_every_s``. Atropos counts its
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
  Unreachable at start for ``startup_timeout_s``, or mid-run for
  ``unreachable_timeout_s``: :class:`ProducerStopped` naming
  ``rollout.atropos_url``, which ends the run cleanly at a step boundary.
* **conversion** and **malformed groups**: ``atropos_groups.py``
  (:func:`convert_groups`, vectorised over a batch's sequences; a malformed
  group is dropped and counted in ``atropos/dropped_<kind>``, never fatal).
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

import torch

from torchtitan_grpo.rollout.atropos_groups import MALFORMED_KINDS, ConvertedGroup, Malformed, convert_groups
from torchtitan_grpo.rollout.producer import ProducerStopped, RolloutBatch
from torchtitan_grpo.rollout.sample import Sample

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
    """At start: the API must answer ``/register`` within this, or the run stops naming the URL."""
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
        self._logged_kinds: set[str] = set()
        self._logged_once: set[str] = set()
        self.reregistrations = 0
        self.dropped = dict.fromkeys(MALFORMED_KINDS, 0)
        """Groups dropped over the run, per kind."""
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
        t0 = time.monotonic()
        pulled = None
        pf = self._prefetch
        if pf is not None:
            if not self._wait_prefetch(pf, stop, t0):
                return None  # the prefetch goes on; the next call takes its batch
            self._prefetch = None
            if pf.error is not None:
                raise pf.error
            pulled = pf.result  # None: it left an outage or a re-registration to the pull below
        if pulled is None:
            pulled = self._pull_and_convert(stop)
            if pulled is None:
                return None
        batch = self._hand_out(pulled, t0)
        if self.cfg.prefetch and self.step < self.cfg.num_steps and not self._closed.is_set():
            self._prefetch = _Prefetch()
            threading.Thread(target=self._prefetch_run, args=(self._prefetch,), name="atropos-prefetch",
                             daemon=True).start()
        return batch

    def _hand_out(self, pulled: _Pulled, t0: float) -> RolloutBatch:
        now = time.monotonic()
        batch = pulled.batch
        batch.indices = [self._groups_seen + k for k in batch.indices]
        self._groups_seen += pulled.num_groups
        for kind in MALFORMED_KINDS:
            self.dropped[kind] += int(batch.metrics[f"atropos/dropped_{kind}"])
        self.step += 1
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
        }
        tokens = batch.metrics.pop("_trained_tokens")
        batch.metrics["rollout/tokens_per_s"] = tokens / (now - since) if now > since else 0.0
        return batch

    def _pull_and_convert(self, stop: threading.Event | None) -> _Pulled | None:
        pulled = self._pull(stop)
        if pulled is None:
            return None
        groups, pull_s, polls, request_t = pulled
        t1 = time.monotonic()
        batch = self._convert(groups)
        ready = time.monotonic()
        return _Pulled(batch, len(groups), pull_s, polls, request_t, ready - t1, ready)

    def _wait_prefetch(self, pf: _Prefetch, stop: threading.Event | None, t0: float) -> bool:
        """Wait for the prefetch thread; False on ``stop``."""
        pf.asked.set()
        last_log = t0
        while not pf.done.wait(0.02):
            if stop is not None and stop.is_set():
                return False
            if self._closed.is_set():
                raise ProducerStopped("Atropos source closed")
            now = time.monotonic()
            if now - last_log >= self.cfg.log_every_s:
                last_log = now
                logger.info("waiting for Atropos: queue %s", self._queue_size())
        return True

    def _prefetch_run(self, pf: _Prefetch) -> None:
        try:
            pulled = self._prefetch_pull(pf)
            if pulled is not None:
                groups, pull_s, polls, request_t = pulled
                t1 = time.monotonic()
                batch = self._convert(groups)
                ready = time.monotonic()
                pf.result = _Pulled(batch, len(groups), pull_s, polls, request_t, ready - t1, ready)
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
            now = time.monotonic()
            if now - last_log >= self.cfg.log_every_s:
                last_log = now
                logger.info("waiting for Atropos: queue %s", self._queue_size())
            self._sleep(poll, stop)
            poll = min(poll * 2, self.cfg.poll_max_s)

    def _request_or_none(self, method: str, path: str) -> Any:
        try:
            return self._request(method, path)
        except (_Unreachable, ProducerStopped):
            return None

    def _queue_size(self) -> str:
        status = self._request_or_none("GET", "/status")
        if not isinstance(status, dict):
            return "unknown (/status did not answer)"
        return (f"{status.get('queue_size', '?')} groups (step {status.get('current_step', '?')}; "
                f"a batch is {self.cfg.batch_size} sequences)")

    # ---------------------------------------------------------------- conversion

    def _once(self, key: str, msg: str, *args) -> None:
        if key not in self._logged_once:
            self._logged_once.add(key)
            logger.warning(msg, *args)

    def _convert(self, groups: list[dict]) -> RolloutBatch:
        """The batch's samples and metrics; ``indices`` count from its first
        group (dropped ones included). Counters of the run are updated at hand-out."""
        samples: list[Sample] = []
        indices: list[int] = []
        converted: list[ConvertedGroup] = []
        dropped = dict.fromkeys(MALFORMED_KINDS, 0)
        results = convert_groups(groups, scale_rewards=self.scale_rewards,
                                 filter_constant_groups=self.filter_constant_groups, max_len=self.cfg.max_token_len,
                                 vocab_size=self.vocab_size, allow_missing_logprobs=self.allow_missing_logprobs)
        for k, (g, c) in enumerate(zip(groups, results)):
            if isinstance(c, Malformed):
                dropped[c.kind] += 1
                if c.kind not in self._logged_kinds:
                    self._logged_kinds.add(c.kind)
                    logger.warning("dropped an Atropos group (env %s): %s [%s; further ones are counted in "
                                   "atropos/dropped_%s]", g.get("env_id"), c, c.kind, c.kind)
                continue
            converted.append(c)
            samples.extend(c.samples)
            indices.append(k)
        averaged = sum(c.averaged_advantages for c in converted)
        if averaged:
            self._once("adv", "Atropos groups send per-token advantages that vary within a sequence: the trainer "
                              "takes one advantage per sequence (their mean over its trained tokens)")
        temps = {t for c in converted for t in c.temperatures if abs(t - self.temperature) > 1e-6}
        if temps:
            self._once("temp", "Atropos groups were sampled at temperature %s, the trainer's log-probs use "
                               "rollout.temperature = %s", sorted(temps), self.temperature)
        rewards = torch.tensor([s for c in converted for s in c.scores], dtype=torch.float32)
        n = max(rewards.numel(), 1)
        trained = sum(c.trained_tokens for c in converted)
        m = {
            "reward/mean": float(rewards.mean()) if rewards.numel() else 0.0,
            "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "rollout/constant_groups": float(sum(c.constant for c in converted)),
            "rollout/completion_len": trained / n,
            "rollout/sequence_len": sum(c.tokens for c in converted) / n,
            "rollout/truncated_frac": sum(c.truncated for c in converted) / n,
            "rollout/tokens": float(trained),
            "atropos/groups": float(len(groups)),
            "atropos/dropped_groups": float(sum(dropped.values())),
            "atropos/averaged_advantages": float(averaged),
            "atropos/missing_logprob_tokens": float(sum(c.missing_logprob_tokens for c in converted)),
            "_trained_tokens": float(trained),
        }
        m |= {f"atropos/dropped_{k}": float(v) for k, v in dropped.items()}
        return RolloutBatch(samples, m, indices)
