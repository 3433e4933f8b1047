"""Stand-ins for driving a RolloutProducer without a tokenizer or a dataset
(tests/test_producer.py, test_prompt_budget.py, test_overlong.py,
test_dynamic_sampling.py): characters as token ids, rows in a fixed order,
and a producer started and always torn down."""

from __future__ import annotations

import contextlib
from typing import Iterator


class CharTokenizer:
    """Characters as token ids (the scorer only encodes and decodes)."""

    chat_template = None
    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class ListSource:
    """The rows in their order, one at a time, over and over (a PromptSource)."""

    def __init__(self, rows):
        self.rows, self.pos = rows, 0

    def next_batch(self):
        row = self.rows[self.pos % len(self.rows)]
        self.pos += 1
        return [row]

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


@contextlib.contextmanager
def started(prod, version: int = 0) -> Iterator:
    """``prod`` generating for ``version``; closed, with its loop, whatever the test does."""
    try:
        prod.start(version)
        yield prod
    finally:
        prod.close()
        prod.loop.close()
