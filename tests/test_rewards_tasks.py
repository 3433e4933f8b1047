"""Built-in rewards, reward loading and safe scoring, prompt files, the demo task."""

import itertools
import json
import logging
import os
import threading

import pytest

from torchtitan_grpo.rollout import rewards as R
from torchtitan_grpo.rollout.tasks import (
    DIGITS_MAP,
    PromptIterator,
    digits_reward,
    digits_task_rows,
    load_prompts,
)

DATA = os.path.join(os.path.dirname(__file__), "data", "gsm8k_sample.jsonl")


# --------------------------------------------------------------------------
# math_answer / format_reward / exact_match
# --------------------------------------------------------------------------

GSM_GOLD = "She sells 16-3-4=<<16-3-4=9>>9 eggs.\nShe earns 9*2=$<<9*2=18>>18.\n#### 18"


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("9 eggs, 9*2 = 18.\n#### 18", GSM_GOLD, 1.0),
        ("So she makes \\boxed{18} dollars.", GSM_GOLD, 1.0),
        ("#### $18.00", GSM_GOLD, 1.0),
        ("#### 18 dollars", GSM_GOLD, 1.0),  # trailing units
        ("#### 19", GSM_GOLD, 0.0),
        ("She earns 18 dollars.", GSM_GOLD, 0.0),  # unmarked answer does not count
        ("#### 1234", "#### 1,234", 1.0),  # thousands separator in the gold
        ("\\boxed{1,234}", "1234", 1.0),
        ("\\boxed{1\\,234}", "1234", 1.0),  # LaTeX thin-space separator
        ("#### -7", "-7", 1.0),
        ("#### 7", "-7", 0.0),  # the sign matters
        ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
        ("\\boxed{3/4}", "\\frac{3}{4}", 1.0),
        ("\\boxed{0.7}", "3/4", 0.0),
        ("#### 2.50", "2.5", 1.0),
        ("#### 2.05", "2.5", 0.0),
        ("\\boxed{50\\%}", "50", 1.0),
        ("\\boxed{5\\text{ cm}}", "5", 1.0),
        ("\\boxed{x = 5}", "5", 1.0),
        # Nested braces: the whole \frac{..}{..} is the answer, not "\frac{1".
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("\\boxed{1}", "\\frac{1}{\\sqrt{2}}", 0.0),
        # Last boxed wins; an unclosed box (cut-off output) is no answer.
        ("first \\boxed{3} then \\boxed{4}", "4", 1.0),
        ("\\boxed{4", "4", 0.0),
        ("#### \n", "4", 0.0),
        ("\\boxed{x+1}", "x + 1", 1.0),  # non-numeric: whitespace-free text
    ],
)
def test_math_answer(completion, gold, expected):
    assert R.math_answer("q", completion, {"answer": gold}) == expected


def test_math_answer_on_every_gsm8k_sample_row():
    rows = load_prompts(DATA, prompt_key="question")
    for row in rows:
        final = row["answer"].split("####")[-1].strip()
        assert R.math_answer(row["prompt"], f"... so \\boxed{{{final}}}", row) == 1.0
        # Off by one is wrong (also for decimals and negatives).
        wrong = R.parse_number(final) + 1
        assert R.math_answer(row["prompt"], f"#### {float(wrong)}", row) == 0.0


def test_parse_number():
    F = R.parse_number
    assert F("1,234,567.5") == 1234567.5
    assert F("\u22123") == -3  # unicode minus
    assert F("-\\frac{3}{4}") == -0.75
    assert F("\\frac34") == 0.75
    assert F("$ 12") == 12 and F("12 apples") == 12
    assert F("no digits") is None and F("2\\pi") is None and F("1/0") is None


def test_format_and_exact_match():
    assert R.format_reward("", "reasoning \\boxed{12}", {}) == 1.0
    assert R.format_reward("", "reasoning\n#### 12", {}) == 1.0
    assert R.format_reward("", "the answer is 12", {}) == 0.0
    assert R.format_reward("", "\\boxed{12", {}) == 0.0
    assert R.exact_match("", "  Paris \n", {"answer": "Paris"}) == 1.0
    assert R.exact_match("", "paris", {"answer": "Paris"}) == 0.0


# --------------------------------------------------------------------------
# load_reward_fn
# --------------------------------------------------------------------------


def test_load_reward_fn_resolves_builtins_and_modules():
    assert R.load_reward_fn("math_answer") is R.math_answer
    assert R.load_reward_fn("torchtitan_grpo.rollout.rewards:format_reward") is R.format_reward
    assert R.load_reward_fn("os.path:join") is os.path.join
    assert R.load_reward_fn("json:JSONDecoder.decode") is json.JSONDecoder.decode


@pytest.mark.parametrize(
    "spec, exc, words",
    [
        ("math_answr", ValueError, "package.module:function"),
        ("a.b:c:d", ValueError, "package.module:function"),
        (":f", ValueError, "package.module:function"),
        ("json:", ValueError, "package.module:function"),
        ("no_such_pkg_xyz.mod:f", ModuleNotFoundError, "not found"),
        ("json:no_such_function", AttributeError, "no attribute 'no_such_function'"),
        ("math:pi", TypeError, "not callable"),
    ],
)
def test_load_reward_fn_errors_name_the_spec(spec, exc, words):
    with pytest.raises(exc) as info:
        R.load_reward_fn(spec)
    assert repr(spec) in str(info.value) and words in str(info.value)


def test_load_reward_fn_keeps_import_errors_inside_user_module(tmp_path, monkeypatch):
    (tmp_path / "user_reward_broken.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError) as info:
        R.load_reward_fn("user_reward_broken:score")
    # The user's module exists; what is missing is its dependency.
    assert "no_such_dependency_xyz" in str(info.value)
    assert "module 'user_reward_broken' not found" not in str(info.value)


# --------------------------------------------------------------------------
# score_all
# --------------------------------------------------------------------------


def _items(n):
    return [("p", str(i), {"i": i}) for i in range(n)]


def test_score_all_runs_off_thread_and_keeps_order():
    caller = threading.get_ident()
    seen = []

    def reward(prompt, completion, row):
        seen.append(threading.get_ident())
        return row["i"] * 0.5

    assert R.score_all(reward, _items(4), timeout_s=5) == [0.0, 0.5, 1.0, 1.5]
    assert seen and caller not in seen


def test_raising_reward_scores_zero_and_is_logged_once(caplog):
    def flaky_reward(prompt, completion, row):
        if row["i"] % 2:
            raise KeyError(f"missing field for sample {row['i']}")  # message varies
        return 1.0

    with caplog.at_level(logging.WARNING, logger="torchtitan_grpo.rewards"):
        first = R.score_all(flaky_reward, _items(6), timeout_s=5)
        second = R.score_all(flaky_reward, _items(4), timeout_s=5)  # a later step
    assert first == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert second == [1.0, 0.0, 1.0, 0.0]
    records = [r for r in caplog.records if r.name == "torchtitan_grpo.rewards"]
    assert len(records) == 1
    assert "KeyError" in records[0].getMessage() and "flaky_reward" in records[0].getMessage()
    assert records[0].exc_info is not None  # traceback attached
    assert "raise KeyError" in caplog.text


def test_reward_calling_sys_exit_does_not_stop_scoring():
    def exits(prompt, completion, row):
        if row["i"] == 0:
            raise SystemExit(3)
        return 1.0

    assert R.score_all(exits, _items(3), timeout_s=5) == [0.0, 1.0, 1.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1.0", None, [1.0]])
def test_non_finite_or_non_number_scores_zero(bad, caplog):
    def odd_reward(prompt, completion, row):
        return bad if row["i"] == 1 else True  # bool is a number (1.0)

    with caplog.at_level(logging.WARNING, logger="torchtitan_grpo.rewards"):
        assert R.score_all(odd_reward, _items(3)) == [1.0, 0.0, 1.0]
    assert any("odd_reward" in r.getMessage() for r in caplog.records)


def test_hanging_reward_times_out_and_the_rest_is_scored(caplog):
    release = threading.Event()
    returned: list[int] = []  # rows whose hanging call has come back

    def sometimes_hangs(prompt, completion, row):
        if row["i"] in (1, 2):
            release.wait(120)  # "hangs" until the test lets it go (a hang guard only)
            returned.append(row["i"])
        return 1.0

    try:
        with caplog.at_level(logging.WARNING, logger="torchtitan_grpo.rewards"):
            scores = R.score_all(sometimes_hangs, _items(4), timeout_s=0.2)
            hung_at_return = list(returned)
    finally:
        release.set()
    assert scores == [1.0, 0.0, 0.0, 1.0]
    assert hung_at_return == []  # scored without waiting for either hanging call
    timeouts = [r for r in caplog.records if "did not return" in r.getMessage()]
    assert len(timeouts) == 1


# --------------------------------------------------------------------------
# prompt files and the batch iterator
# --------------------------------------------------------------------------


def test_load_gsm8k_jsonl_with_prompt_key():
    rows = load_prompts(DATA, prompt_key="question")
    assert 25 <= len(rows) <= 40
    for row in rows:
        assert row["prompt"] == row["question"] and "####" in row["answer"]
    finals = {r["answer"].split("####")[-1].strip() for r in rows}
    assert any("," in f for f in finals)
    assert any(f.startswith("-") for f in finals)
    assert any("." in f for f in finals)


def test_load_parquet_and_json(tmp_path):
    import datasets

    data = {"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}
    parquet = str(tmp_path / "p.parquet")
    datasets.Dataset.from_dict(data).to_parquet(parquet)
    assert load_prompts(parquet) == [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": "2+2=", "answer": "4"},
    ]
    as_json = tmp_path / "p.json"
    as_json.write_text(json.dumps([{"prompt": "1+1=", "answer": "2"}]))
    assert load_prompts(str(as_json)) == [{"prompt": "1+1=", "answer": "2"}]


def test_load_prompts_errors_name_the_file(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts(missing)
    with pytest.raises(ValueError, match=r"\.csv"):
        load_prompts(str(tmp_path / "x.csv"))
    with pytest.raises(KeyError) as info:
        load_prompts(DATA)  # its text column is "question", not "prompt"
    assert "gsm8k_sample.jsonl" in str(info.value) and "'prompt'" in str(info.value)


def test_prompt_iterator_epochs_and_resume():
    rows = [{"prompt": str(i)} for i in range(5)]
    it = PromptIterator(rows, batch_size=3, seed=7)
    batches = [it.next_batch() for _ in range(5)]  # 15 rows = 3 epochs
    flat = [r["prompt"] for b in batches for r in b]
    for epoch in range(3):
        assert sorted(flat[epoch * 5 : epoch * 5 + 5]) == ["0", "1", "2", "3", "4"]
    assert flat[:5] != flat[5:10]  # a new shuffle per epoch
    assert flat != [str(i % 5) for i in range(15)]  # and actually shuffled
    # Same seed -> same order; position survives a state_dict round trip.
    again = PromptIterator(rows, batch_size=3, seed=7)
    again.next_batch(); again.next_batch()  # noqa: E702
    state = json.loads(json.dumps(again.state_dict()))
    assert state == {"epoch": 1, "index": 1, "seed": 7}
    resumed = PromptIterator(rows, batch_size=3, seed=7)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(3)] == batches[2:]
    with pytest.raises(ValueError, match="seed"):
        PromptIterator(rows, batch_size=3, seed=8).load_state_dict(state)


# --------------------------------------------------------------------------
# the digits demo task
# --------------------------------------------------------------------------


def test_digits_rows_are_seeded_and_cover_all_digits():
    a = list(itertools.islice(digits_task_rows(seed=3), 200))
    b = list(itertools.islice(digits_task_rows(seed=3), 200))
    assert a == b
    assert {r["prompt"] for r in a} == {f"{d}>" for d in range(10)}
    for r in a:
        assert r["answer"] == DIGITS_MAP[int(r["prompt"][0])]
    assert sorted(DIGITS_MAP) == list("0123456789")  # a permutation
    assert all(DIGITS_MAP[d] != str(d) for d in range(10))  # without fixed points


def test_digits_reward_cannot_be_gamed_by_constant_outputs():
    rows = list(itertools.islice(digits_task_rows(seed=0), 2000))

    def mean_reward(completion_for):
        return sum(digits_reward(r["prompt"], completion_for(r), r) for r in rows) / len(rows)

    # The oracle scores 1; right digit + junk gets half credit.
    assert mean_reward(lambda r: r["answer"]) == 1.0
    assert mean_reward(lambda r: f" {r['answer']}\n") == 1.0
    assert mean_reward(lambda r: r["answer"] + "x") == 0.5
    # Any constant (each digit, empty, the prompt echoed, long junk) is near
    # chance (0.1 for a digit, 0 otherwise), far below the 0.8 "learned" bar.
    constants = [str(d) for d in range(10)] + ["", " ", ">", "0123456789", "7" * 20]
    for c in constants:
        assert mean_reward(lambda r, c=c: c) <= 0.15, c
    assert mean_reward(lambda r: r["prompt"]) <= 0.15  # echoing the prompt
    assert mean_reward(lambda r: r["prompt"][0]) == 0.0  # copying the digit


def test_workers_are_reused_across_calls():
    # A thread per group cost more CPU than a cheap reward (bench: 0.57 -> 0.07 ms a group).
    def ident(prompt, completion, row):
        return threading.get_ident()

    threads = {t for _ in range(20) for t in R.score_all(ident, _items(3), timeout_s=5)}
    assert len(threads) == 1


def test_a_worker_left_in_a_hung_call_is_never_handed_out_again():
    release = threading.Event()

    def hangs_on_first(prompt, completion, row):
        if row.get("hang"):
            release.wait(120)  # a hang guard only: the test releases it
        return 1.0

    try:
        items = [("p", "0", {"hang": True}), ("p", "1", {})]
        assert R.score_all(hangs_on_first, items, timeout_s=0.2) == [0.0, 1.0]
        # The hung worker still runs its call: later batches must not wait behind it.
        for _ in range(3):
            assert R.score_all(hangs_on_first, _items(2), timeout_s=5) == [1.0, 1.0]
    finally:
        release.set()
