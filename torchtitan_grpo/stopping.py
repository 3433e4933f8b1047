"""Stopping a run cleanly: SIGTERM (SLURM preemption, torchrun passing on its
own signal), SIGINT (Ctrl-C) and fatal errors of the rollout side all end the
loop at a step boundary, so the last completed step can be saved.

Every rank installs the handlers (torchrun signals every worker), but only
rank 0's decision counts: it sends a :class:`Stop` instead of the next batch,
so all ranks leave the loop after the same step. A second SIGINT interrupts
at once (KeyboardInterrupt), for a run that hangs somewhere a step boundary
never comes.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass

EXIT_CODES = {"SIGTERM": 143, "SIGINT": 130}
"""Exit status after a stop on a signal (128 + its number); 1 after a failure."""


@dataclass
class Stop:
    """Broadcast by rank 0 in place of a batch: the run stops before this step."""

    reason: str
    exit_code: int


class StopSignals:
    """SIGTERM / SIGINT set ``event`` (and ``reason``) instead of killing the process."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.stop: Stop | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # signals go to the main thread only
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.event.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: do not wait for the step boundary
        if not self.event.is_set():
            self.stop = Stop(f"received {name}", EXIT_CODES[name])
            self.event.set()
