"""A burst of requests into an idle engine, admitted as one prefill.

A GRPO step posts its requests together, but the server's event loop hands
them to the engine one at a time (each is read and parsed; on the chat route
also rendered and tokenised), and an idle engine used to start on the first:
the others joined in later prefills, each of which first flushes the decode
pipeline. On CPU, 8 chat requests of n=8 came in as prefills of 8, 16 and 40
rows (8 and 56 on a second try); /generate's, parsed faster, as one of 64.
On an H200 the chat route's 64 x 128-token row ran at 0.85 x /generate's
(docs/PERFORMANCE.md, runs 144-145), a fixed ~40 ms.

So while the engine has no rows, the first request waits until no other has
come for :data:`QUIET_MS`, and at most ``window_ms`` after it came: a lone
request waits the quiet time, a burst is admitted together. Requests that
arrive while rows are decoding join at the next step, as before.

The first setting (2 ms quiet, 10 ms at most) still split 6 of 8 bursts of 32
OpenAI requests (n=8, 0.6B, 128-token prompts; 4 chat, 4 completions) on an
H200 host: queueing 32 chat requests took 14-33 ms. 5 ms and 40 ms split 1 of
8, and brought chat and completions at 256 sequences to 0.94 / 0.97 x
/generate in the same call (run 159; docs/PERFORMANCE.md). A lone request
into an idle server waits 5 ms.
"""

from __future__ import annotations

import time

QUIET_MS = 5.0
"""A gap this long after the last request ends the burst. On an H200 host the server queues a
/generate request in 0.2-0.3 ms and a chat one in 0.5-1 ms (its prompt rendered and
tokenised), but a collector pass or a first request's extra work left gaps of 2-9 ms mid-burst
(run 157)."""


class AdmissionWindow:
    """When an idle engine may admit: :meth:`note` each request as it is
    queued, :meth:`hold` says how much longer to wait."""

    def __init__(self, window_ms: float, quiet_ms: float = QUIET_MS):
        self.window_s = max(window_ms, 0.0) / 1e3
        self.quiet_s = min(quiet_ms / 1e3, self.window_s)
        self._first = self._last = float("-inf")

    def note(self, queue_was_empty: bool, now: float | None = None) -> None:
        """A request was queued (``queue_was_empty``: it starts a burst)."""
        now = time.monotonic() if now is None else now
        if queue_was_empty:
            self._first = now
        self._last = now

    def hold(self, now: float | None = None) -> float:
        """Seconds an idle engine should still wait for the rest of the burst (0: admit now)."""
        if self.window_s <= 0:
            return 0.0
        now = time.monotonic() if now is None else now
        return max(0.0, min(self._last + self.quiet_s, self._first + self.window_s) - now)
