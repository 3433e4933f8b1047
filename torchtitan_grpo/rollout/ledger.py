"""Which prompts a run has trained on, for an exact resume with groups in flight.

The producer draws prompts ahead of the trainer and hands groups over in the
order they finish, not the order they were drawn, so "the prompt source's
position" no longer says what was trained. The ledger numbers every prompt it
draws (its *index* in the run's prompt stream), remembers the source's state
before each batch it drew, and which indices were handed to the trainer.

Its ``state_dict()`` is the source's state before the oldest batch that still
holds an index not handed over, plus the handed indices from there on. A
resumed run restores the source there and draws again, skipping the handed
indices: what was in flight or buffered at the checkpoint is generated again,
and nothing handed over is trained twice.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Protocol


class PromptSource(Protocol):
    """``tasks.PromptIterator`` and ``tasks.DigitsPrompts``."""

    def next_batch(self) -> list[dict]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class PromptLedger:
    """Thread-safe: the producer draws on the event loop's thread, the trainer
    marks hand-overs and checkpoints on its own."""

    def __init__(self, source: PromptSource):
        self.source = source
        self._lock = threading.Lock()
        self._next_index = 0
        self._queue: deque[tuple[int, dict]] = deque()
        self._batches: dict[int, tuple[dict, int]] = {}
        """First index of each drawn batch -> (source state before it, its size)."""
        self._handed: set[int] = set()
        self._skip: set[int] = set()
        """Indices handed over before the resume: drawn again, never generated."""
        self._oldest = 0
        """No index below this is still to be handed over."""

    def draw(self) -> tuple[int, dict]:
        """The next prompt not yet handed over: (index, row)."""
        with self._lock:
            while True:
                while not self._queue:
                    state = self.source.state_dict()
                    rows = self.source.next_batch()
                    self._batches[self._next_index] = (state, len(rows))
                    self._queue.extend(enumerate(rows, self._next_index))
                    self._next_index += len(rows)
                index, row = self._queue.popleft()
                if index in self._skip:
                    self._skip.discard(index)
                    self._handed.add(index)
                    self._advance()
                    continue
                return index, row

    def handed(self, indices: list[int]) -> None:
        """These prompts' groups went to the trainer (trained, filtered or dropped as stale)."""
        with self._lock:
            self._handed.update(indices)
            self._advance()

    def _advance(self) -> None:
        while self._oldest in self._handed:
            self._handed.discard(self._oldest)
            self._oldest += 1
        # Batches wholly below the oldest open index are no longer needed to resume.
        for start in [s for s, (_, n) in self._batches.items() if s + n <= self._oldest]:
            del self._batches[start]

    def state_dict(self) -> dict:
        with self._lock:
            # Indices handed before a resume and not drawn again yet (``_skip``) are
            # still handed: a checkpoint taken this early must not lose them.
            start = max((s for s in self._batches if s <= self._oldest), default=None)
            if start is None:  # nothing drawn past the oldest index: resume from the source as it is
                return {"source": self.source.state_dict(), "first_index": self._next_index,
                        "handed": sorted(self._skip)}
            handed = sorted(i for i in self._handed | self._skip | set(range(start, self._oldest)) if i >= start)
            return {"source": self._batches[start][0], "first_index": start, "handed": handed}

    def load_state_dict(self, state: dict) -> None:
        """Also accepts a bare prompt-source state (checkpoints written before the ledger)."""
        with self._lock:
            if "handed" not in state:
                self.source.load_state_dict(state)
                return
            for key in ("source", "first_index", "handed"):
                if key not in state:
                    raise ValueError(f"prompt ledger checkpoint has no {key!r}: {sorted(state)}")
            self.source.load_state_dict(state["source"])
            self._next_index = self._oldest = int(state["first_index"])
            self._skip = {int(i) for i in state["handed"]}
            self._queue.clear()
            self._batches.clear()
            self._handed.clear()
