"""Reward functions: loading user rewards by name, scoring safely, built-ins.

A reward function is ``fn(prompt, completion, row) -> float``: the prompt text,
the completion text (what the model generated before EOS) and the dataset row
the prompt came from (so it can read ``row["answer"]`` or anything else).

User code is not trusted to behave: :func:`score_all` runs it off the caller's
thread with a per-call timeout, and a reward that raises, hangs or returns
something that is not a finite number scores 0.0 and is logged (once per
distinct failure) instead of stopping the run.
"""

from __future__ import annotations

import importlib
import logging
import math
import numbers
import queue
import re
import threading
import traceback
from collections.abc import Callable, Sequence
from fractions import Fraction

from torchtitan_grpo.rollout.code_task import code_complete
from torchtitan_grpo.rollout.math_reward import math_reward
from torchtitan_grpo.rollout.tasks import digits_reward

RewardFn = Callable[[str, str, dict], float]
"""``fn(prompt_text, completion_text, dataset_row) -> reward``."""

logger = logging.getLogger("torchtitan_grpo.rewards")


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------


def load_reward_fn(spec: str) -> RewardFn:
    """Resolve ``"pkg.module:function"`` (or a built-in name) to a callable.

    Built-in names: see :data:`BUILTIN_REWARDS`. ``function`` may be a dotted
    path inside the module (``"pkg.mod:Class.method"``). Every error names
    ``spec``.
    """
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path or ":" in attr_path:
        raise ValueError(
            f"reward function {spec!r}: expected 'package.module:function' "
            f"or a built-in name {sorted(BUILTIN_REWARDS)}"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Only report "not found" for the module itself; an ImportError raised
        # from inside the user's module is a bug there and keeps its own message.
        if e.name is not None and (module_name + ".").startswith(e.name + "."):
            raise ModuleNotFoundError(
                f"reward function {spec!r}: module {module_name!r} not found "
                f"(is it installed / on PYTHONPATH?)",
                name=e.name,
            ) from e
        raise ImportError(
            f"reward function {spec!r}: importing {module_name!r} failed: {e}"
        ) from e
    obj = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise AttributeError(
                f"reward function {spec!r}: {module_name!r} has no attribute {attr_path!r}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(
            f"reward function {spec!r}: {attr_path!r} is a {type(obj).__name__}, not callable"
        )
    return obj


# --------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------

_logged_failures: set[tuple] = set()
_logged_lock = threading.Lock()


def _fn_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _log_once(key: tuple, message: str, exc: BaseException | None = None) -> None:
    """Log ``message`` (with ``exc``'s traceback) the first time ``key`` is seen."""
    with _logged_lock:
        if key in _logged_failures:
            return
        _logged_failures.add(key)
    logger.warning(
        "%s; the sample scores 0.0 (further failures like this are not logged)",
        message,
        exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None,
    )


def _failure_site(exc: BaseException) -> tuple:
    """Where an exception was raised: messages often embed the sample, so the
    innermost frame (not the text) is what makes two failures "the same"."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    return (type(exc).__name__, last.filename if last else "", last.lineno if last else 0)


class _Worker:
    """A daemon thread that runs reward calls one after another.

    Python cannot kill a thread, so a call that times out is abandoned: its
    batch is cancelled, the worker exits after the call (if it ever returns)
    and the caller goes on with a fresh worker. ``daemon=True`` keeps a hung
    reward from blocking exit. Workers that finished their batch are kept for
    the next one (:func:`_take_worker`): starting a thread per group cost more
    CPU than a cheap reward itself.
    """

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="reward-worker", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.inbox.get()
            if job is None:
                return
            fn, batch, outbox, cancelled = job
            for args in batch:
                if cancelled.is_set():
                    return  # abandoned after a call that timed out
                # BaseException too: a reward calling sys.exit() must not kill the
                # worker (signals only reach the main thread, so Ctrl-C is unaffected).
                try:
                    outbox.put((True, fn(*args)))
                except BaseException as e:  # noqa: BLE001
                    outbox.put((False, e))
            if cancelled.is_set():
                return

    def submit(self, fn: Callable, batch: Sequence[tuple]) -> tuple[queue.SimpleQueue, threading.Event]:
        """Run ``fn(*args)`` for each of ``batch`` in order; each result (ok,
        value) is put on the returned queue as it is made. Setting the event
        abandons the rest of the batch and ends the worker."""
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        cancelled = threading.Event()
        self.inbox.put((fn, batch, outbox, cancelled))
        return outbox, cancelled


_idle_workers: list[_Worker] = []
_idle_lock = threading.Lock()


def _take_worker() -> _Worker:
    with _idle_lock:
        if _idle_workers:
            return _idle_workers.pop()
    return _Worker()


def _return_worker(worker: _Worker) -> None:
    with _idle_lock:
        _idle_workers.append(worker)


def _checked(fn: Callable, value: object) -> float:
    """The reward as a float, or 0.0 (logged) if it is not a finite real number."""
    if isinstance(value, numbers.Real):
        value = float(value)
        if math.isfinite(value):
            return value
        _log_once((_fn_name(fn), repr(value)), f"reward {_fn_name(fn)} returned {value}")
        return 0.0
    _log_once(
        (_fn_name(fn), "type", type(value).__name__),
        f"reward {_fn_name(fn)} returned a {type(value).__name__} ({value!r:.80}), "
        f"expected a number",
    )
    return 0.0


def score_all(
    fn: RewardFn,
    items: Sequence[tuple[str, str, dict]],
    timeout_s: float | None = 10.0,
) -> list[float]:
    """Score ``(prompt, completion, row)`` items; never raises for a bad reward.

    Calls run one at a time on a worker thread; each call gets ``timeout_s``
    seconds (``None``: no limit). A sample whose call raises, times out, or
    returns a non-number / NaN / inf scores 0.0; each distinct failure (same
    reward, same kind, same raising line) is logged once per process on the
    ``torchtitan_grpo.rewards`` logger, with its traceback.
    """
    scores: list[float] = []
    pending = list(items)
    while pending:
        worker = _take_worker()
        outbox, cancelled = worker.submit(fn, pending)
        for i in range(len(pending)):
            try:
                ok, value = outbox.get(timeout=timeout_s)
            except queue.Empty:
                _log_once(
                    (_fn_name(fn), "timeout"),
                    f"reward {_fn_name(fn)} did not return within {timeout_s}s "
                    f"(left running in the background)",
                )
                scores.append(0.0)
                cancelled.set()  # the worker exits if the hung call ever returns
                pending = pending[i + 1:]  # the rest goes to a fresh worker
                break
            if ok:
                scores.append(_checked(fn, value))
            else:
                _log_once(
                    (_fn_name(fn), *_failure_site(value)),
                    f"reward {_fn_name(fn)} raised {type(value).__name__}: {value}",
                    value,
                )
                scores.append(0.0)
        else:
            _return_worker(worker)
            pending = []
    return scores


# --------------------------------------------------------------------------
# Built-in rewards
# --------------------------------------------------------------------------


def exact_match(prompt: str, completion: str, row: dict) -> float:
    """1.0 iff the completion equals ``row["answer"]``, surrounding whitespace ignored."""
    return 1.0 if completion.strip() == str(row["answer"]).strip() else 0.0


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces balanced), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = start + len("\\boxed")
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        # "\boxed 5": LaTeX takes the next token.
        m = re.match(r"\s*([^\s$]+)", text[start + len("\\boxed") :])
        return m.group(1) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced: the model was cut off mid-answer


def _after_hashes(text: str) -> str | None:
    """GSM8K style: the rest of the line after the last ``####``, or None."""
    pos = text.rfind("####")
    if pos < 0:
        return None
    answer = text[pos + 4 :].strip().split("\n", 1)[0].strip()
    return answer or None


def extract_answer(text: str) -> str | None:
    """The marked final answer in ``text``: last ``\\boxed{}``, else ``#### x``."""
    boxed = _last_boxed(text)
    return boxed if boxed is not None else _after_hashes(text)


_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]*?)\s*\}\s*\{\s*([^{}]*?)\s*\}")
_FRAC_SHORT = re.compile(r"\\[dt]?frac\s*(\d)(\d)")  # \frac34
_TEXT = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{([^{}]*)\}")
# A number: optional sign, thousands-grouped or plain digits, optional decimals,
# optionally "/ denominator" for a simple fraction.
_NUMBER = re.compile(
    r"(?<![\w.])([-+]?)\s*((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:\s*/\s*([-+]?)\s*(\d+(?:\.\d+)?))?"
)


def parse_number(text: str) -> Fraction | None:
    """The first number in ``text`` as an exact Fraction, or None.

    Understands ``1,234``, ``-5``, ``3.50``, ``3/4``, ``\\frac{3}{4}``,
    ``$18``, ``50\\%`` and trailing units or words (``18 dollars``).
    """
    s = text.replace("\u2212", "-")  # unicode minus
    s = _TEXT.sub(r" \1 ", s)
    s = _FRAC.sub(r"(\1)/(\2)", s)
    s = _FRAC_SHORT.sub(r"\1/\2", s)
    # LaTeX spacing (\, as a thousands separator) and grouping carry no value.
    for junk in (
        "\\left", "\\right", "\\!", "\\,", "\\;", "\\$", "$", "\\%",
        "^\\circ", "\\circ", "\\degree", "(", ")", "{", "}",
    ):
        s = s.replace(junk, "")
    if re.search(r"\\[a-zA-Z]", s):
        # Some other LaTeX (\sqrt, \pi, ...): not a plain number; taking its
        # first digit would make "\frac{1}{\sqrt{2}}" equal 1.
        return None
    m = _NUMBER.search(s)
    if m is None:
        return None
    sign, num, den_sign, den = m.groups()
    value = Fraction(num.replace(",", ""))
    if sign == "-":
        value = -value
    if den is not None:
        den_value = Fraction(den)
        if den_value == 0:
            return None
        value /= -den_value if den_sign == "-" else den_value
    return value


def _normalise_text(text: str) -> str:
    return re.sub(r"\s+", "", text).rstrip(".").lower()


# math_answer is the dependency-free grader; "math" (math_reward.py, on
# math-verify) is the one to train with: it also accepts an unmarked final
# answer and compares expressions symbolically. math_answer stays under its own
# name because tests (and users' configs) name it and format_reward shares its
# extractor; it is not a fallback for "math", which needs math-verify (a
# declared dependency) and says so if it is missing.
def math_answer(prompt: str, completion: str, row: dict) -> float:
    """1.0 iff the completion's marked final answer equals ``row["answer"]``.

    The completion must mark its answer (``\\boxed{...}`` or ``#### ...``); an
    unmarked number anywhere in the reasoning does not count. The reference may
    be a full GSM8K solution (``... #### 72``), a boxed answer or a bare value.
    Numbers compare exactly (``1,234`` == ``1234``, ``0.75`` == ``3/4`` ==
    ``\\frac{3}{4}``); non-numeric answers compare as whitespace-free text.
    """
    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    reference = str(row["answer"])
    reference = extract_answer(reference) or reference
    ref_value = parse_number(reference)
    if ref_value is not None:
        return 1.0 if parse_number(predicted) == ref_value else 0.0
    return 1.0 if _normalise_text(predicted) == _normalise_text(reference) else 0.0


def format_reward(prompt: str, completion: str, row: dict) -> float:
    """1.0 iff the completion marks a final answer (``\\boxed{...}`` or ``#### x``)."""
    return 1.0 if extract_answer(completion) is not None else 0.0


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "math": math_reward,
    "math_answer": math_answer,
    "format_reward": format_reward,
    "digits": digits_reward,
    "code_complete": code_complete,
}
"""Rewards that :func:`load_reward_fn` accepts by bare name."""


__all__ = [
    "BUILTIN_REWARDS",
    "RewardFn",
    "exact_match",
    "extract_answer",
    "format_reward",
    "load_reward_fn",
    "math_answer",
    "math_reward",
    "parse_number",
    "score_all",
]
