"""RolloutManager: prompts -> groups of completions -> rewards -> advantages.

Runs on rank 0. Each prompt's whole group is requested from the pool as one
request (n = group_size), so a group always comes from one replica and one
attempt; all prompts of a step are in flight at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from torchtitan_grpo.aio import LoopThread
from torchtitan_grpo.inference.pool import InferencePool
from torchtitan_grpo.inference.types import Completion, SamplingParams
from torchtitan_grpo.rollout import rewards as rw
from torchtitan_grpo.rollout.advantages import constant_group_mask, group_advantages
from torchtitan_grpo.trainer import Sample


@dataclass
class RolloutBatch:
    samples: list[Sample]
    metrics: dict[str, float]


class RolloutManager:
    def __init__(self, loop: LoopThread, pool: InferencePool, tokenizer, prompt_batches: Iterator[list[dict]],
                 reward_fn: rw.RewardFn, *, group_size: int, sampling: SamplingParams,
                 prompt_key: str = "prompt", scale_rewards: bool = True, filter_constant_groups: bool = False,
                 reward_timeout_s: float = 10.0, seed: int = 0, use_chat_template: bool = False):
        self.loop, self.pool, self.tok = loop, pool, tokenizer
        self.prompt_batches = prompt_batches
        self.reward_fn = reward_fn
        self.group_size = group_size
        self.sampling = sampling
        self.prompt_key = prompt_key
        self.scale_rewards = scale_rewards
        self.filter_constant_groups = filter_constant_groups
        self.reward_timeout_s = reward_timeout_s
        self.seed = seed
        # Chat models expect their template: the prompt becomes one user turn
        # followed by the assistant header (tokenizers without one: raw text).
        self.use_chat_template = use_chat_template and bool(getattr(tokenizer, "chat_template", None))

    def encode_prompt(self, text: str) -> list[int]:
        if self.use_chat_template:
            # The template writes every special token (BOS included) itself.
            text = self.tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True)
        return list(self.tok.encode(text, add_special_tokens=False))

    def collect(self, step: int) -> RolloutBatch:
        rows = next(self.prompt_batches)
        prompts = [r[self.prompt_key] for r in rows]
        ids = [self.encode_prompt(p) for p in prompts]
        t0 = time.perf_counter()
        groups: list[list[Completion]] = self.loop.run(self._generate_all(ids, step))
        gen_s = time.perf_counter() - t0

        t1 = time.perf_counter()
        texts = [[self.tok.decode(c.token_ids, skip_special_tokens=True) for c in g] for g in groups]
        items = [(p, t, row) for p, row, g in zip(prompts, rows, texts) for t in g]
        scores = rw.score_all(self.reward_fn, items, timeout_s=self.reward_timeout_s)
        reward_s = time.perf_counter() - t1

        G = self.group_size
        rewards = torch.tensor(scores, dtype=torch.float32).view(len(rows), G)
        adv = group_advantages(rewards, scale_by_std=self.scale_rewards)
        constant = constant_group_mask(rewards)
        samples = []
        for i, (p_ids, g) in enumerate(zip(ids, groups)):
            if self.filter_constant_groups and bool(constant[i]):
                continue
            for j, c in enumerate(g):
                samples.append(Sample(p_ids, c.token_ids, c.logprobs, float(adv[i, j]), float(rewards[i, j]),
                                      c.finish_reason, c.weight_versions))
        n_tok = sum(len(c.token_ids) for g in groups for c in g)
        versions = sorted({v for g in groups for c in g for v in c.weight_versions})
        metrics = {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "rollout/constant_groups": float(constant.sum()),
            "rollout/completion_len": n_tok / max(rewards.numel(), 1),
            "rollout/truncated_frac": sum(c.finish_reason == "length" for g in groups for c in g) / max(rewards.numel(), 1),
            "rollout/tokens": float(n_tok),
            "time/generate_s": gen_s,
            "time/reward_s": reward_s,
            "rollout/tokens_per_s": n_tok / gen_s if gen_s > 0 else 0.0,
        }
        return RolloutBatch(samples, metrics | self.pool.metrics() | {"_versions": versions})

    async def _generate_all(self, ids: list[list[int]], step: int) -> list[list[Completion]]:
        def params(i: int) -> SamplingParams:
            # A distinct, reproducible seed per (step, prompt): groups differ, runs repeat.
            return SamplingParams(**{**self.sampling.__dict__, "seed": (self.seed * 1_000_003 + step * 9973 + i) % (2**31)})
        return await asyncio.gather(*(self.pool.generate(p, self.group_size, params(i)) for i, p in enumerate(ids)))


def make_reward_fn(spec: str, default: Callable) -> rw.RewardFn:
    return rw.load_reward_fn(spec) if spec else default
