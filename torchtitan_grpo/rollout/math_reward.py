"""The ``"math"`` reward: final-answer equivalence checked by math-verify.

``math_reward(prompt, completion, row)`` is 1.0 iff the completion's final
answer equals ``row["answer"]`` mathematically (``1/2`` == ``0.5`` ==
``\\frac{1}{2}``, ``1,234`` == ``1234``), else 0.0. The gold may be a GSM8K
solution (``"... #### 42"``: the part after ``####`` is the answer), a boxed
answer or a bare value. The completion's answer is its last ``\\boxed{}`` if
it has one, else the final answer expression math-verify finds (an "answer
is ..." phrase, else the last number or LaTeX expression in the text).

Timeouts. math-verify bounds its own work with ``signal.alarm``, which only
works in the main thread; :func:`~torchtitan_grpo.rollout.rewards.score_all`
runs rewards in worker threads, where math-verify's default timeouts raise
instead of scoring. So both calls here pass ``None`` (no signal), and the time
bound is ``score_all``'s per-call timeout. That timeout can only abandon a call
that lets other threads run, and sympy evaluating a huge integer
(``9^{9^{9^9}}``, ``10^8!``) runs inside one C call that holds the GIL and
freezes the whole process. :func:`_too_big` therefore bounds the size of every
parsed answer before it is evaluated: no real answer has 10,000 digits.
(math-verify logs one warning that its timeout is disabled; it is, on purpose.)
"""

from __future__ import annotations

import functools
import logging
import math
import re
from typing import Any

MAX_ANSWER_DIGITS = 10_000
"""A parsed answer that may evaluate to a number with more digits scores 0.0
without being evaluated (see the module docstring)."""

MAX_COMPLETION_CHARS = 8_000
"""Only the last this-many characters of a completion are searched: math-verify's
regexes and LaTeX parser are slow on very long text, and the answer is at the end."""


# LaTeX commands that math-verify's parser evaluates while parsing (binomial,
# Gamma, gcd/lcm, matrix builders, det, floor), before _too_big can look at the
# result; and what can make their arguments huge (powers, factorials, products,
# long literals). A completion holding both scores 0.0 unparsed.
_EAGER_COMMANDS = re.compile(
    r"\\(?:[dt]?binom|choose|Gamma|gamma|operatorname|det|gcd|lcm|[lr]?floor|[lr]?ceil)(?![a-zA-Z])"
)
_HUGE_ARGUMENT = re.compile(r"\^|!|\*|\\times|\\cdot|\d{5}")


@functools.lru_cache(maxsize=1)
def _mv() -> Any:
    """math-verify and the extraction configs, imported on first use (sympy
    takes about half a second to import; most runs never grade math)."""
    try:
        import math_verify
        from latex2sympy2_extended import NormalizationConfig
    except ImportError as e:
        raise ImportError(
            "reward 'math' needs the math-verify package: pip install math-verify"
        ) from e
    # Its signal-based timeouts are off on purpose (rewards run off the main
    # thread; score_all bounds each call): its warning that they are off, printed
    # once per process and per module, would be the run's only noise.
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)
    latex = math_verify.LatexExtractionConfig(
        # Boxed first (priority 0 beats "final answer is ..." phrases), and the
        # last box wins when a completion boxes several things.
        boxed_match_priority=0,
        normalization_config=NormalizationConfig(
            basic_latex=True, units=True, malformed_operators=True, nits=True,
            boxed="last", equations=False,
        ),
    )
    return math_verify, (latex, math_verify.ExprExtractionConfig())


def gold_answer_text(answer: object) -> str:
    """The final answer in a reference: the text after the last ``####`` (GSM8K),
    else the whole reference, stripped."""
    text = str(answer)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return text.strip()


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple:
    """The gold answer parsed once: every sample of a group shares it."""
    mv, configs = _mv()
    # Boxing the bare gold makes LaTeX ("\frac{1}{2}") and plain ("1,234")
    # answers go through one path; a gold that is already marked keeps its mark.
    text = gold if "\\boxed" in gold else f"\\boxed{{{gold}}}"
    parsed = mv.parse(text, extraction_config=configs, parsing_timeout=None)
    if not parsed:
        parsed = mv.parse(gold, extraction_config=configs, parsing_timeout=None)
    return tuple(parsed)


@functools.lru_cache(maxsize=1)
def _fast_growing() -> tuple:
    """sympy functions whose value has about ``n`` digits for an ``n``-sized argument."""
    import sympy

    return (
        sympy.Sum, sympy.Product, sympy.factorial, sympy.factorial2, sympy.subfactorial, sympy.gamma,
        sympy.binomial, sympy.RisingFactorial, sympy.FallingFactorial,
        sympy.fibonacci, sympy.lucas, sympy.bell, sympy.catalan,
    )


def _digits(expr: Any, depth: int = 0) -> float:
    """An upper bound on the decimal digits of the value ``expr`` evaluates to
    (its size, not its value: pure structure, nothing is evaluated). ``inf`` if
    it cannot be bounded cheaply."""
    import sympy

    if depth > 200:
        return math.inf
    if isinstance(expr, sympy.MatrixBase):
        return max((_digits(e, depth + 1) for e in expr), default=0.0)
    if not isinstance(expr, sympy.Basic):
        return 0.0  # a fallback string: compared as text
    if isinstance(expr, sympy.Rational):  # Integer too
        return max(abs(expr.p).bit_length(), expr.q.bit_length()) * 0.302 + 1
    if isinstance(expr, sympy.Float):
        return 0.0  # fixed precision: arithmetic on it is cheap whatever its size
    if not expr.args:
        return 1.0  # a symbol or a constant (pi, E)
    sizes = [_digits(a, depth + 1) for a in expr.args]
    if isinstance(expr, sympy.Pow):
        base, exponent = sizes
        if exponent > 6:
            return math.inf  # |exponent| may be over a million
        e = expr.args[1]
        if isinstance(e, sympy.Rational):  # the usual case: the exact |exponent|
            return base * max(abs(e.p), 1)
        return base * 10.0**exponent
    if isinstance(expr, (sympy.Function, *_fast_growing())):
        n = max(sizes)
        if n > 6:
            return math.inf  # f(10^7) is no answer, and f may be factorial-like
        if isinstance(expr, _fast_growing()):
            return 10.0**n * n  # n! has about n*log10(n) digits
        return sum(sizes)
    if isinstance(expr, sympy.Add):
        return max(sizes) + 1
    # Products, and anything else (functions, sets, relations): the sum bounds
    # a product's size and over-estimates everything else, which is safe.
    return sum(sizes)


def _too_big(parsed: list | tuple) -> bool:
    return any(_digits(p) > MAX_ANSWER_DIGITS for p in parsed)


def math_reward(prompt: str, completion: str, row: dict) -> float:
    """1.0 iff the completion's final answer equals ``row["answer"]`` (math-verify).

    Safe in any thread (no signals); unbounded in time by itself: call it
    through ``score_all`` for a per-call timeout.
    """
    mv, configs = _mv()
    gold = _parse_gold(gold_answer_text(row["answer"]))
    if not gold or _too_big(gold):
        return 0.0
    text = completion[-MAX_COMPLETION_CHARS:]
    if _EAGER_COMMANDS.search(text) and _HUGE_ARGUMENT.search(text):
        return 0.0
    predicted = mv.parse(text, extraction_config=configs, parsing_timeout=None)
    if not predicted or _too_big(predicted):
        return 0.0
    return 1.0 if mv.verify(list(gold), predicted, timeout_seconds=None) else 0.0


__all__ = ["MAX_ANSWER_DIGITS", "gold_answer_text", "math_reward"]
