"""A generated arithmetic task for small instruct models, GSM8K-shaped.

Rows are ``{"prompt": question, "answer": "<working>\\n#### <value>"}``, the
format of GSM8K's answers, so the ``"math"`` reward and the ``jsonl`` task
read these and any local GSM8K file the same way. The prompt asks for the
final answer in ``\\boxed{}`` (it goes through the model's chat template).

Problems are small on purpose: a 135M instruct model gets a few of them right
zero-shot (it can add two-digit numbers, it slips on carries, precedence and
two-step word problems), so GRPO groups have both right and wrong samples and
there is something to learn within a few hundred steps.

Generation is deterministic in ``seed``; train and eval never share a problem
(each problem's operands, kind and template are its key, and every key is drawn
once across both splits).
"""

from __future__ import annotations

import random
from collections.abc import Callable

INSTRUCTION = "Put your final answer within \\boxed{}."

_NAMES = ("Tom", "Anna", "Ben", "Maria", "Sam", "Lena", "Omar", "Kate", "Leo", "Mia")
_ITEMS = ("apples", "pencils", "stickers", "books", "marbles", "cookies", "cards", "shells")

Problem = tuple[tuple, str, str, int]
"""(key, question, working, value): ``key`` identifies the problem for disjointness."""


def _add_sub(rng: random.Random) -> Problem:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    c = rng.randint(1, a + b - 1)  # the result stays positive
    expr = f"{a} + {b} - {c}"
    return ("add_sub", a, b, c), f"What is {expr}?", expr, a + b - c


def _mul(rng: random.Random) -> Problem:
    a, b = rng.randint(2, 12), rng.randint(11, 99)
    expr = f"{a} * {b}"
    return ("mul", a, b), f"What is {expr}?", expr, a * b


def _two_step(rng: random.Random) -> Problem:
    a, b, c = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 50)
    if rng.random() < 0.5:
        expr, value = f"{a} * {b} + {c}", a * b + c
    else:
        c = min(c, a * b - 1)
        expr, value = f"{a} * {b} - {c}", a * b - c
    return ("two_step", expr), f"What is {expr}?", expr, value


def _word(rng: random.Random) -> Problem:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if rng.random() < 0.5:
        a, b = rng.randint(5, 60), rng.randint(2, 40)
        c = rng.randint(1, a + b - 1)
        question = (
            f"{name} has {a} {item}. {name} gets {b} more {item} and then gives "
            f"{c} {item} to a friend. How many {item} does {name} have now?"
        )
        return ("word_add", name, item, a, b, c), question, f"{a} + {b} - {c}", a + b - c
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    c = rng.randint(1, a * b - 1)
    question = (
        f"{name} buys {a} boxes with {b} {item} in each box and gives away {c} "
        f"{item}. How many {item} are left?"
    )
    return ("word_mul", name, item, a, b, c), question, f"{a} * {b} - {c}", a * b - c


_KINDS: dict[str, Callable[[random.Random], Problem]] = {
    "add_sub": _add_sub,
    "mul": _mul,
    "two_step": _two_step,
    "word": _word,
}
KINDS = (*_KINDS, "mix")
"""Problem kinds; ``"mix"`` draws each problem from one of the others at random."""


def _draw(rng: random.Random, kind: str) -> Problem:
    if kind == "mix":
        kind = rng.choice(tuple(_KINDS))
    return _KINDS[kind](rng)


def make_row(question: str, working: str, value: int) -> dict:
    """One dataset row: the prompt (question + boxed instruction) and a GSM8K answer."""
    return {"prompt": f"{question}\n{INSTRUCTION}", "answer": f"{working} = {value}\n#### {value}"}


def make_arith_splits(
    n_train: int, n_eval: int, seed: int = 0, kind: str = "mix"
) -> tuple[list[dict], list[dict]]:
    """``n_train`` train rows and ``n_eval`` eval rows, no problem in both.

    Draws distinct problems with ``random.Random(seed)``; the first ``n_eval``
    go to eval, so the eval set for a seed does not change with ``n_train``.
    """
    if kind not in KINDS:
        raise ValueError(f"arithmetic task kind {kind!r}: expected one of {list(KINDS)}")
    if n_train < 0 or n_eval < 0:
        raise ValueError(f"arithmetic task sizes must be >= 0, got train={n_train} eval={n_eval}")
    rng = random.Random(seed)
    want = n_train + n_eval
    seen: set[tuple] = set()
    rows: list[dict] = []
    # Each kind has thousands of distinct problems; give up (clearly) if asked
    # for more than the kind can make rather than loop forever.
    for _ in range(50 * want + 1000):
        if len(rows) == want:
            break
        key, question, working, value = _draw(rng, kind)
        if key in seen:
            continue
        seen.add(key)
        rows.append(make_row(question, working, value))
    else:
        if len(rows) < want:
            raise ValueError(
                f"arithmetic task kind {kind!r}: only {len(rows)} distinct problems "
                f"found for train={n_train} + eval={n_eval}; ask for fewer"
            )
    return rows[n_eval:], rows[:n_eval]


__all__ = ["INSTRUCTION", "KINDS", "make_arith_splits", "make_row"]
