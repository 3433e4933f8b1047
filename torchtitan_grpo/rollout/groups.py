"""One prompt's group: its completions, their rewards and group advantages.

The producer (``rollout/producer.py``) generates groups one prompt at a time
and hands them to the trainer as they finish, so everything a group needs
(decoding, rewards, advantages, per-group counts) is computed here, per group,
and a step's metrics are summed from its groups (:func:`batch_metrics`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from torchtitan_grpo.protocol.route_codec import for_sample
from torchtitan_grpo.fleet.types import Completion
from torchtitan_grpo.rollout import rewards as rw
from torchtitan_grpo.rollout.advantages import constant_group_mask, group_advantages
from torchtitan_grpo.rollout.overlong import shape_rewards
from torchtitan_grpo.train.sample import Sample


@dataclass
class ScoredGroup:
    """One prompt's completions, scored; what the trainer's batch is made of."""

    index: int
    """Position of the prompt in the run's prompt stream (the checkpoint's unit)."""
    samples: list[Sample]
    """Empty when the group was filtered (``grpo.filter_constant_groups``)."""
    rewards: list[float]
    """The rewards that train: the task's, plus the overlong penalty when
    ``grpo.overlong_buffer_tokens`` shapes them."""
    tokens: int
    """Completion tokens generated for the group (filtered or not)."""
    truncated: int
    """Completions cut at their token budget (finish reason "length"): the
    row's own ``max_new_tokens`` if it has one, else ``rollout.max_new_tokens``
    (``prompt_budget``)."""
    constant: bool
    """All rewards equal: zero advantages."""
    replica: str = ""
    started: float = 0.0
    """``time.monotonic()`` when the group was submitted to the pool."""
    finished: float = 0.0
    """... and when it was scored."""
    admitted_version: int = 0
    """Trainer version published when the group was admitted."""
    versions: list[str] = field(default_factory=list)
    """Every weight version that produced part of the group."""
    overlong_penalty: float | None = None
    """Mean overlong penalty of the group's completions (``rollout/overlong.py``,
    already in ``rewards``); None: not shaped."""

    def __reduce__(self):
        # Pickled (the rollout client process sends groups to the trainer's)
        # with each sample as a tuple of its fields: unpickling a step's 16
        # groups of 16 took 0.36-0.56 ms instead of 0.85-0.92 ms as Sample objects, and
        # the trainer's receiving thread holds the GIL throughout.
        state = dict(self.__dict__, samples=[tuple(getattr(s, n) for n in _SAMPLE_FIELDS) for s in self.samples])
        return _group_from_wire, (state,)


_SAMPLE_FIELDS = tuple(f.name for f in dataclasses.fields(Sample))


def _group_from_wire(state: dict) -> ScoredGroup:
    group = ScoredGroup.__new__(ScoredGroup)
    group.__dict__.update(state, samples=[Sample(*values) for values in state["samples"]])
    return group


class GroupScorer:
    """Prompt text -> token ids, and completions -> a :class:`ScoredGroup`."""

    def __init__(self, tokenizer, reward_fn: rw.RewardFn, *, group_size: int, prompt_key: str = "prompt",
                 scale_rewards: bool = True, filter_constant_groups: bool = False, reward_timeout_s: float = 10.0,
                 use_chat_template: bool = False, overlong_buffer_tokens: int = 0,
                 overlong_penalty_factor: float = 1.0):
        """``overlong_buffer_tokens`` > 0: rewards get DAPO's overlong penalty
        (``rollout/overlong.py``) against the budget each ``score`` call is given."""
        self.tok = tokenizer
        self.reward_fn = reward_fn
        self.group_size = group_size
        self.prompt_key = prompt_key
        self.scale_rewards = scale_rewards
        self.filter_constant_groups = filter_constant_groups
        self.reward_timeout_s = reward_timeout_s
        self.overlong_buffer_tokens = overlong_buffer_tokens
        self.overlong_penalty_factor = overlong_penalty_factor
        # Chat models expect their template: the prompt becomes one user turn
        # followed by the assistant header (tokenizers without one: raw text).
        self.use_chat_template = use_chat_template and bool(getattr(tokenizer, "chat_template", None))

    def encode_prompt(self, text: str) -> list[int]:
        if self.use_chat_template:
            # The template writes every special token (BOS included) itself.
            text = self.tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True)
        return list(self.tok.encode(text, add_special_tokens=False))

    def score(self, index: int, row: dict, prompt_ids: list[int], group: list[Completion], *,
              budget: int | None = None) -> ScoredGroup:
        """Decode, reward (a reward that raises or hangs scores 0, see
        ``rewards.score_all``), overlong penalty (against ``budget``, the
        group's ``max_new_tokens``; needed when shaping is on), and advantages
        within the group. Runs off the event loop: a slow reward must not hold
        the pool's HTTP traffic."""
        prompt = row[self.prompt_key]
        texts = [self.tok.decode(c.token_ids, skip_special_tokens=True) for c in group]
        scores = rw.score_all(self.reward_fn, [(prompt, t, row) for t in texts], timeout_s=self.reward_timeout_s)
        penalty = None
        if self.overlong_buffer_tokens > 0:
            if budget is None:
                raise ValueError("GroupScorer.score: overlong shaping (grpo.overlong_buffer_tokens) needs the "
                                 "group's budget")
            scores, penalty = shape_rewards(scores, [len(c.token_ids) for c in group], budget,
                                            self.overlong_buffer_tokens, self.overlong_penalty_factor)
        rewards = torch.tensor(scores, dtype=torch.float32).view(1, len(group))
        adv = group_advantages(rewards, scale_by_std=self.scale_rewards)[0]
        constant = bool(constant_group_mask(rewards)[0])
        samples = []
        if not (self.filter_constant_groups and constant):
            samples = [Sample(prompt_ids, c.token_ids, c.logprobs, float(adv[j]), scores[j], c.finish_reason,
                              c.weight_versions, version_spans=c.version_spans or None,
                              routed_experts=for_sample(c.routed_experts, len(prompt_ids), len(c.token_ids), c.replica))
                       for j, c in enumerate(group)]
        return ScoredGroup(index, samples, scores, sum(len(c.token_ids) for c in group),
                           sum(c.finish_reason == "length" for c in group), constant,
                           replica=group[0].replica if group else "",
                           versions=sorted({v for c in group for v in c.weight_versions}), overlong_penalty=penalty)


def batch_metrics(groups: list[ScoredGroup]) -> dict[str, float]:
    """Reward and length metrics of one step's groups (filtered groups included:
    they were generated and scored)."""
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
    n = max(rewards.numel(), 1)
    tokens = sum(g.tokens for g in groups)
    return {
        "reward/mean": float(rewards.mean()) if rewards.numel() else 0.0,
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "rollout/constant_groups": float(sum(g.constant for g in groups)),
        "rollout/completion_len": tokens / n,
        "rollout/truncated_frac": sum(g.truncated for g in groups) / n,
        "rollout/tokens": float(tokens),
    } | _overlong_metrics(groups, rewards)


def _overlong_metrics(groups: list[ScoredGroup], rewards: torch.Tensor) -> dict[str, float]:
    """With overlong shaping on (every group of the run is shaped): the mean
    penalty and the mean task reward without it; nothing when off."""
    shaped = [g for g in groups if g.overlong_penalty is not None]
    if not shaped:
        return {}
    n = max(rewards.numel(), 1)
    penalty = sum(g.overlong_penalty * len(g.rewards) for g in shaped)
    return {"reward/overlong_penalty_mean": penalty / n, "reward/task_mean": (float(rewards.sum()) - penalty) / n}


def make_reward_fn(spec: str, default: Callable) -> rw.RewardFn:
    return rw.load_reward_fn(spec) if spec else default
