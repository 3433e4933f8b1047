"""Per-prompt generation budgets: a dataset row's ``max_new_tokens``, capped
by ``rollout.max_new_tokens`` (rollout/prompt_budget.py, the producer)."""

from __future__ import annotations

import json

import pytest

from tests.producer_stubs import CharTokenizer, ListSource, started
from torchtitan_grpo.aio import LoopThread
from torchtitan_grpo.fleet.types import Completion, SamplingParams
from torchtitan_grpo.rollout.groups import GroupScorer
from torchtitan_grpo.rollout.ledger import PromptLedger
from torchtitan_grpo.train.importance import select_samples
from torchtitan_grpo.rollout.prompt_budget import check_budgets, fit_budget, group_budget
from torchtitan_grpo.rollout.producer import ProducerSpec, ProducerStopped, RolloutProducer, build_producer
from torchtitan_grpo.rollout.tasks import PromptIterator

CAP = 6  # rollout.max_new_tokens
NATURAL = 4  # the stand-in engine's completions end (EOS) after this many tokens


class BudgetPool:
    """Answers like an engine: up to ``NATURAL`` tokens, cut at the request's
    ``max_new_tokens`` with finish reason "length"; records each prompt's budget."""

    def __init__(self):
        self.budgets: dict[str, int] = {}

    async def generate(self, ids, n, params: SamplingParams):
        self.budgets["".join(chr(i) for i in ids)] = params.max_new_tokens
        k = min(NATURAL, params.max_new_tokens)
        reason = "length" if params.max_new_tokens <= NATURAL else "stop"
        return [Completion([97 + j] * k, [-0.5] * k, reason, "0", ["0"]) for j in range(n)]

    def metrics(self):
        return {}


def test_a_row_budget_is_capped_by_the_config_and_defaults_to_it():
    assert group_budget({"prompt": "x", "max_new_tokens": 3}, CAP) == 3
    assert group_budget({"prompt": "x", "max_new_tokens": 50}, CAP) == CAP
    assert group_budget({"prompt": "x"}, CAP) == CAP
    assert group_budget({"prompt": "x", "max_new_tokens": None}, CAP) == CAP  # a column missing from this row


@pytest.mark.parametrize("bad", [0, -3, 2.5, "16", True])
def test_a_bad_budget_fails_naming_the_field_and_the_row(bad):
    rows = [{"prompt": "a", "max_new_tokens": 4}, {"prompt": "b"}, {"prompt": "c", "max_new_tokens": bad}]
    with pytest.raises(ValueError, match=r"^data\.jsonl: row 2: field 'max_new_tokens' must be a positive integer"):
        check_budgets(rows, "data.jsonl")
    with pytest.raises(ValueError, match="max_new_tokens"):
        group_budget(rows[2], CAP)
    check_budgets(rows[:2], "data.jsonl")  # good rows pass


def test_build_producer_checks_the_dataset_at_start(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in
                            [{"prompt": "a", "max_new_tokens": 8}, {"prompt": "b", "max_new_tokens": -1}]))
    spec = ProducerSpec(hf_dir="", task="jsonl", dataset_path=str(path), prompt_key="prompt", reward_fn="",
                        prompts_per_step=1, group_size=2, seed=0, depth=0, sampling=SamplingParams(max_new_tokens=CAP),
                        scale_rewards=True, filter_constant_groups=False, reward_timeout_s=5.0, use_chat_template=False)
    with pytest.raises(ValueError, match=r"rollout\.dataset_path .*prompts\.jsonl.*row 1: field 'max_new_tokens'"):
        build_producer(spec, None, None, tokenizer=CharTokenizer())


def test_each_group_generates_at_its_own_budget_and_a_cut_counts_as_truncated():
    """Rows with budgets 2 (cut), 5 (ends first), 9 (capped at 6) and none
    (6): the engine is asked for each; only the cut group is truncated, and
    ``grpo.mask_truncated`` drops exactly its samples."""
    rows = [{"prompt": "p2", "max_new_tokens": 2}, {"prompt": "p5", "max_new_tokens": 5},
            {"prompt": "p9", "max_new_tokens": 9}, {"prompt": "pn"}]
    check_budgets(rows, "rows")
    pool, loop = BudgetPool(), LoopThread()
    scorer = GroupScorer(CharTokenizer(), lambda p, c, r: float(c.startswith("a")), group_size=2)
    prod = RolloutProducer(loop, pool, PromptLedger(PromptIterator(rows, 4, seed=0)), scorer, prompts_per_step=4,
                           depth=0, sampling=SamplingParams(max_new_tokens=CAP))
    with started(prod):
        batch = prod.next_batch()
    assert pool.budgets == {"p2": 2, "p5": 5, "p9": CAP, "pn": CAP}
    lengths = {"".join(map(chr, s.prompt_ids)): (len(s.completion_ids), s.finish_reason) for s in batch.samples}
    assert lengths == {"p2": (2, "length"), "p5": (NATURAL, "stop"), "p9": (NATURAL, "stop"), "pn": (NATURAL, "stop")}
    assert batch.metrics["rollout/truncated_frac"] == pytest.approx(2 / 8)
    assert batch.metrics["rollout/completion_len_max"] == NATURAL
    kept, m = select_samples(batch.samples, 0, max_staleness=1, mask_truncated=True)
    assert m["offpolicy/truncated_dropped"] == 2
    assert sorted({"".join(map(chr, s.prompt_ids)) for s in kept}) == ["p5", "p9", "pn"]


# ---- the sequence limit: training.seq_len / inference.max_model_len ----------- #


def test_fit_budget_leaves_the_prompt_room_under_the_limit():
    assert fit_budget(5, 6, 0) == 6  # no limit
    assert fit_budget(2, 6, 8) == 6
    assert fit_budget(5, 6, 8) == 3
    assert fit_budget(7, 6, 8) == 1
    assert fit_budget(8, 6, 8) is None and fit_budget(20, 6, 8) is None


def _producer(rows, limit, pps, pool=None):
    scorer = GroupScorer(CharTokenizer(), lambda p, c, r: float(c.startswith("a")), group_size=2)
    ledger = PromptLedger(ListSource(rows))
    return RolloutProducer(LoopThread(), pool or BudgetPool(), ledger, scorer, prompts_per_step=pps, depth=0,
                           sampling=SamplingParams(max_new_tokens=CAP), max_sequence_tokens=limit)


def test_a_long_prompt_is_skipped_and_a_budget_cut_to_fit_the_sequence_limit():
    """Limit 8 tokens: "ab" keeps the config's 6, "cd" (its row asks 9) gets 6,
    "efgh" gets 4; the 10- and 8-token prompts leave no room: never sent,
    counted, and handed in the ledger (a resume draws the next row)."""
    rows = [{"prompt": "ab"}, {"prompt": "x" * 10}, {"prompt": "cd", "max_new_tokens": 9}, {"prompt": "y" * 8},
            {"prompt": "efgh"}, {"prompt": "next"}]
    pool = BudgetPool()
    prod = _producer(rows, 8, 3, pool)
    with started(prod):
        batch = prod.next_batch()
        state = prod.state_dict()
    assert pool.budgets == {"ab": 6, "cd": 6, "efgh": 4}
    assert all(len(s.prompt_ids) + len(s.completion_ids) <= 8 for s in batch.samples)
    assert batch.metrics["rollout/skipped_long_prompts"] == 2
    resumed = PromptLedger(ListSource(rows))
    resumed.load_state_dict(state)
    assert resumed.draw() == (5, {"prompt": "next"})


def test_a_limit_below_every_prompt_stops_the_run_in_one_line():
    prod = _producer([{"prompt": "longer than four"}, {"prompt": "also too long"}], 4, 2)
    prod.MAX_SKIPPED_IN_A_ROW = 25
    with started(prod):
        with pytest.raises(ProducerStopped, match=r"25 prompts in a row left no room .* training\.seq_len / inference\.max_model_len \(4 tokens; the last had 1[36]\)"):
            prod.next_batch()


@pytest.mark.parametrize("args, expected", [
    ((), 64),  # the demo's training.seq_len
    (("--training.seq_len", "40"), 40),
    (("--inference.max_model_len", "32"), 32),  # the started servers' context, when smaller
    (("--inference.max_model_len", "128"), 64),
])
def test_the_sequence_limit_reaches_the_producer(args, expected):
    import os

    from torchtitan_grpo import session
    from torchtitan_grpo.config.parse import parse_config

    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train_configs", "demo_cpu.toml")
    tok = CharTokenizer()
    spec = session.producer_spec(parse_config(["--job.config_file", demo, *args]), "", tok, None)
    assert build_producer(spec, None, None, tokenizer=tok).max_sequence_tokens == expected
