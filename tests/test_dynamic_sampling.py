"""DAPO's dynamic sampling (rollout/dynamic_sampling.py, the producer): a
constant group never enters the buffer, so each step takes prompts_per_step
groups with signal; discarded groups are counted and handed in the ledger;
the guard lets constant groups in after N in a row and warns once; off, the
producer behaves as before; the start-up checks and the wiring."""

from __future__ import annotations

import logging
import os

import pytest

from tests.conftest import ROOT
from tests.producer_stubs import CharTokenizer, ListSource, started
from torchtitan_grpo.aio import LoopThread
from torchtitan_grpo.config.checks import ConfigError
from torchtitan_grpo.config.parse import parse_config
from torchtitan_grpo.fleet.types import Completion, SamplingParams
from torchtitan_grpo.rollout.dynamic_sampling import DynamicSampler, resolve_max_filtered
from torchtitan_grpo.rollout.groups import GroupScorer
from torchtitan_grpo.rollout.ledger import PromptLedger
from torchtitan_grpo.rollout.producer import RolloutProducer

DEMO = os.path.join(ROOT, "train_configs", "demo_cpu.toml")
GROUP = 3


class DistinctPool:
    """Completion j of a group is "a", "b", "c", ...: distinct within a group;
    records which prompts were generated."""

    def __init__(self):
        self.prompts: list[str] = []

    async def generate(self, ids, n, params: SamplingParams):
        self.prompts.append("".join(map(chr, ids)))
        return [Completion([97 + j], [-0.5], "stop", "0", ["0"]) for j in range(n)]

    def metrics(self):
        return {}


def reward(prompt, completion, row):
    """Prompts starting with "c" are solved by every completion (constant:
    no signal); the others only by completion "a"."""
    return 1.0 if prompt.startswith("c") else float(completion == "a")


def _producer(rows, pps, *, dynamic=True, max_filtered=0, filter_constant=False, pool=None):
    scorer = GroupScorer(CharTokenizer(), reward, group_size=GROUP, filter_constant_groups=filter_constant)
    return RolloutProducer(LoopThread(), pool or DistinctPool(), PromptLedger(ListSource(rows)), scorer,
                           prompts_per_step=pps, depth=0, sampling=SamplingParams(max_new_tokens=4),
                           dynamic_sampling=dynamic, dynamic_sampling_max_filtered=max_filtered)


def _steps(prod, n):
    """``n`` trainer steps (take, then publish the next version); the batches
    and the ledger's state after the last."""
    batches = []
    with started(prod):
        for v in range(1, n + 1):
            batches.append(prod.next_batch())
            if v < n:
                prod.published(v)
        state = prod.state_dict()
    return batches, state


def _prompts(batch):
    return sorted({"".join(map(chr, s.prompt_ids)) for s in batch.samples})


# ---- the producer ----------------------------------------------------------- #


def test_a_step_takes_prompts_per_step_groups_with_signal_and_counts_the_rest():
    """pps 3 over s0 c1 c2 s3 c4 c5 s6 s7: the four constant groups are
    generated, discarded (counted), and handed: a resume draws s7 next.
    Step 2 (s7, s0, c1, c2, s3) counts only its own two."""
    rows = [{"prompt": p} for p in ("s0", "c1", "c2", "s3", "c4", "c5", "s6", "s7")]
    pool = DistinctPool()
    (first, second), state = _steps(_producer(rows, 3, pool=pool), 2)
    assert sorted(pool.prompts[:7]) == sorted(p["prompt"] for p in rows[:7])  # the constant ones were generated
    assert _prompts(first) == ["s0", "s3", "s6"] and len(first.samples) == 3 * GROUP
    assert sorted(first.indices) == [0, 3, 6]
    assert first.metrics["rollout/filtered_groups"] == 4
    assert first.metrics["rollout/constant_groups"] == 0
    assert any(s.advantage != 0 for s in first.samples)
    assert _prompts(second) == ["s0", "s3", "s7"] and sorted(second.indices) == [7, 8, 11]
    assert second.metrics["rollout/filtered_groups"] == 2  # since the last take, not in all
    resumed = PromptLedger(ListSource(rows))
    resumed.load_state_dict(state)
    assert resumed.draw() == (12, {"prompt": "c4"})  # every drawn index was handed: trained or discarded


def test_a_resume_after_the_first_step_draws_past_the_discarded_groups():
    rows = [{"prompt": p} for p in ("c0", "s1", "c2", "c3", "s4", "s5")]
    (batch,), state = _steps(_producer(rows, 2), 1)
    assert sorted(batch.indices) == [1, 4] and batch.metrics["rollout/filtered_groups"] == 3
    resumed = PromptLedger(ListSource(rows))
    resumed.load_state_dict(state)
    assert resumed.draw() == (5, {"prompt": "s5"})


def test_the_guard_lets_constant_groups_in_after_n_in_a_row_and_warns_once(caplog):
    """max_filtered 4, pps 2, rows: six constant then two with signal, over
    and over. Step 1: four discarded, the next two train (zero advantages).
    Step 2: signal, which re-arms the filter. Step 3: the same as step 1,
    with no second warning."""
    caplog.set_level(logging.WARNING, logger="torchtitan_grpo")
    rows = [{"prompt": f"c{i}"} for i in range(6)] + [{"prompt": "s6"}, {"prompt": "s7"}]
    (first, second, third), _ = _steps(_producer(rows, 2, max_filtered=4), 3)
    for batch in (first, third):
        assert batch.metrics["rollout/filtered_groups"] == 4
        assert batch.metrics["rollout/constant_groups"] == 2
        assert len(batch.samples) == 2 * GROUP and all(s.advantage == 0 for s in batch.samples)
    assert sorted(first.indices) != [0, 1] and max(first.indices) <= 5
    assert second.metrics["rollout/filtered_groups"] == 0 and _prompts(second) == ["s6", "s7"]
    warnings = [r.getMessage() for r in caplog.records if "dynamic sampling" in r.getMessage()]
    assert len(warnings) == 1 and "4 groups in a row" in warnings[0]
    assert "grpo.dynamic_sampling_max_filtered" in warnings[0]


def test_off_filtering_shrinks_the_batch_as_before():
    """dynamic_sampling off, filter_constant_groups on: the step takes the
    first groups whatever their rewards, constant ones empty and counted."""
    rows = [{"prompt": p} for p in ("s0", "c1", "c2", "s3")]
    (batch,), _ = _steps(_producer(rows, 3, dynamic=False, filter_constant=True), 1)
    assert sorted(batch.indices) == [0, 1, 2]
    assert _prompts(batch) == ["s0"] and len(batch.samples) == GROUP
    assert batch.metrics["rollout/constant_groups"] == 2
    assert "rollout/filtered_groups" not in batch.metrics


def test_off_without_filtering_constant_groups_train_with_zero_advantages():
    rows = [{"prompt": p} for p in ("c0", "s1")]
    (batch,), _ = _steps(_producer(rows, 2, dynamic=False), 1)
    assert _prompts(batch) == ["c0", "s1"] and len(batch.samples) == 2 * GROUP
    assert all(s.advantage == 0 for s in batch.samples if s.prompt_ids == [ord("c"), ord("0")])


# ---- the decision ----------------------------------------------------------- #


def test_the_sampler_counts_in_a_row_and_since_the_last_take():
    ds = DynamicSampler(2, prompts_per_step=8)
    assert [ds.keep(c) for c in (True, True, True, False, True)] == [False, False, True, True, False]
    assert ds.take_filtered() == 3 and ds.take_filtered() == 0
    assert ds.in_a_row == 1


def test_max_filtered_defaults_to_ten_steps_of_prompts():
    assert resolve_max_filtered(0, 16) == 160
    assert resolve_max_filtered(7, 16) == 7
    with pytest.raises(ValueError, match="dynamic_sampling_max_filtered"):
        resolve_max_filtered(-1, 16)


# ---- configuration ---------------------------------------------------------- #


def _cfg(*args: str):
    return parse_config(["--job.config_file", DEMO, *args])


@pytest.mark.parametrize("args, match", [
    (("--grpo.dynamic_sampling_max_filtered", "-1"), r"grpo\.dynamic_sampling_max_filtered = -1: must be >= 0"),
    (("--grpo.dynamic_sampling", "--rollout.source", "atropos"),
     r"grpo\.dynamic_sampling = True: needs rollout\.source = \"builtin\""),
])
def test_config_checks_fail_in_one_line_naming_the_key(args, match):
    with pytest.raises(ConfigError, match=match) as e:
        _cfg(*args)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("args, expected", [
    ((), None),
    (("--grpo.dynamic_sampling",), 160),  # the demo: prompts_per_step 16
    (("--grpo.dynamic_sampling", "true", "--grpo.dynamic_sampling_max_filtered", "5"), 5),
])
def test_the_config_reaches_the_producer(args, expected):
    from torchtitan_grpo import session
    from torchtitan_grpo.rollout.producer import build_producer

    tok = CharTokenizer()
    producer = build_producer(session.producer_spec(_cfg(*args), "", tok, None), None, None, tokenizer=tok)
    assert (producer._sampler.max_filtered if producer._sampler else None) == expected
