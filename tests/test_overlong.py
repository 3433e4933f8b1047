"""DAPO's overlong reward shaping (rollout/overlong.py): the penalty at its
boundaries, the scorer shaping rewards before advantages against each
group's own budget, the start-up checks, and [eval] left unshaped."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import ROOT
from tests.producer_stubs import CharTokenizer, started
from torchtitan_grpo.aio import LoopThread
from torchtitan_grpo.config.checks import ConfigError
from torchtitan_grpo.config.parse import parse_config
from torchtitan_grpo.fleet.types import Completion, SamplingParams
from torchtitan_grpo.rollout.advantages import group_advantages
from torchtitan_grpo.rollout.groups import GroupScorer, batch_metrics
from torchtitan_grpo.rollout.ledger import PromptLedger
from torchtitan_grpo.rollout.overlong import overlong_penalty
from torchtitan_grpo.rollout.producer import RolloutProducer
from torchtitan_grpo.rollout.tasks import PromptIterator

DEMO = os.path.join(ROOT, "train_configs", "demo_cpu.toml")


def _completion(n: int, reason: str = "stop") -> Completion:
    return Completion([97] * n, [-0.5] * n, reason, "0", ["0"])


def _always_right(prompt, completion, row) -> float:
    return 1.0


# ---- the penalty ------------------------------------------------------------ #


def test_penalty_at_the_boundaries():
    # L_max 100, L_cache 20: free up to 80, then -1/20 a token down to -1 at 100
    assert overlong_penalty(0, 100, 20) == 0.0
    assert overlong_penalty(80, 100, 20) == 0.0  # |y| = L_max - L_cache
    assert overlong_penalty(81, 100, 20) == pytest.approx(-0.05)  # one token past
    assert overlong_penalty(90, 100, 20) == pytest.approx(-0.5)
    assert overlong_penalty(100, 100, 20) == pytest.approx(-1.0)  # |y| = L_max
    assert overlong_penalty(101, 100, 20) == -1.0  # past L_max
    assert overlong_penalty(5000, 100, 20) == -1.0


def test_penalty_factor_scales_and_buffer_zero_is_off():
    assert overlong_penalty(90, 100, 20, factor=0.5) == pytest.approx(-0.25)
    assert overlong_penalty(101, 100, 20, factor=0.5) == pytest.approx(-0.5)
    assert overlong_penalty(100, 100, 20, factor=2.0) == pytest.approx(-2.0)
    assert overlong_penalty(90, 100, 20, factor=0.0) == 0.0
    for n in (0, 99, 100, 101):
        assert overlong_penalty(n, 100, 0) == 0.0


def test_a_budget_smaller_than_the_buffer_is_graded_over_its_whole_length():
    # a row's own max_new_tokens of 10 under a 20-token buffer: [0, -1] over 0..10
    assert overlong_penalty(0, 10, 20) == 0.0
    assert overlong_penalty(5, 10, 20) == pytest.approx(-0.5)
    assert overlong_penalty(10, 10, 20) == pytest.approx(-1.0)


# ---- the scorer ------------------------------------------------------------- #


def test_scorer_shapes_rewards_before_the_advantages():
    """Three right answers of 2, 6 and 8 tokens (budget 8, buffer 4): task
    rewards are equal (no signal unshaped), shaped 1, 0.5, 0 favour the shorter."""
    group = [_completion(2), _completion(6), _completion(8, "length")]
    plain = GroupScorer(CharTokenizer(), _always_right, group_size=3)
    unshaped = plain.score(0, {"prompt": "q"}, [113], group, budget=8)
    assert unshaped.constant and unshaped.rewards == [1.0, 1.0, 1.0] and unshaped.overlong_penalty is None
    assert [s.advantage for s in unshaped.samples] == [0.0, 0.0, 0.0]

    scorer = GroupScorer(CharTokenizer(), _always_right, group_size=3, overlong_buffer_tokens=4)
    g = scorer.score(0, {"prompt": "q"}, [113], group, budget=8)
    assert g.rewards == pytest.approx([1.0, 0.5, 0.0])
    assert [s.reward for s in g.samples] == pytest.approx([1.0, 0.5, 0.0])  # the samples train on the shaped reward
    adv = [s.advantage for s in g.samples]
    assert adv[0] > 0 > adv[2] and adv[0] > adv[1] > adv[2] and not g.constant
    assert adv == pytest.approx(group_advantages(torch.tensor([[1.0, 0.5, 0.0]]))[0].tolist())
    assert g.overlong_penalty == pytest.approx(-0.5)

    m = batch_metrics([g, g])
    assert m["reward/mean"] == pytest.approx(0.5)  # what trains
    assert m["reward/overlong_penalty_mean"] == pytest.approx(-0.5)
    assert m["reward/task_mean"] == pytest.approx(1.0)
    assert "reward/overlong_penalty_mean" not in batch_metrics([unshaped])  # off: the metrics of before


def test_scorer_uses_the_budget_it_is_given_and_needs_one_when_on():
    scorer = GroupScorer(CharTokenizer(), _always_right, group_size=2, overlong_buffer_tokens=4,
                         overlong_penalty_factor=0.5)
    group = [_completion(6), _completion(6)]
    assert scorer.score(0, {"prompt": "q"}, [113], group, budget=100).rewards == [1.0, 1.0]
    assert scorer.score(0, {"prompt": "q"}, [113], group, budget=8).rewards == pytest.approx([0.75, 0.75])
    with pytest.raises(ValueError, match=r"grpo\.overlong_buffer_tokens.*budget"):
        scorer.score(0, {"prompt": "q"}, [113], group)


class FourTokenPool:
    """Each completion ends after 4 tokens, or is cut at the request's budget."""

    async def generate(self, ids, n, params: SamplingParams):
        k = min(4, params.max_new_tokens)
        return [_completion(k, "length" if params.max_new_tokens <= 4 else "stop") for _ in range(n)]

    def metrics(self):
        return {}


def test_producer_shapes_against_each_groups_own_budget():
    """Config budget 8, buffer 2: 4 tokens are free against 8, but a row of
    budget 5 is in its buffer (-0.5) and a row of budget 4 at its end (-1)."""
    rows = [{"prompt": "p4", "max_new_tokens": 4}, {"prompt": "p5", "max_new_tokens": 5}, {"prompt": "pn"}]
    loop = LoopThread()
    scorer = GroupScorer(CharTokenizer(), _always_right, group_size=2, overlong_buffer_tokens=2)
    prod = RolloutProducer(loop, FourTokenPool(), PromptLedger(PromptIterator(rows, 3, seed=0)), scorer,
                           prompts_per_step=3, depth=0, sampling=SamplingParams(max_new_tokens=8))
    with started(prod):
        batch = prod.next_batch()
    rewards = {"".join(map(chr, s.prompt_ids)): s.reward for s in batch.samples}
    assert rewards == pytest.approx({"p4": 0.0, "p5": 0.5, "pn": 1.0})
    assert batch.metrics["reward/overlong_penalty_mean"] == pytest.approx(-0.5)
    assert batch.metrics["reward/task_mean"] == pytest.approx(1.0)


# ---- configuration ---------------------------------------------------------- #


def _cfg(*args: str):
    return parse_config(["--job.config_file", DEMO, *args])  # the demo: rollout.max_new_tokens = 2


@pytest.mark.parametrize("args, match", [
    (("--grpo.overlong_buffer_tokens", "-1"), r"grpo\.overlong_buffer_tokens = -1: must be >= 0"),
    (("--grpo.overlong_penalty_factor", "-0.5"), r"grpo\.overlong_penalty_factor = -0\.5: must be >= 0"),
    (("--grpo.overlong_buffer_tokens", "2"), r"grpo\.overlong_buffer_tokens = 2: must be < rollout\.max_new_tokens"),
    (("--grpo.overlong_buffer_tokens", "1", "--rollout.source", "atropos"),
     r"grpo\.overlong_buffer_tokens = 1: needs rollout\.source = \"builtin\""),
])
def test_config_checks_fail_in_one_line_naming_the_key(args, match):
    with pytest.raises(ConfigError, match=match) as e:
        _cfg(*args)
    assert "\n" not in str(e.value)


def test_rollouts_are_shaped_and_eval_is_not():
    from torchtitan_grpo import session
    from torchtitan_grpo.rollout.producer import build_producer

    cfg = _cfg("--grpo.overlong_buffer_tokens", "1", "--grpo.overlong_penalty_factor", "0.5")
    tok = CharTokenizer()
    producer = build_producer(session.producer_spec(cfg, "", tok, None), None, None, tokenizer=tok)
    assert (producer.scorer.overlong_buffer_tokens, producer.scorer.overlong_penalty_factor) == (1, 0.5)
    evaluator = session._evaluator(cfg, tok, None, object(), [], None, None, None)
    assert evaluator.scorer.overlong_buffer_tokens == 0
