"""Held-out evaluation during training: a producer of metrics, not of samples.

The ``[eval]`` prompts go to the same inference servers as the rollouts, at
the eval sampling settings (greedy by default), and are scored by the
training reward. Everything runs on rank 0's event loop: ``submit`` returns at
once, so a pipelined trainer never waits for an evaluation; the serial loop
waits for it between steps (``wait``), which makes it exact: no version lands
while it runs. Each result records the weight versions its completions were
generated under, so a pipelined evaluation that overlapped a push says so.

An evaluation that fails (no healthy replica, a group that cannot be
generated) is logged as one warning and skipped: it never stops the run.
Prompts fit the run's sequence limit as the rollouts' do
(``prompt_budget.fit_budget``): a budget is cut to what the prompt leaves,
and a prompt that leaves no room is left out of the scores and counted
(``eval/skipped_long_prompts``), the same rows at every evaluation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from torchtitan_grpo.aio import LoopThread
from torchtitan_grpo.fleet.pool import InferencePool, PoolError
from torchtitan_grpo.fleet.types import SamplingParams
from torchtitan_grpo.rollout.groups import GroupScorer, ScoredGroup
from torchtitan_grpo.rollout.prompt_budget import fit_budget

logger = logging.getLogger("torchtitan_grpo")


@dataclass
class EvalResult:
    step: int
    """The trainer step whose weights were evaluated (0: the starting weights)."""
    metrics: dict[str, float]


def eval_rows(eval_cfg, rollout_cfg) -> list[dict]:
    """The held-out rows: the first ``max_samples`` of ``eval.dataset_path``,
    or the digits task's ten prompts."""
    from torchtitan_grpo.rollout import tasks

    if eval_cfg.dataset_path:
        rows = tasks.load_prompts(eval_cfg.dataset_path, rollout_cfg.prompt_key)
    else:  # rollout.task = "digits": every prompt there is
        rows = [{"prompt": f"{d}>", "answer": tasks.digits_answer(f"{d}>")} for d in range(10)]
    return rows[:eval_cfg.max_samples] if eval_cfg.max_samples else rows


def eval_metrics(groups: list[ScoredGroup], threshold: float, versions: list[int], seconds: float) -> dict[str, float]:
    """pass@1 (mean over completions of reward >= threshold), pass@k with k
    completions per prompt (a prompt counts if any is correct), mean reward,
    lengths and the weight versions seen."""
    rewards = [r for g in groups for r in g.rewards]
    n = max(len(rewards), 1)
    k = max((len(g.rewards) for g in groups), default=1)
    out = {
        "eval/pass@1": sum(r >= threshold for r in rewards) / n,
        "eval/mean_reward": sum(rewards) / n,
        "eval/completion_len": sum(g.tokens for g in groups) / n,
        "eval/truncated_frac": sum(g.truncated for g in groups) / n,
        "eval/prompts": float(len(groups)),
        "eval/time_s": seconds,
    }
    if k > 1:
        out[f"eval/pass@{k}"] = sum(any(r >= threshold for r in g.rewards) for g in groups) / max(len(groups), 1)
    if versions:
        out["eval/weight_version_min"], out["eval/weight_version_max"] = float(min(versions)), float(max(versions))
    return out


def format_eval_line(step: int, m: dict[str, float]) -> str:
    passk = "".join(f" | {k[5:]} {v:.3f}" for k, v in m.items() if k.startswith("eval/pass@") and k != "eval/pass@1")
    lo, hi = m.get("eval/weight_version_min"), m.get("eval/weight_version_max")
    version = "" if lo is None else f" | version {int(lo)}" + (f"-{int(hi)}" if hi != lo else "")
    return (f"eval step {step:4d} | pass@1 {m['eval/pass@1']:.3f}{passk} | reward {m['eval/mean_reward']:.3f} "
            f"| {int(m['eval/prompts'])} prompts | len {m['eval/completion_len']:.1f}{version} | {m['eval/time_s']:.1f}s")


class Evaluator:
    """``submit`` / ``poll`` / ``wait`` from the trainer's thread; the
    generation runs on ``loop``."""

    def __init__(self, loop: LoopThread, pool: InferencePool, scorer: GroupScorer, rows: list[dict], *,
                 sampling: SamplingParams, pass_threshold: float, max_concurrent: int,
                 wait_version: Callable[[int], None] | None = None, max_sequence_tokens: int = 0):
        """``scorer``: prompt encoding and the training reward (its
        group_size is the completions per prompt). ``wait_version(v)``
        blocks until the servers hold version ``v`` (the pusher's
        ``wait_for``); None: nothing is pushed, the servers' weights are the
        ones to evaluate. ``max_sequence_tokens``: prompt plus completion at
        most this (0: no limit)."""
        self.loop, self.pool, self.scorer, self.rows = loop, pool, scorer, rows
        self.max_sequence_tokens = max_sequence_tokens
        self.sampling, self.threshold = sampling, pass_threshold
        self.max_concurrent = max_concurrent
        self.wait_version = wait_version
        self._pending: list[tuple[int, concurrent.futures.Future]] = []
        self._lock = threading.Lock()
        self.evaluated: set[int] = set()
        """Steps submitted so far (a step is never evaluated twice)."""

    def submit(self, step: int, version: int) -> None:
        """Start evaluating the weights of ``step`` (weight version ``version``)."""
        if step in self.evaluated:
            return
        self.evaluated.add(step)
        with self._lock:
            self._pending.append((step, self.loop.submit(self._evaluate(version))))

    def poll(self) -> list[EvalResult]:
        """The evaluations that have finished, in submission order, without waiting."""
        return self._collect(wait=False)

    def wait(self) -> list[EvalResult]:
        """Every submitted evaluation, waiting for those still running."""
        return self._collect(wait=True)

    def _collect(self, wait: bool) -> list[EvalResult]:
        out = []
        with self._lock:
            while self._pending and (wait or self._pending[0][1].done()):
                step, fut = self._pending.pop(0)
                try:
                    out.append(EvalResult(step, fut.result()))
                except (PoolError, TimeoutError, RuntimeError) as e:
                    # The rollouts meet the same fault and decide about the run; an eval only reports.
                    logger.warning("eval of step %d skipped: %s: %s", step, type(e).__name__, e)
        return out

    async def _evaluate(self, version: int) -> dict[str, float]:
        t0 = time.monotonic()
        if self.wait_version is not None:
            # Pipelined with an async push the servers may still be installing this version.
            try:
                await asyncio.to_thread(self.wait_version, version)
            except TimeoutError as e:  # evaluate what they serve; the versions logged say which
                logger.warning("eval: %s; evaluating the weights the servers hold", e)
        gate = asyncio.Semaphore(self.max_concurrent)
        scored = await asyncio.gather(*(self._one(i, row, gate) for i, row in enumerate(self.rows)))
        groups = [g for g in scored if g is not None]
        versions = [int(v) for g in groups for v in g.versions if _is_int(v)]
        return eval_metrics(groups, self.threshold, versions, time.monotonic() - t0) | {
            "eval/skipped_long_prompts": float(len(scored) - len(groups))}

    async def _one(self, index: int, row: dict, gate: asyncio.Semaphore) -> ScoredGroup | None:
        async with gate:
            ids = self.scorer.encode_prompt(row[self.scorer.prompt_key])
            budget = fit_budget(len(ids), self.sampling.max_new_tokens, self.max_sequence_tokens)
            if budget is None:
                return None
            sampling = self.sampling if budget == self.sampling.max_new_tokens else \
                SamplingParams(**{**self.sampling.__dict__, "max_new_tokens": budget})
            completions = await self.pool.generate(ids, self.scorer.group_size, sampling)
        return await asyncio.to_thread(self.scorer.score, index, row, ids, completions)


def _is_int(v: str) -> bool:
    return v.lstrip("-").isdigit()
