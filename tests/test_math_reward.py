"""The "math" reward (math-verify, off the main thread, bounded) and the
generated arithmetic task it grades."""

import json
import re
import subprocess
import sys
import threading

import pytest

from torchtitan_grpo.rollout import rewards as R
from torchtitan_grpo.rollout.arith_task import KINDS, make_arith_splits
from torchtitan_grpo.rollout.math_reward import gold_answer_text, math_reward

GSM_GOLD = "She sells 16-3-4=<<16-3-4=9>>9 eggs.\nShe earns 9*2=$<<9*2=18>>18.\n#### 18"


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("So she makes \\boxed{18} dollars.", GSM_GOLD, 1.0),
        ("She sells 9 eggs at $2 each, so the answer is 18.", GSM_GOLD, 1.0),  # unboxed final answer
        ("9 * 2 = 18\n#### 18", GSM_GOLD, 1.0),
        ("\\boxed{19}", GSM_GOLD, 0.0),
        ("So 18 eggs... no: the answer is 19.", GSM_GOLD, 0.0),  # the final answer counts
        ("\\boxed{18} is wrong, it is 17", GSM_GOLD, 1.0),  # boxed beats a later number
        ("I am not sure.", GSM_GOLD, 0.0),
        ("", GSM_GOLD, 0.0),
        ("\\boxed{18", GSM_GOLD, 0.0),  # cut off mid-box
        ("\\boxed{1/2}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("The answer is 0.50", "1/2", 1.0),
        ("\\boxed{0.6}", "1/2", 0.0),
        ("\\boxed{1,234}", "1234", 1.0),
        ("\\boxed{-7}", "-7", 1.0),
        ("\\boxed{7}", "-7", 0.0),
        ("\\boxed{\\sqrt{2}/2}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("\\boxed{2^{10}}", "1024", 1.0),
    ],
)
def test_math_reward(completion, gold, expected):
    assert math_reward("q", completion, {"answer": gold}) == expected


def test_math_is_a_builtin_and_the_old_grader_keeps_its_name():
    assert R.load_reward_fn("math") is math_reward
    assert R.load_reward_fn("math_answer") is R.math_answer
    assert gold_answer_text(GSM_GOLD) == "18" and gold_answer_text(" 42 ") == "42"


def test_math_reward_in_a_worker_thread():
    # math-verify's default signal timeouts raise outside the main thread.
    results = []
    row = {"answer": "#### 56"}

    def grade():
        results.append(math_reward("q", "7 * 8 = 56, so \\boxed{56}.", row))
        results.append(math_reward("q", "\\boxed{57}", row))

    t = threading.Thread(target=grade)
    t.start()
    t.join(timeout=120)  # hang guard only
    assert results == [1.0, 0.0]
    assert R.score_all(math_reward, [("q", "\\boxed{56}", row), ("q", "55", row)]) == [1.0, 0.0]


_PATHOLOGICAL = [
    "\\boxed{9^{9^{9^{9}}}}",  # sympy would evaluate a number of ~10^8 digits
    "The answer is 9**9**9**9",
    "\\boxed{100000000!}",
    "\\boxed{\\binom{100000000}{50000000}}",  # evaluated while parsing
    "\\boxed{\\Gamma(100000000)}",
    "\\boxed{((9^{99})^{99})^{99}}",
]


def test_pathological_answers_score_zero_without_freezing_the_process():
    # Each of these holds the GIL in one C call for minutes if it reaches
    # sympy, so no thread timeout could stop it: run them in a child process
    # through score_all and let only the child hang.
    code = (
        "import json, sys\n"
        "from torchtitan_grpo.rollout.rewards import score_all\n"
        "from torchtitan_grpo.rollout.math_reward import math_reward\n"
        "items = [('q', c, {'answer': '#### 42'}) for c in json.loads(sys.argv[1])]\n"
        "print(json.dumps(score_all(math_reward, items, timeout_s=30)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(_PATHOLOGICAL)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [0.0] * len(_PATHOLOGICAL)


def test_slow_parse_is_bounded_by_score_all():
    # Nested braces make math-verify's LaTeX parser slow (pure Python, so the
    # per-call timeout can abandon it); the next item is still scored.
    row = {"answer": "3"}
    slow = "$" + "{" * 120 + "$"
    assert R.score_all(math_reward, [("q", slow, row), ("q", "\\boxed{3}", row)], timeout_s=0.2) == [0.0, 1.0]


# --------------------------------------------------------------------------
# The generated arithmetic task
# --------------------------------------------------------------------------


def _value(answer: str) -> int:
    working, final = answer.split("\n#### ")
    expr, shown = working.rsplit(" = ", 1)
    assert re.fullmatch(r"[\d +*-]+", expr), expr
    assert int(shown) == int(final)
    return eval(expr)  # plain integer arithmetic checked by the regex above


@pytest.mark.parametrize("kind", KINDS)
def test_arith_splits_are_disjoint_deterministic_and_correct(kind):
    train, held_out = make_arith_splits(300, 60, seed=3, kind=kind)
    assert len(train) == 300 and len(held_out) == 60
    assert make_arith_splits(300, 60, seed=3, kind=kind) == (train, held_out)
    assert make_arith_splits(300, 60, seed=4, kind=kind) != (train, held_out)
    # The same problem never appears in both (nor twice in one split).
    prompts = [r["prompt"] for r in train + held_out]
    assert len(set(prompts)) == len(prompts)
    for row in train + held_out:
        assert row["prompt"].endswith("\\boxed{}.")
        final = int(row["answer"].rsplit("#### ", 1)[1])
        assert final == _value(row["answer"]) and final >= 0
        numbers = [int(n) for n in re.findall(r"\d+", row["prompt"].split("\n")[0])]
        assert numbers, row  # the question carries its operands


def test_gold_scores_one_on_every_eval_row_and_off_by_one_scores_zero():
    _, held_out = make_arith_splits(0, 100, seed=0, kind="mix")
    for row in held_out:
        final = int(gold_answer_text(row["answer"]))
        assert math_reward(row["prompt"], f"So the answer is \\boxed{{{final}}}.", row) == 1.0
        assert math_reward(row["prompt"], f"\\boxed{{{final + 1}}}", row) == 0.0


def test_arith_errors_name_the_problem():
    with pytest.raises(ValueError, match="kind 'cube'"):
        make_arith_splits(1, 1, kind="cube")
    with pytest.raises(ValueError, match="only .* distinct problems"):
        make_arith_splits(5000, 0, kind="mul")


def test_make_arith_dataset_script(tmp_path):
    from scripts.make_arith_dataset import main

    main(["--out-dir", str(tmp_path), "--train", "20", "--eval", "5", "--seed", "1"])
    rows = {
        split: [json.loads(line) for line in (tmp_path / f"{split}.jsonl").read_text().splitlines()]
        for split in ("train", "eval")
    }
    assert (rows["train"], rows["eval"]) == make_arith_splits(20, 5, seed=1)
