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
* **conversion** (:func:`convert_group`): each ``ScoredData`` group becomes
  one :class:`~torchtitan_grpo.trainer.Sample` per sequence. ``masks`` holds
  ``-100`` for tokens that are not trained (prompt, environment and tool
  tokens) and the token id for trained ones; a sequence becomes
  ``prompt_ids`` = the tokens before its first trained token and
  ``completion_ids`` = from there to its last trained token, with
  ``loss_mask`` marking the trained ones (None when all are).
  ``inference_logprobs`` (aligned with ``tokens``, 1.0 on masked positions)
  become the rollout logprobs of the off-policy correction. Advantages are
  group-relative from ``scores`` with our ``[grpo]`` settings, or the group's
  own ``advantages`` when it sends them (per token: a sequence gets the mean
  over its trained tokens); ``overrides[i]["set_advantage_to_zero"]`` zeroes
  a sequence. ``overrides`` may also carry ``finish_reason`` (``"length"``
  feeds ``grpo.mask_truncated``) and ``weight_versions`` (the versions that
  generated the sequence, for ``grpo.max_staleness``; without them a sample
  counts as ``offpolicy/unknown_version`` and is kept).
* **malformed groups** are dropped, never fatal: lengths of tokens / masks /
  logprobs / advantages that differ, no trained token in a sequence, a
  sequence longer than the trainer's context, a token id outside the
  vocabulary, a non-finite score or a positive log-prob, no rollout log-probs
  for trained tokens. The first group of each kind is logged with its
  reason; every one is counted in ``atropos/dropped_<kind>``.

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
import math
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import torch

from torchtitan_grpo.rollout.advantages import constant_group_mask, group_advantages
from torchtitan_grpo.rollout.producer import ProducerStopped, RolloutBatch
from torchtitan_grpo.trainer import Sample

logger = logging.getLogger("torchtitan_grpo")

MASKED = -100
"""Atropos's mask value of a token that is not trained."""
LOGPROB_PLACEHOLDER = 1.0
"""Atropos's ``inference_logprobs`` value on masked positions (no log-prob is 1.0)."""

MALFORMED_KINDS = ("shape", "all_masked", "too_long", "bad_value", "no_logprobs")
"""Why a group is dropped: lengths differ (or a group is empty), a sequence
with no trained token, a sequence longer than the context, a token id outside
the vocabulary / a non-finite score / a positive or non-finite log-prob, and
trained tokens without rollout log-probs."""


class Malformed(ValueError):
    """A group the trainer cannot train on; ``kind`` is one of :data:`MALFORMED_KINDS`."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


@dataclass
class ConvertedGroup:
    samples: list[Sample]
    """Empty when the group was filtered (``filter_constant_groups``)."""
    scores: list[float]
    constant: bool
    trained_tokens: int
    tokens: int
    """All tokens of the group's sequences (trained or not)."""
    truncated: int
    averaged_advantages: int = 0
    """Sequences whose per-token ``advantages`` differed over their trained tokens (their mean was used)."""
    temperatures: set[float] = field(default_factory=set)
    """Sampling temperatures the group says it used (``overrides`` / ``generation_params``)."""
    missing_logprob_tokens: int = 0
    """Trained tokens without a rollout log-prob (NaN; only with ``allow_missing_logprobs``)."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _per_sequence(group: dict, key: str, n: int) -> list | None:
    """``group[key]`` as one entry per sequence, or None when absent. BaseEnv
    sends ``[]`` for a field none of its items had: absent too."""
    value = group.get(key)
    if value is None or value == []:
        return None
    if not isinstance(value, list) or len(value) != n:
        size = len(value) if isinstance(value, list) else type(value).__name__
        raise Malformed("shape", f"'{key}' has {size} entries for {n} sequences")
    return value


def convert_group(group: dict, *, scale_rewards: bool = True, filter_constant_groups: bool = False,
                  max_len: int = 0, vocab_size: int = 0, allow_missing_logprobs: bool = False) -> ConvertedGroup:
    """One Atropos ``ScoredData`` group (a dict, as ``/batch`` returns it) as
    trainer samples; raises :class:`Malformed` for a group that cannot be
    trained (the whole group: its advantages are relative to every member).

    ``max_len``: longest sequence (tokens) the trainer takes (0: no limit);
    ``vocab_size``: token ids must be below it (0: unchecked);
    ``allow_missing_logprobs``: trained tokens without a rollout log-prob get
    NaN instead of dropping the group (the loss must then take the trainer's
    own log-prob there).
    """
    tokens, masks, scores = group.get("tokens"), group.get("masks"), group.get("scores")
    if not isinstance(tokens, list) or not tokens:
        raise Malformed("shape", "no sequences ('tokens' is empty or missing)")
    n = len(tokens)
    for key, value in (("masks", masks), ("scores", scores)):
        if not isinstance(value, list) or len(value) != n:
            size = len(value) if isinstance(value, list) else "no"
            raise Malformed("shape", f"'{key}' has {size} entries for {n} sequences")
    logprobs = _per_sequence(group, "inference_logprobs", n)
    advantages = _per_sequence(group, "advantages", n)
    overrides = group.get("overrides") or []
    if not isinstance(overrides, list):
        overrides = []
    group_overrides = group.get("group_overrides") or {}
    if not isinstance(group_overrides, dict):
        group_overrides = {}

    for i, s in enumerate(scores):
        if not _is_num(s) or not math.isfinite(s):
            raise Malformed("bad_value", f"score {i} is {s!r}")

    # Per sequence: where its trained span starts and ends, checked first so a
    # bad group costs no conversion work.
    spans = []
    for i in range(n):
        toks, m = tokens[i], masks[i]
        if not isinstance(toks, list) or not isinstance(m, list) or not toks:
            raise Malformed("shape", f"sequence {i}: 'tokens' and 'masks' must be non-empty lists")
        if len(m) != len(toks):
            raise Malformed("shape", f"sequence {i}: {len(toks)} tokens but {len(m)} mask entries")
        if logprobs is not None and (not isinstance(logprobs[i], list) or len(logprobs[i]) != len(toks)):
            size = len(logprobs[i]) if isinstance(logprobs[i], list) else type(logprobs[i]).__name__
            raise Malformed("shape", f"sequence {i}: {len(toks)} tokens but {size} inference_logprobs")
        if advantages is not None and (not isinstance(advantages[i], list)
                                       or len(advantages[i]) not in (1, len(toks))):
            size = len(advantages[i]) if isinstance(advantages[i], list) else type(advantages[i]).__name__
            raise Malformed("shape", f"sequence {i}: {len(toks)} tokens but {size} advantages")
        if max_len and len(toks) > max_len:
            raise Malformed("too_long", f"sequence {i} has {len(toks)} tokens; the trainer takes at most {max_len}")
        if not all(_is_int(t) and 0 <= t and (not vocab_size or t < vocab_size) for t in toks):
            bad = next(t for t in toks if not (_is_int(t) and 0 <= t and (not vocab_size or t < vocab_size)))
            raise Malformed("bad_value", f"sequence {i}: token id {bad!r} is outside the vocabulary"
                                         + (f" (size {vocab_size})" if vocab_size else ""))
        # Position 0 has no logit before it: it is never trained, whatever its mask.
        trained = [j for j in range(1, len(toks)) if m[j] != MASKED]
        if not trained:
            raise Malformed("all_masked", f"sequence {i} has no trained token (every mask after the first is -100)")
        spans.append((trained[0], trained[-1] + 1))

    rewards = torch.tensor([float(s) for s in scores], dtype=torch.float32).view(1, n)
    constant = bool(constant_group_mask(rewards)[0])
    group_adv = group_advantages(rewards, scale_by_std=scale_rewards)[0].tolist()

    out = ConvertedGroup([], [float(s) for s in scores], constant, 0, sum(len(t) for t in tokens), 0)
    gp = group.get("generation_params")
    if isinstance(gp, dict) and _is_num(gp.get("temperature")):
        out.temperatures.add(float(gp["temperature"]))
    samples = []
    for i in range(n):
        toks, m = tokens[i], masks[i]
        first, end = spans[i]
        ov = overrides[i] if i < len(overrides) and isinstance(overrides[i], dict) else {}
        loss_mask = [0.0 if m[j] == MASKED else 1.0 for j in range(first, end)]
        trained = int(sum(loss_mask))
        out.trained_tokens += trained

        rollout = [0.0] * (end - first)
        lp = logprobs[i] if logprobs is not None else None
        for k, j in enumerate(range(first, end)):
            if not loss_mask[k]:
                continue
            v = lp[j] if lp is not None else LOGPROB_PLACEHOLDER
            if not _is_num(v):
                raise Malformed("bad_value", f"sequence {i}: inference log-prob at token {j} is {v!r}")
            if v == LOGPROB_PLACEHOLDER:
                if not allow_missing_logprobs:
                    what = "sends no 'inference_logprobs'" if lp is None else f"has the placeholder 1.0 at trained token {j}"
                    raise Malformed("no_logprobs", f"sequence {i} {what}: no rollout log-prob for the off-policy correction")
                rollout[k] = math.nan
                out.missing_logprob_tokens += 1
                continue
            if not math.isfinite(v) or v > 1e-3:  # engines round: a hair above 0 is 0
                raise Malformed("bad_value", f"sequence {i}: inference log-prob {v!r} at token {j}")
            rollout[k] = min(float(v), 0.0)

        if advantages is not None:
            a = advantages[i]
            vals = [a[0]] if len(a) == 1 else [a[j] for j in range(first, end) if m[j] != MASKED]
            if not all(_is_num(v) and math.isfinite(v) for v in vals):
                raise Malformed("bad_value", f"sequence {i}: non-finite or non-numeric advantage")
            adv = sum(vals) / len(vals)
            if max(vals) - min(vals) > 1e-6:
                out.averaged_advantages += 1
        else:
            adv = group_adv[i]
        if ov.get("set_advantage_to_zero"):
            adv = 0.0
        if _is_num(ov.get("temperature")):
            out.temperatures.add(float(ov["temperature"]))
        finish = ov.get("finish_reason") or group_overrides.get("finish_reason") or "stop"
        finish = finish.get("type", "stop") if isinstance(finish, dict) else str(finish)
        out.truncated += finish == "length"
        versions = ov.get("weight_versions", group_overrides.get("weight_versions")) or []
        versions = [str(v) for v in versions] if isinstance(versions, list) else [str(versions)]
        samples.append(Sample(list(toks[:first]), list(toks[first:end]), rollout, float(adv), float(scores[i]),
                              finish, versions, None if trained == end - first else loss_mask))
    if not (filter_constant_groups and constant and advantages is None):
        out.samples = samples
    return out


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


class _Unreachable(Exception):
    """The API did not answer (or answered a 5xx / not JSON)."""


class _NoPool:
    """What ``RolloutSide.summary()`` reads of a source's pool when none is given."""

    events: list = []

    def metrics(self) -> dict[str, float]:
        return {}


class AtroposSource:
    """``start``, ``next_batch``, ``published``, ``state_dict``, ``close`` from
    the trainer's thread (rank 0), like :class:`RolloutProducer`; the HTTP
    calls run in ``next_batch`` (a poll sleeps at most ``poll_max_s`` and
    returns None soon after ``stop`` is set).

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
        pulled = self._pull(stop)
        if pulled is None:
            return None
        groups, pull_s, polls = pulled
        t1 = time.monotonic()
        batch = self._convert(groups)
        now = time.monotonic()
        self.step += 1
        since, self._last_take = self._last_take, now
        batch.metrics |= {
            "time/wait_s": now - t0,
            "time/generate_s": now - since,
            "atropos/pull_s": pull_s,  # the /batch request that brought the data
            "atropos/polls": float(polls),
            "atropos/convert_s": now - t1,
            "atropos/step": float(self.step),
            "atropos/reregistrations": float(self.reregistrations),
        }
        tokens = batch.metrics.pop("_trained_tokens")
        batch.metrics["rollout/tokens_per_s"] = tokens / (now - since) if now > since else 0.0
        return batch

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

    def _pull(self, stop: threading.Event | None) -> tuple[list[dict], float, int] | None:
        """Groups of the next batch, the seconds its ``/batch`` request took and
        how many ``/batch`` requests it took; None on ``stop``."""
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
                if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
                    raise ProducerStopped(f"Atropos API at {self.url}: /batch holds {type(groups).__name__}, "
                                          "not a list of groups")
                return groups, request_s, polls
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
        samples: list[Sample] = []
        indices: list[int] = []
        converted: list[ConvertedGroup] = []
        dropped = dict.fromkeys(MALFORMED_KINDS, 0)
        for g in groups:
            index = self._groups_seen
            self._groups_seen += 1
            try:
                c = convert_group(g, scale_rewards=self.scale_rewards,
                                  filter_constant_groups=self.filter_constant_groups,
                                  max_len=self.cfg.max_token_len, vocab_size=self.vocab_size,
                                  allow_missing_logprobs=self.allow_missing_logprobs)
            except Malformed as e:
                dropped[e.kind] += 1
                self.dropped[e.kind] += 1
                if e.kind not in self._logged_kinds:
                    self._logged_kinds.add(e.kind)
                    logger.warning("dropped an Atropos group (env %s): %s [%s; further ones are counted in "
                                   "atropos/dropped_%s]", g.get("env_id"), e, e.kind, e.kind)
                continue
            converted.append(c)
            samples.extend(c.samples)
            indices.append(index)
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
