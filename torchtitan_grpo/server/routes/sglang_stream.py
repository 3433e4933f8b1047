"""SGLang's ``/generate`` with ``"stream": true`` on the built-in server.

As SGLang 0.5.23 answers it (``http_server.generate_request`` and the
tokenizer manager's output handling, default ``--incremental-streaming-output``
off): ``text/event-stream``, one ``data: {json}`` event per sample each time
it has new tokens, then ``data: [DONE]``. Each event is cumulative, the
whole sample so far: ``text``, ``output_ids`` and ``meta_info`` (``id``,
``finish_reason`` null until the last event, ``prompt_tokens``,
``completion_tokens``, ``cached_tokens``, ``weight_version``; with
``return_logprob`` the ``output_token_logprobs`` so far and, asked for, the
prompt's ``input_token_logprobs``; ``e2e_latency`` on the last). A batch
(several prompts, or ``n`` > 1) adds ``index``, the sample's place in the
prompt-major order. An error after the stream started is an event
``{"error": {"message": ...}}`` before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from torchtitan_grpo.server.streaming import LiveRequests, LiveSample, end_with_error, open_sse, send_done, send_event, text_delta


async def stream_generate(routes: Any, request: web.Request, call: Any) -> web.StreamResponse:
    """Stream a checked /generate call (``routes``: the ``SGLangGenerateRoutes``)."""
    engine = routes.engine
    live = LiveRequests(engine, call.prompts, call.params, call.rids,
                        [k if lp else 0 for k, lp in zip(call.top_logprobs, call.want_logprobs)])
    resp = None
    try:
        inputs = await routes.input_logprobs(call)  # one forward per prompt, while the engine decodes
        resp = await open_sse(request)
        firsts = [sum(p.n for p in call.params[:i]) for i in range(len(call.prompts))]
        async for _ in live.updates():
            for i, samples in enumerate(live.samples):
                for j, s in enumerate(samples):
                    chunk = _chunk(routes, call, i, j, s, inputs[i])
                    if chunk is not None:
                        if not call.single:
                            chunk["index"] = firsts[i] + j
                        await send_event(resp, chunk)
        await send_done(resp)
        return resp
    except asyncio.CancelledError:  # the client went away
        live.abort_unfinished("client disconnected")
        raise
    except Exception as e:
        return await end_with_error(live, resp, e, "/generate", {"message": str(e)})


def _chunk(routes: Any, call: Any, i: int, j: int, s: LiveSample, inputs: dict) -> dict | None:
    """Sample (i, j)'s event if it moved since the last one (None otherwise)."""
    params, want = call.params[i], call.want_logprobs[i]
    if not s.pending:
        return None
    if s.result is not None:
        s.final_sent = True
        return routes.sample_json(s.result, want, call.text_in_logprobs, inputs, call.routes)
    s.new_tokens()
    text_delta(routes.engine, s, params)
    n_out = len(s.token_ids)
    meta: dict[str, Any] = {
        "id": call.rids[i] if params.n == 1 else f"{call.rids[i]}_{j}",
        "finish_reason": None, "prompt_tokens": len(call.prompts[i]), "completion_tokens": n_out,
        "cached_tokens": 0, "weight_version": routes.engine.weight_version,
    }
    if want:
        tt = routes.engine.token_text if call.text_in_logprobs else (lambda _t: None)
        meta["output_token_logprobs"] = [[lp, t, tt(t)] for lp, t in zip(s.logprobs, s.token_ids)]
        if s.top:
            meta["output_top_logprobs"] = [[[lp, t, tt(t)] for lp, t in step] for step in s.top]
        meta.update(inputs)
    return {"text": s.sent_text, "output_ids": list(s.token_ids), "meta_info": meta}
