"""vLLM's streamed ``/v1/completions`` and ``/v1/chat/completions`` on the
built-in server (``"stream": true``), chunk by chunk as vLLM 0.33 writes
them (``completion/serving.py`` and ``chat_completion/serving.py``; models
in their ``protocol.py``): ``text/event-stream``, ``data: {json}`` per chunk,
``data: [DONE]`` at the end.

* Completions: ``{id, object: "text_completion", created, model, choices:
  [{index, text (the new text), logprobs (for the new tokens, text offsets
  continuing), finish_reason, stop_reason, prompt_token_ids (first chunk of
  a choice, with return_token_ids), token_ids (the new ids, with
  return_token_ids)}]}``, one choice per chunk.
* Chat: first a ``{"role": "assistant", "content": ""}`` delta per choice,
  then ``{index, delta: {content}, logprobs: {content: [...]}, finish_reason,
  token_ids}`` chunks (``object: "chat.completion.chunk"``), ``stop_reason``
  on the last one of each choice.
* ``stream_options.include_usage``: a last chunk with ``choices: []`` and
  ``usage``; ``continuous_usage_stats`` adds usage so far to every chunk.

Tokens are sent as the engine records them (``streaming.LiveRequests``);
text is held back only where a stop string could still trim it.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any, Callable

from aiohttp import web

from torchtitan_grpo.server.streaming import LiveRequests, LiveSample, end_with_error, open_sse, send_done, send_event, text_delta
from torchtitan_grpo.server.vllm_http import stop_reason, version_spans


Chunk = Callable[[int, int, LiveSample], dict]
"""(prompt, sample, its live state) -> the chunk's choice."""


async def _stream(routes: Any, request: web.Request, head: dict, prompts: list[list[int]], params: Any,
                  rids: list[str], top_k: int, choice: Chunk, call: Any, first: list[dict]) -> web.StreamResponse:
    """Run the request and write its chunks: ``first`` (chat's role chunks),
    then one per choice that moved, then usage, then ``[DONE]``."""
    routes.gate.check()
    live = LiveRequests(routes.engine, prompts, [params] * len(prompts), rids, [top_k] * len(prompts))
    resp = None
    try:
        resp = await open_sse(request)
        for c in first:
            await send_event(resp, {**head, **c})
        async for _ in live.updates():
            for i, samples in enumerate(live.samples):
                for j, s in enumerate(samples):
                    if not s.pending:
                        continue
                    chunk = {**head, "choices": [choice(i, j, s)]}
                    if call.continuous_usage:
                        chunk["usage"] = _usage(prompts, live, sent=True)
                    await send_event(resp, chunk)
        if call.include_usage:
            await send_event(resp, {**head, "choices": [], "usage": _usage(prompts, live)})
        await send_done(resp)
        return resp
    except asyncio.CancelledError:  # the client went away
        live.abort_unfinished("client disconnected")
        raise
    except Exception as e:
        return await end_with_error(live, resp, e, request.path,
                                    {"message": str(e), "type": "InternalServerError", "param": None, "code": 500})


def _usage(prompts: list[list[int]], live: LiveRequests, sent: bool = False) -> dict:
    n_prompt = sum(len(p) for p in prompts)
    n_out = sum(s.sent_tokens if sent else len(s.result.output_ids) for ss in live.samples for s in ss)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def _finish(s: LiveSample, params: Any) -> tuple[str | None, Any]:
    """(finish_reason, stop_reason) of the chunk being built: set on the last."""
    if s.result is None:
        return None, None
    s.final_sent = True
    return s.result.finish_reason.kind, stop_reason(s.result, params)


async def stream_completions(routes: Any, request: web.Request, body: dict, call: Any,
                             rids: list[str]) -> web.StreamResponse:
    """A checked streamed /v1/completions call (``routes``: the ``OpenAIRoutes``)."""
    engine, n = routes.engine, call.params.n
    head = {"id": rids[0], "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or routes.served_names[0]}

    def choice(i: int, j: int, s: LiveSample) -> dict:
        first = s.sent_tokens == 0 and not s.sent_text
        offset = len(s.sent_text)
        ids, lps, top = s.new_tokens()
        text = text_delta(engine, s, call.params)
        finish, stop = _finish(s, call.params)
        part = SimpleNamespace(output_ids=ids, output_logprobs=lps, top_logprobs=top)
        out: dict[str, Any] = {
            "index": i * n + j, "text": text,
            "logprobs": None if call.logprobs is None else routes._logprobs(part, call.logprobs, call.tokens_as_ids,
                                                                           offset),
            "finish_reason": finish, "stop_reason": stop,
            "prompt_token_ids": call.prompts[i] if call.return_token_ids and first else None,
            "token_ids": ids if call.return_token_ids else None,
        }
        if call.return_weight_versions and s.result is not None:
            out["weight_versions"] = version_spans(s.result)
        return out

    return await _stream(routes, request, head, call.prompts, call.params, rids, max(call.logprobs or 0, 0),
                         choice, call, [])


async def stream_chat(routes: Any, request: web.Request, body: dict, call: Any, rid: str) -> web.StreamResponse:
    """A checked streamed /v1/chat/completions call (``routes``: the ``ChatRoutes``)."""
    engine = routes.engine
    head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": body.get("model") or routes.served_names[0]}
    first = [{"choices": [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}]} for j in range(call.params.n)]
    if call.return_token_ids and first:
        first[0]["prompt_token_ids"] = call.prompt

    def choice(i: int, j: int, s: LiveSample) -> dict:
        ids, lps, top = s.new_tokens()
        text = text_delta(engine, s, call.params)
        finish, stop = _finish(s, call.params)
        part = SimpleNamespace(output_ids=ids, output_logprobs=lps, top_logprobs=top)
        out: dict[str, Any] = {
            "index": j, "delta": {"content": text},
            "logprobs": routes._logprobs(part, call) if call.logprobs else None,
            "finish_reason": finish, "token_ids": ids if call.return_token_ids else None,
        }
        if finish is not None:
            out["stop_reason"] = stop
            if call.return_weight_versions:
                out["weight_versions"] = version_spans(s.result)
        return out

    return await _stream(routes, request, head, [call.prompt], call.params, [rid],
                         call.top_logprobs if call.logprobs else 0, choice, call, first)
