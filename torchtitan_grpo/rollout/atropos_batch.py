"""A batch from Atropos's ``/batch`` as the trainer's :class:`RolloutBatch`:
its groups converted (``atropos_groups.convert_groups``), its metrics, and
the warnings a batch can call for, each logged once per run (the first
dropped group of each kind, per-token advantages that vary, a sampling
temperature other than the trainer's). Used by ``atropos.py`` from one
thread at a time (the trainer's or the prefetch's)."""

from __future__ import annotations

import logging

import torch

from torchtitan_grpo.rollout.atropos_groups import MALFORMED_KINDS, ConvertedGroup, Malformed, convert_groups
from torchtitan_grpo.rollout.producer import RolloutBatch
from torchtitan_grpo.train.sample import Sample

logger = logging.getLogger("torchtitan_grpo")


class BatchConverter:
    """``converter(groups)``: the batch's samples and metrics, and its first
    dropped group's kind and reason ("" if none); ``indices`` count from its
    first group (dropped ones included)."""

    def __init__(self, *, scale_rewards: bool, filter_constant_groups: bool, max_len: int, vocab_size: int,
                 allow_missing_logprobs: bool, temperature: float):
        self.scale_rewards = scale_rewards
        self.filter_constant_groups = filter_constant_groups
        self.max_len = max_len
        self.vocab_size = vocab_size
        self.allow_missing_logprobs = allow_missing_logprobs
        self.temperature = temperature
        self._logged_kinds: set[str] = set()
        self._logged_once: set[str] = set()

    def _once(self, key: str, msg: str, *args) -> None:
        if key not in self._logged_once:
            self._logged_once.add(key)
            logger.warning(msg, *args)

    def __call__(self, groups: list[dict]) -> tuple[RolloutBatch, str]:
        samples: list[Sample] = []
        indices: list[int] = []
        converted: list[ConvertedGroup] = []
        dropped = dict.fromkeys(MALFORMED_KINDS, 0)
        first_drop = ""
        results = convert_groups(groups, scale_rewards=self.scale_rewards,
                                 filter_constant_groups=self.filter_constant_groups, max_len=self.max_len,
                                 vocab_size=self.vocab_size, allow_missing_logprobs=self.allow_missing_logprobs)
        for k, (g, c) in enumerate(zip(groups, results)):
            if isinstance(c, Malformed):
                dropped[c.kind] += 1
                first_drop = first_drop or f"{c.kind}: {c}"
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
        return RolloutBatch(samples, m, indices), first_drop
