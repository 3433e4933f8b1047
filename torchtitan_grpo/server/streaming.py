"""Server-sent events for the built-in server's streaming routes (SGLang's
``/generate`` and vLLM's ``/v1/completions`` / ``/v1/chat/completions`` with
``"stream": true``).

:class:`LiveRequests` submits a route's prompts with an ``on_token`` hook, so
each token reaches the event loop as the engine's worker records it (one
decode step at a time, per request), not when the request ends; the route
turns each batch of new tokens into one chunk per sample that moved.
:func:`open_sse` / :func:`send_event` / :func:`send_done` write the
``text/event-stream`` framing both engines use: ``data: <json>`` and a blank
line per chunk, ``data: [DONE]`` at the end.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from aiohttp import web

from torchtitan_grpo import jsonfast
from torchtitan_grpo.server.engine.requests import SampleResult, SamplingParams, decode_ids

logger = logging.getLogger("torchtitan_grpo.server")


@dataclass
class LiveSample:
    """One sample of a streamed request, as far as it has been generated."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[float, int]]] = field(default_factory=list)
    sent_tokens: int = 0
    """Tokens already sent to the client (a route's cursor)."""
    sent_text: str = ""
    """Text already sent to the client (a route's cursor)."""
    result: SampleResult | None = None
    """Set once the whole request has finished."""
    final_sent: bool = False
    """The sample's last chunk is out (a route's cursor)."""

    def new_tokens(self) -> tuple[list[int], list[float], list | None]:
        """(ids, logprobs, tops) not yet sent, and advance the cursor: the
        finished sample's own (engine's) lists once it ended."""
        r = self.result
        ids, lps, top = ((r.output_ids, r.output_logprobs, r.top_logprobs) if r is not None
                         else (self.token_ids, self.logprobs, self.top or None))
        k, self.sent_tokens = self.sent_tokens, len(ids)
        return ids[k:], lps[k:], (top[k:] if top else None)

    @property
    def pending(self) -> bool:
        """Something to send: new tokens, or the end."""
        if self.result is not None:
            return not self.final_sent
        return len(self.token_ids) > self.sent_tokens


class LiveRequests:
    """Submits prompts to the engine and follows their samples token by token.

    ``samples[i][j]`` is prompt ``i``'s sample ``j``. :meth:`updates` yields
    each time new tokens (or the end of a request) arrived, after copying
    them into ``samples``; several decode steps that arrive together are
    one update, so a slow client coalesces chunks instead of queueing them."""

    def __init__(self, engine: Any, prompts: list[list[int]], params: list[SamplingParams], rids: list[str],
                 top_logprobs: list[int]):
        self.engine = engine
        self.rids = rids
        self.samples = [[LiveSample() for _ in range(p.n)] for p in params]
        self._done = [False] * len(prompts)
        self._queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._futures = []
        for i, (prompt, p, rid, k) in enumerate(zip(prompts, params, rids, top_logprobs)):
            def on_token(s: Any, i: int = i) -> None:  # worker thread, engine lock held: copy and go
                top = s.top[-1] if s.top else None
                loop.call_soon_threadsafe(self._queue.put_nowait,
                                          (i, s.index, s.output_ids[-1], s.logprobs[-1], top))
            fut = engine.submit(prompt, p, rid=rid, top_logprobs_num=k, on_token=on_token)
            # The result is queued behind the request's last token (same thread, FIFO).
            fut.add_done_callback(lambda f, i=i: loop.call_soon_threadsafe(self._queue.put_nowait, (i, f)))
            self._futures.append(fut)

    @property
    def finished(self) -> bool:
        return all(self._done)

    async def updates(self) -> AsyncIterator[None]:
        """Yield after each batch of progress until every request has finished."""
        while not self.finished:
            self._apply(await self._queue.get())
            while not self._queue.empty():
                self._apply(self._queue.get_nowait())
            yield

    def _apply(self, item: tuple) -> None:
        if len(item) == 2:  # (prompt, future): the request ended
            i, fut = item
            self._done[i] = True
            for sample, r in zip(self.samples[i], fut.result()):  # an engine error raises here
                sample.result = r
            return
        i, j, token, logprob, top = item
        if self._done[i]:
            return
        s = self.samples[i][j]
        s.token_ids.append(token)
        s.logprobs.append(logprob)
        if top is not None:
            s.top.append(top)

    def abort_unfinished(self, reason: str) -> None:
        """The client went away (or the route failed): stop what still runs."""
        for fut, rid in zip(self._futures, self.rids):
            if not fut.done():
                self.engine.abort(rid, reason, wait=False)


def safe_text(engine: Any, sample: LiveSample, params: SamplingParams) -> str:
    """The text of ``sample`` that can be sent now: all of it once the request
    ended (the engine's, stop string trimmed); before that, the decoded tokens
    less an incomplete UTF-8 character at the end and less the last
    ``len(longest stop string) - 1`` characters, which a stop string that
    completes later would trim (both engines hold text back likewise)."""
    if sample.result is not None:
        return sample.result.text or ""
    if engine.tokenizer is None:
        return ""
    text = decode_ids(engine.tokenizer, sample.token_ids, params.skip_special_tokens)
    text = text.rstrip("\ufffd")
    if params.stop and not params.no_stop_trim:
        hold = max(len(s) for s in params.stop) - 1
        text = text[: max(len(text) - hold, 0)]
    return text


def text_delta(engine: Any, sample: LiveSample, params: SamplingParams) -> str:
    """The text to send for ``sample`` now, and advance its cursor."""
    # (A tokenizer whose decode of a prefix is not a prefix of the whole: what
    # was sent stays sent, the rest follows from the same offset.)
    delta = safe_text(engine, sample, params)[len(sample.sent_text):]
    sample.sent_text += delta
    return delta


async def open_sse(request: web.Request) -> web.StreamResponse:
    """Start a ``text/event-stream`` reply (status 200: errors found later are events)."""
    resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def send_event(resp: web.StreamResponse, payload: dict) -> None:
    await resp.write(b"data: " + jsonfast.dumps(payload) + b"\n\n")


async def send_done(resp: web.StreamResponse) -> None:
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


async def end_with_error(live: LiveRequests, resp: web.StreamResponse | None, e: Exception, where: str,
                         error: dict) -> web.StreamResponse:
    """A streaming route's failure (call it from its ``except``): the request's
    unfinished samples are aborted; before the stream opened (``resp`` None)
    the error propagates to the route, which answers with an error status;
    after, the client gets ``{"error": error}`` as a last event, then ``[DONE]``."""
    live.abort_unfinished(f"stream failed: {e}")
    if resp is None:
        raise e
    logger.exception("%s stream failed", where)
    await send_event(resp, {"error": error})
    await send_done(resp)
    return resp
