"""RolloutProducer: keeps the inference fleet generating while the trainer trains.

Runs on rank 0, on the event loop of ``aio.LoopThread``. It submits one
request per prompt (the whole group, ``n = group_size``, from one replica),
scores each group as it finishes, and appends it to a buffer. A trainer step
takes the first ``prompts_per_step`` groups that finished: a slow replica or a
long-tail group delays only itself, never a step.

Admission (how far ahead the fleet may run). A group admitted now, with ``Q``
groups ahead of it (in flight or buffered, not yet taken), goes to the trainer
``Q // prompts_per_step`` steps after the next one; if the trainer is in the
middle of a step, one more. That is how many versions older than the
trainer's its weights will be at best, its *expected staleness*; a group is
started only while that is at most ``depth``:

* ``depth = 0``: a step's groups start when the previous step's weights are
  published (the serial loop: exactly on-policy with a synchronous push);
* ``depth = 1``: the next step's groups generate while this one trains
  (one step off-policy), and so on.

``depth`` is ``rollout.pipeline_depth`` capped by ``grpo.max_staleness``, so in
steady state nothing generated is thrown away for staleness; samples that are
staler still (a replica catching up on weights) are dropped by the trainer's
``offpolicy.select_samples`` and counted.

Dynamic sampling (``grpo.dynamic_sampling``, ``dynamic_sampling.py``): a
group whose rewards are all equal is discarded instead of buffered, like a
skipped long prompt: handed in the ledger, its slot freed for another prompt.

Failures: the pool retries a group on another replica (and re-sends groups
in flight on a replica it learns is down). A group that fails for good stops
the run: ``next_batch`` raises its error in the trainer's thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from torchtitan_grpo.aio import LoopThread
from torchtitan_grpo.fleet.pool import InferencePool
from torchtitan_grpo.fleet.types import SamplingParams
from torchtitan_grpo.rollout.dynamic_sampling import DynamicSampler
from torchtitan_grpo.rollout.groups import GroupScorer, ScoredGroup, batch_metrics
from torchtitan_grpo.rollout.ledger import PromptLedger
from torchtitan_grpo.rollout.prompt_budget import check_budgets, fit_budget, group_budget
from torchtitan_grpo.train.sample import Sample

logger = logging.getLogger("torchtitan_grpo")


@dataclass
class RolloutBatch:
    samples: list[Sample]
    metrics: dict[str, float]
    indices: list[int]
    """Prompt indices of the batch's groups (the ledger's)."""


class ProducerStopped(RuntimeError):
    """The producer failed (a group could not be generated) or was closed."""


class RolloutProducer:
    """``next_batch()`` and ``published()`` from the trainer's thread; the rest
    runs on ``loop``."""

    def __init__(self, loop: LoopThread, pool: InferencePool, ledger: PromptLedger, scorer: GroupScorer, *,
                 prompts_per_step: int, depth: int, sampling: SamplingParams, seed: int = 0,
                 seeded_requests: bool = True, max_sequence_tokens: int = 0, dynamic_sampling: bool = False,
                 dynamic_sampling_max_filtered: int = 0,
                 on_group: Callable[[ScoredGroup], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None):
        """``max_sequence_tokens``: prompt plus completion at most this (0: no
        limit; ``prompt_budget.fit_budget``). ``dynamic_sampling``: groups with
        equal rewards never enter the buffer (``rollout/dynamic_sampling.py``,
        guarded by ``dynamic_sampling_max_filtered``). ``on_group`` (on the loop's
        thread, in buffer order) and ``on_error`` let a rollout client process
        mirror the buffer in the trainer's process (``client_process.py``)."""
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self.loop, self.pool, self.ledger, self.scorer = loop, pool, ledger, scorer
        self.prompts_per_step = prompts_per_step
        self.depth = depth
        self.sampling = sampling
        self.seed = seed
        self.seeded_requests = seeded_requests
        self.max_sequence_tokens = max_sequence_tokens
        self.on_group, self.on_error = on_group, on_error
        # prompts too long for max_sequence_tokens: since the last take, one after another; the first one logged
        self._skipped = self._skipped_in_a_row = 0
        self._warned_long_prompt = False
        self._sampler = (DynamicSampler(dynamic_sampling_max_filtered, prompts_per_step)
                         if dynamic_sampling else None)
        self._cond = threading.Condition()
        self._buffer: deque[ScoredGroup] = deque()  # finished, in finishing order
        self._in_flight = 0
        self._training = False  # the trainer took a batch and has not published its weights
        self._version = 0  # trainer version last published
        self._error: BaseException | None = None
        self._logged: set[tuple[str, str]] = set()  # failures logged (type, message)
        self._closed = False
        self._wake: asyncio.Event | None = None
        self._task = None
        self._tasks: set[asyncio.Task] = set()
        self._last_take = time.monotonic()

    # ---------------------------------------------------------------- trainer side

    def start(self, version: int) -> None:
        """Start generating for trainer weights ``version`` (after any resume push)."""
        self._version = version
        self._task = self.loop.submit(self._admit_loop())

    def next_batch(self, stop: threading.Event | None = None) -> RolloutBatch | None:
        """The first ``prompts_per_step`` finished groups; waits until there are
        that many, or returns None once ``stop`` is set (a signal to stop the run)."""
        if self._task is None:
            raise RuntimeError("RolloutProducer.start() was not called")
        t0 = time.monotonic()
        with self._cond:
            while len(self._buffer) < self.prompts_per_step and self._error is None and not self._closed:
                if stop is not None and stop.is_set():
                    return None
                self._cond.wait(timeout=0.2)
            if self._error is not None:
                raise ProducerStopped(f"rollout generation failed: {self._error}") from self._error
            if self._closed:
                raise ProducerStopped("rollout producer closed")
        groups, metrics = self.take(self.prompts_per_step, time.monotonic() - t0)
        return RolloutBatch([s for g in groups for s in g.samples], metrics, [g.index for g in groups])

    def take(self, n: int, wait_s: float) -> tuple[list[ScoredGroup], dict[str, float]]:
        """Hand the first ``n`` finished groups (they must be buffered) to the
        trainer, which waited ``wait_s`` for them: the ledger records them, the
        next groups may be admitted. Returns them and the step's rollout metrics."""
        with self._cond:
            if len(self._buffer) < n:
                raise RuntimeError(f"take({n}) with {len(self._buffer)} groups buffered")
            groups = [self._buffer.popleft() for _ in range(n)]
            self._training = True
            queued = len(self._buffer)
            in_flight = self._in_flight
            skipped, self._skipped = self._skipped, 0
            extra = {"rollout/skipped_long_prompts": float(skipped)}
            if self._sampler is not None:
                extra["rollout/filtered_groups"] = float(self._sampler.take_filtered())
        now = time.monotonic()
        self.ledger.handed([g.index for g in groups])
        self._wake_admission()
        return groups, self._metrics(groups, wait_s, now, queued, in_flight) | extra

    def published(self, version: int) -> None:
        """The trainer finished its step and published ``version`` (the same
        version again when the step made none): the next groups may start."""
        with self._cond:
            self._training = False
            self._version = version
        self._wake_admission()

    def state_dict(self) -> dict:
        """What a checkpoint records: the prompts handed to the trainer so far."""
        return self.ledger.state_dict()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._task is not None:
            self._task.cancel()

    # ---------------------------------------------------------------- event loop side

    def _expected_staleness(self) -> int:
        ahead = self._in_flight + len(self._buffer)
        return int(self._training) + ahead // self.prompts_per_step

    def _wake_admission(self) -> None:
        def wake() -> None:
            if self._wake is not None:
                self._wake.set()
        self.loop.loop.call_soon_threadsafe(wake)

    async def _admit_loop(self) -> None:
        self._wake = asyncio.Event()
        try:
            while True:
                while True:
                    with self._cond:
                        if self._closed or self._error is not None or self._expected_staleness() > self.depth:
                            break
                        self._in_flight += 1
                        version = self._version
                    index, row = await asyncio.to_thread(self.ledger.draw)  # a dataset read may block
                    t = asyncio.create_task(self._one_group(index, row, version))
                    self._tasks.add(t)
                    t.add_done_callback(self._tasks.discard)
                await self._wake.wait()
                self._wake.clear()
        except asyncio.CancelledError:
            for t in list(self._tasks):
                t.cancel()
            raise
        except BaseException as e:  # noqa: BLE001  (reported to the trainer, not lost on the loop)
            self._fail(e)

    async def _one_group(self, index: int, row: dict, version: int) -> None:
        started = time.monotonic()
        try:
            ids = self.scorer.encode_prompt(row[self.scorer.prompt_key])
            # A distinct, reproducible seed per prompt of the run: groups differ, runs
            # repeat (prompt k of step s before pipelining: the same seeds as then).
            step, k = divmod(index, self.prompts_per_step)
            budget = fit_budget(len(ids), group_budget(row, self.sampling.max_new_tokens), self.max_sequence_tokens)
            if budget is None:
                self._skip_long_prompt(index, len(ids))
                return
            seed = (self.seed * 1_000_003 + (step + 1) * 9973 + k) % (2**31) if self.seeded_requests else None
            params = SamplingParams(**{**self.sampling.__dict__, "seed": seed, "max_new_tokens": budget})
            completions = await self.pool.generate(ids, self.scorer.group_size, params)
            label_unversioned(completions, version)
            # the group's own budget is the overlong penalty's L_max
            group = await asyncio.to_thread(self.scorer.score, index, row, ids, completions, budget=budget)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001
            self._fail(e)
            return
        group.started, group.finished, group.admitted_version = started, time.monotonic(), version
        with self._cond:
            self._skipped_in_a_row = 0
            self._in_flight -= 1
            keep = self._sampler is None or self._sampler.keep(group.constant)
            if keep:
                self._buffer.append(group)
                self._cond.notify_all()
        if not keep:  # dynamic sampling: no signal; handed (a resume skips it), another prompt takes its place
            self.ledger.handed([index])
            self._wake_admission()
            return
        if self.on_group is not None:
            self.on_group(group)

    MAX_SKIPPED_IN_A_ROW = 1000
    """Prompts skipped as too long, one after another, before the run stops
    (a limit below every prompt of the dataset would otherwise spin forever)."""

    def _skip_long_prompt(self, index: int, prompt_tokens: int) -> None:
        """The prompt leaves no room under ``max_sequence_tokens``: not sent,
        marked handed in the ledger (a resume does not draw it again)."""
        with self._cond:
            self._in_flight -= 1
            self._skipped += 1
            self._skipped_in_a_row += 1
            first, self._warned_long_prompt = not self._warned_long_prompt, True
            in_a_row = self._skipped_in_a_row
        self.ledger.handed([index])
        if in_a_row >= self.MAX_SKIPPED_IN_A_ROW:
            if in_a_row == self.MAX_SKIPPED_IN_A_ROW:  # once: groups drawn meanwhile end here silently
                self._fail(ValueError(
                    f"{in_a_row} prompts in a row left no room for a completion under training.seq_len / "
                    f"inference.max_model_len ({self.max_sequence_tokens} tokens; the last had {prompt_tokens})"))
            return
        if first:
            logger.warning("skipping prompt %d: %d tokens leave no room for a completion under training.seq_len / "
                           "inference.max_model_len (%d); such prompts are counted in rollout/skipped_long_prompts",
                           index, prompt_tokens, self.max_sequence_tokens)
        self._wake_admission()

    def _fail(self, e: BaseException) -> None:
        # Every group in flight fails alike when the fleet is gone (one
        # NoHealthyReplica each): one line per distinct failure, not per group.
        what = (type(e).__name__, str(e))
        with self._cond:
            first = self._error is None
            if first:
                self._error = e
            new = what not in self._logged
            self._logged.add(what)
            self._cond.notify_all()
        # The first failure is the run's stop reason: the trainer's stop line says it
        # (raised by next_batch), so it is not said here too; later ones are.
        if new and not first:
            logger.error("rollout producer stopped: %s: %s", *what)
        if first and self.on_error is not None:
            self.on_error(e)

    # ---------------------------------------------------------------- metrics

    def _metrics(self, groups: list[ScoredGroup], wait_s: float, now: float, queued: int,
                 in_flight: int) -> dict[str, float]:
        """Per step: what the trainer waited, how long the batch's groups took,
        the fleet's throughput since the last take and how far ahead it is."""
        span = max(g.finished for g in groups) - min(g.started for g in groups)
        tokens = sum(g.tokens for g in groups)
        since, self._last_take = self._last_take, now
        m = batch_metrics(groups) | self.pool.metrics()
        m |= {
            "time/wait_s": wait_s,
            "time/generate_s": span,
            "rollout/tokens_per_s": tokens / span if span > 0 else 0.0,
            "rollout/group_latency_s": sum(g.finished - g.started for g in groups) / len(groups),
            # the long tail's end (per-prompt budgets: lengths vary by orders of magnitude)
            "rollout/completion_len_max": float(max((len(s.completion_ids) for g in groups for s in g.samples),
                                                    default=0)),
            "rollout/buffered_groups": float(queued),
            "rollout/in_flight_groups": float(in_flight),
            "rollout/admitted_lag_max": float(max(self._version - g.admitted_version for g in groups)),
            "rollout/interval_s": now - since,
        }
        return m


# ------------------------------------------------------------------- building


@dataclass
class ProducerSpec:
    """What a :class:`RolloutProducer` for the built-in source is made of, as
    plain values: built from the config in the trainer's process
    (``session.producer_spec``), and sent as is to a rollout client process."""

    hf_dir: str
    """The tokenizer's directory."""
    task: str
    dataset_path: str
    prompt_key: str
    reward_fn: str
    prompts_per_step: int
    group_size: int
    seed: int
    depth: int
    sampling: SamplingParams
    scale_rewards: bool
    filter_constant_groups: bool
    reward_timeout_s: float
    use_chat_template: bool
    resume_prompts: dict | None = None
    """The checkpoint's ledger state (``state_dict()``), on resume."""
    max_sequence_tokens: int = 0
    """Prompt plus completion at most this many tokens (``training.seq_len``,
    and ``inference.max_model_len`` when smaller); 0: no limit."""
    overlong_buffer_tokens: int = 0
    """``grpo.overlong_buffer_tokens`` (0: rewards not shaped)."""
    overlong_penalty_factor: float = 1.0
    """``grpo.overlong_penalty_factor``."""
    dynamic_sampling: bool = False
    """``grpo.dynamic_sampling``."""
    dynamic_sampling_max_filtered: int = 0
    """``grpo.dynamic_sampling_max_filtered`` (0: its default)."""
    seeded_requests: bool = True
    """``rollout.seeded_requests``."""


def build_producer(spec: ProducerSpec, loop: LoopThread, pool: InferencePool, tokenizer=None,
                   **hooks) -> RolloutProducer:
    """The prompt source (digits task or a local dataset), its ledger, the
    scorer (``tokenizer``, loaded from ``spec.hf_dir`` if None, and the
    reward) and the producer, resumed where ``spec.resume_prompts`` says."""
    from transformers import AutoTokenizer

    from torchtitan_grpo.rollout import tasks

    if spec.task == "digits":
        prompts = tasks.DigitsPrompts(spec.prompts_per_step, spec.seed)
    else:
        rows = tasks.load_prompts(spec.dataset_path, spec.prompt_key)
        check_budgets(rows, f"rollout.dataset_path {spec.dataset_path!r}")  # per-row max_new_tokens
        prompts = tasks.PromptIterator(rows, spec.prompts_per_step, spec.seed)
    ledger = PromptLedger(prompts)
    if spec.resume_prompts is not None:
        ledger.load_state_dict(spec.resume_prompts)
    scorer = task_scorer(tokenizer or AutoTokenizer.from_pretrained(spec.hf_dir), spec.task, spec.reward_fn,
                         group_size=spec.group_size, prompt_key=spec.prompt_key, scale_rewards=spec.scale_rewards,
                         filter_constant_groups=spec.filter_constant_groups, reward_timeout_s=spec.reward_timeout_s,
                         use_chat_template=spec.use_chat_template,
                         overlong_buffer_tokens=spec.overlong_buffer_tokens,
                         overlong_penalty_factor=spec.overlong_penalty_factor)
    return RolloutProducer(loop, pool, ledger, scorer, prompts_per_step=spec.prompts_per_step, depth=spec.depth,
                           sampling=spec.sampling, seed=spec.seed, seeded_requests=spec.seeded_requests,
                           max_sequence_tokens=spec.max_sequence_tokens,
                           dynamic_sampling=spec.dynamic_sampling,
                           dynamic_sampling_max_filtered=spec.dynamic_sampling_max_filtered, **hooks)


def task_scorer(tokenizer, task: str, reward_fn: str, *, use_chat_template: bool, **kw) -> GroupScorer:
    """The scorer of ``rollout.task``'s prompts (the rollouts' and ``[eval]``'s):
    ``reward_fn``, or the task's own reward when empty (digits); the chat
    template only for dataset prompts (the digits task is raw text for a
    character tokenizer). ``kw``: GroupScorer's other settings (the
    rollouts' overlong shaping among them; ``[eval]`` passes none: it reports
    the task reward)."""
    from torchtitan_grpo.rollout import tasks
    from torchtitan_grpo.rollout.groups import make_reward_fn

    reward = make_reward_fn(reward_fn, tasks.digits_reward if task == "digits" else None)
    return GroupScorer(tokenizer, reward, use_chat_template=use_chat_template and task == "jsonl", **kw)


def label_unversioned(completions: list, version: int) -> None:
    """A replica that reports no weight version (vLLM before 0.33) leaves its
    completions' versions empty: label each with ``version``, the trainer's
    version when its group started. In the serial loop every replica serves
    exactly that version then (the push waited for them); pipelined, a
    replica still receiving it serves the one before for that long, so the
    staleness filter may count such a sample a version too fresh. The loss's
    importance weights use the engine's own log-probs either way."""
    for c in completions:
        if not c.weight_versions and c.token_ids:
            c.weight_version, c.weight_versions = str(version), [str(version)]
            c.version_spans = [(str(version), 0, len(c.token_ids))]
