"""Prompt sources: local dataset files, a resumable shuffled batch iterator,
and a built-in demo task that a tiny random model learns by RL alone.

A prompt source yields *rows*: plain dicts with at least a ``"prompt"`` (text)
plus whatever fields the reward function needs (e.g. ``"answer"``). The whole
row is handed to the reward function, so nothing here knows about rewards.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def load_prompts(path: str, prompt_key: str = "prompt") -> list[dict]:
    """Read a local ``.json``/``.jsonl``/``.parquet`` file into a list of rows.

    Goes through ``datasets`` with ``data_files=`` so nothing is downloaded.
    If ``prompt_key`` is not ``"prompt"``, each row also gets a ``"prompt"``
    field copied from ``prompt_key`` (the original field is kept), so the rest
    of the pipeline reads one name.
    """
    ext = os.path.splitext(path)[1].lower()
    if ext not in _FORMATS:
        raise ValueError(
            f"prompt file {path!r}: unsupported extension {ext!r}; "
            f"expected one of {sorted(_FORMATS)}"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file {path!r} does not exist")

    import datasets  # heavy import, only needed here

    ds = datasets.load_dataset(_FORMATS[ext], data_files=path, split="train")
    if prompt_key not in ds.column_names:
        raise KeyError(
            f"prompt file {path!r} has no column {prompt_key!r} "
            f"(columns: {ds.column_names})"
        )
    rows = ds.to_list()
    if not rows:
        raise ValueError(f"prompt file {path!r} has no rows")
    if prompt_key != "prompt":
        for row in rows:
            row["prompt"] = row[prompt_key]
    return rows


@dataclass
class PromptIterState:
    """Where a :class:`PromptIterator` is: checkpoint this to resume exactly.

    ``epoch`` selects the shuffle (seeded by ``seed + epoch``); ``index`` is the
    position of the next row inside that epoch's order.
    """

    epoch: int = 0
    index: int = 0


class PromptIterator:
    """Endless batches of rows in a seeded, per-epoch shuffled order.

    Each epoch visits every row once in the order ``random.Random(seed + epoch)``
    gives; a batch that runs past the end of an epoch continues into the next.
    ``state_dict()`` / ``load_state_dict()`` save and restore the position, so
    a resumed run sees exactly the batches it would have seen.
    """

    def __init__(self, rows: Sequence[dict], batch_size: int, seed: int = 0):
        if not rows:
            raise ValueError("PromptIterator needs at least one row")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.rows = rows
        self.batch_size = batch_size
        self.seed = seed
        self.state = PromptIterState()
        self._order_epoch = -1
        self._order: list[int] = []

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:  # cached: one shuffle per epoch
            order = list(range(len(self.rows)))
            random.Random(self.seed + epoch).shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def next_batch(self) -> list[dict]:
        batch = []
        while len(batch) < self.batch_size:
            order = self._epoch_order(self.state.epoch)
            batch.append(self.rows[order[self.state.index]])
            self.state.index += 1
            if self.state.index == len(order):
                self.state = PromptIterState(epoch=self.state.epoch + 1, index=0)
        return batch

    def __iter__(self) -> Iterator[list[dict]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.state.epoch, "index": self.state.index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"prompt iterator checkpoint has seed {state['seed']}, "
                f"this run uses {self.seed}"
            )
        if not 0 <= state["index"] < len(self.rows):
            raise ValueError(
                f"prompt iterator checkpoint index {state['index']} is outside "
                f"the {len(self.rows)} rows of this dataset"
            )
        self.state = PromptIterState(epoch=state["epoch"], index=state["index"])


# --------------------------------------------------------------------------
# Built-in demo task
# --------------------------------------------------------------------------

DIGITS_MAP = "7294061538"
"""Answer of the digits task for prompt digit ``d`` is ``DIGITS_MAP[d]``: a
fixed permutation with no fixed point, so copying the prompt digit scores 0
and the model must learn a lookup per prompt."""


def digits_answer(prompt: str) -> str:
    return DIGITS_MAP[int(prompt[0])]


def digits_task_rows(seed: int = 0) -> Iterator[dict]:
    """Endless rows of the digits demo task: ``{"prompt": "3>", "answer": "4"}``.

    The prompt is one digit and ``>``; the answer is one digit given by
    :data:`DIGITS_MAP`. Made for a randomly initialised tiny model with a
    character-level tokenizer (one token per character): it can only score by
    learning the ten prompt->answer pairs, since every answer digit is the
    right one for exactly one prompt digit in ten.
    """
    rng = random.Random(seed)
    while True:
        d = rng.randrange(10)
        prompt = f"{d}>"
        yield {"prompt": prompt, "answer": digits_answer(prompt)}


class DigitsPrompts:
    """Endless, resumable batches of digits-task rows.

    Yields the rows of :func:`digits_task_rows` (same seed, same order) in
    batches of ``batch_size``. ``state_dict()`` records how many rows were
    drawn; ``load_state_dict()`` replays the seeded generator to that point
    (one ``randrange`` per row: a million rows take well under a second), so
    a resumed run sees exactly the batches it would have seen.
    """

    def __init__(self, batch_size: int, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.seed = seed
        self.rows_drawn = 0
        self._rows = digits_task_rows(seed)

    def next_batch(self) -> list[dict]:
        batch = [next(self._rows) for _ in range(self.batch_size)]
        self.rows_drawn += len(batch)
        return batch

    def __iter__(self) -> Iterator[list[dict]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"rows_drawn": self.rows_drawn, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"digits task checkpoint has seed {state['seed']}, this run uses {self.seed}"
            )
        if "rows_drawn" not in state:
            raise ValueError(f"digits task checkpoint has no 'rows_drawn': {state!r}")
        self._rows = digits_task_rows(self.seed)
        for _ in range(state["rows_drawn"]):
            next(self._rows)
        self.rows_drawn = state["rows_drawn"]


def digits_reward(prompt: str, completion: str, row: dict) -> float:
    """1.0 iff the completion (text before EOS, whitespace stripped) is the answer.

    A constant output is right for at most one prompt digit in ten (<= 0.1 on
    uniform prompts); an empty output scores 0.
    """
    text = completion.strip()
    if text == row["answer"]:
        return 1.0
    # Half credit for the right answer followed by junk: the model first learns
    # the digit, then to stop. Without it a long max_new_tokens makes a hit
    # (right digit *and* EOS right after) too rare for a random model to find.
    return 0.5 if text.startswith(row["answer"]) else 0.0


__all__ = [
    "DigitsPrompts",
    "PromptIterState",
    "PromptIterator",
    "digits_reward",
    "digits_task_rows",
    "load_prompts",
]
