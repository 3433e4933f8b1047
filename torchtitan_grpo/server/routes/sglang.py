"""SGLang 0.5.23's generation routes on the built-in server: ``/generate``
(mounted by ``server/app.py``, which sends it the bodies that are SGLang's),
``/model_info``, ``/health``, ``/health_generate``, ``/abort_request``,
``/get_load`` and ``/flush_cache``, field by field as docs PROTOCOLS.md says
(request names, defaults, reply shapes, status codes). Generation is the
:class:`Engine`'s; this module only parses and answers.

``"stream": true`` answers server-sent events (``sglang_stream``); prompt
logprobs (``return_logprob`` with ``logprob_start_len`` >= 0) come from one
forward over the prompt (``prompt_logprobs``). An explicit
``max_new_tokens`` that does not fit the context beside the prompt is a 400
with SGLang's message (its tokenizer manager's total-token check); without
one, generation stops at the context.

Deliberate differences from SGLang, each a 400 naming the field rather than
silently ignored: structured output (``json_schema``, ``regex``, ``ebnf``,
``structural_tag``, ``stop_regex``). The server has no cross-request prefix
cache, so ``flush_cache`` has nothing to drop. A text prompt is refused by
its length before it is tokenised.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from torchtitan_grpo.server.engine import moe_routes
from torchtitan_grpo.server.routes import prompt_logprobs
from torchtitan_grpo.protocol import route_codec
from torchtitan_grpo.server.engine.engine import Engine
from torchtitan_grpo.server.httputil import BadRequest, BodyLimits, gc_paused, get_field as _get, is_int as _is_int, json_body, json_reply, off_loop_if_large, result, shielded
from torchtitan_grpo.server.engine.requests import RequestError, SampleResult, SamplingParams, parse_stop
from torchtitan_grpo.server.settings import ServerConfig
from torchtitan_grpo.fleet.types import BUILTIN_ENGINE

# Every key SGLang 0.5.23's SamplingParams accepts; anything else is a 400.
SGLANG_SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
        "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
        "min_new_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
        "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
        "custom_params", "stream_interval", "logit_bias", "sampling_seed",
    }
)
# Valid in SGLang but not implemented here: a non-null value is refused.
_UNSUPPORTED_SAMPLING_KEYS = ("stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "custom_params")


def sampling_params_from_sglang(d: Any, where: str = "sampling_params.") -> SamplingParams:
    """Map an SGLang ``sampling_params`` object onto :class:`SamplingParams`."""
    if not isinstance(d, dict):
        raise BadRequest(f"{where.rstrip('.')} must be an object")
    unknown = sorted(set(d) - SGLANG_SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"unknown sampling parameter '{where}{unknown[0]}'")
    for key in _UNSUPPORTED_SAMPLING_KEYS:
        if d.get(key) is not None:
            raise BadRequest(f"sampling parameter '{where}{key}' is not supported by the built-in server")
    stop_t = parse_stop(d.get("stop"))
    if stop_t is None:
        raise BadRequest(f"field '{where}stop' must be a string or a list of strings")
    stop_ids = _get(d, "stop_token_ids", "list", [], where=where)
    if not all(_is_int(t) for t in stop_ids):
        raise BadRequest(f"field '{where}stop_token_ids' must be a list of integers")
    bias_raw = _get(d, "logit_bias", "dict", None, where=where)
    bias = None
    if bias_raw:
        try:
            bias = {int(k): float(v) for k, v in bias_raw.items()}
        except (TypeError, ValueError):
            raise BadRequest(f"field '{where}logit_bias' must map token ids to numbers") from None
    top_k = _get(d, "top_k", "int", -1, where=where)
    return SamplingParams(
        max_new_tokens=_get(d, "max_new_tokens", "int", 128, where=where),
        temperature=_get(d, "temperature", "num", 1.0, where=where),
        top_p=_get(d, "top_p", "num", 1.0, where=where),
        top_k=-1 if top_k >= 1 << 30 else top_k,
        min_p=_get(d, "min_p", "num", 0.0, where=where),
        min_new_tokens=_get(d, "min_new_tokens", "int", 0, where=where),
        stop_token_ids=tuple(stop_ids),
        stop=stop_t,
        ignore_eos=_get(d, "ignore_eos", "bool", False, where=where),
        n=_get(d, "n", "int", 1, where=where),
        seed=_get(d, "sampling_seed", "int", None, where=where),
        repetition_penalty=_get(d, "repetition_penalty", "num", 1.0, where=where),
        frequency_penalty=_get(d, "frequency_penalty", "num", 0.0, where=where),
        presence_penalty=_get(d, "presence_penalty", "num", 0.0, where=where),
        logit_bias=bias,
        skip_special_tokens=_get(d, "skip_special_tokens", "bool", True, where=where),
        no_stop_trim=_get(d, "no_stop_trim", "bool", False, where=where),
    )


def _per_prompt(body: dict, key: str, kind: str, default: Any, n: int) -> list:
    """A field SGLang takes as one value for every prompt or as a list of one
    per prompt, each of JSON type ``kind`` (null: ``default``). Strict like
    SGLang's validation: ``"return_logprob": "yes"`` is a 400, not true."""
    value = body.get(key)
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"field {key!r} has {len(value)} entries for {n} prompt(s)")
        return [_get({f"{key}[{i}]": v}, f"{key}[{i}]", kind, default) for i, v in enumerate(value)]
    return [_get(body, key, kind, default)] * n


def check_total_tokens(prompt_tokens: int, max_new_tokens: int, context: int) -> None:
    """SGLang's total-token check (its tokenizer manager's, on by default):
    an explicit ``max_new_tokens`` that does not fit the context beside the
    prompt is refused, in SGLang's words."""
    total = prompt_tokens + max_new_tokens
    if total > context:
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of {context} tokens. You "
            f"requested a total of {total} tokens: {prompt_tokens} tokens from the input messages and "
            f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
            "messages or the completion to fit within the limit.")


def _finish_json(r: SampleResult) -> dict | None:
    f = r.finish_reason
    if f is None:
        return None
    if f.kind == "stop":
        return {"type": "stop", "matched": f.matched}
    if f.kind == "length":
        return {"type": "length", "length": f.length}
    return {"type": "abort", "message": f.message, "status_code": None}


@dataclass
class _GenerateCall:
    """A checked /generate body: one entry per prompt in every list."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    rids: list[str]
    want_logprobs: list[bool]
    top_logprobs: list[int]
    text_in_logprobs: bool
    single: bool
    """Answer with one object rather than a list."""
    logprob_starts: list[int]
    """Per prompt: first position of ``input_token_logprobs`` (-1: none)."""
    stream: bool = False
    routes: bool = False
    """``return_routed_experts``: each sample's ``meta_info.routed_experts``."""


class SGLangGenerateRoutes:
    """SGLang's generation and inspection routes over an :class:`Engine`
    (``/generate`` itself is mounted by the server: :meth:`generate_body`)."""

    def __init__(self, engine: Engine, cfg: ServerConfig, limits: BodyLimits | None = None):
        self.engine = engine
        self.cfg = cfg
        self.limits = limits or BodyLimits.for_engine(engine.max_context, engine.cfg.max_batch_size)

    def register(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_post("/abort_request", shielded(self.abort_request))
        r.add_get("/get_load", self.get_load)
        r.add_get("/flush_cache", self.flush_cache)
        r.add_post("/flush_cache", self.flush_cache)

    # ---- generation ------------------------------------------------------ #

    async def generate_body(self, request: web.Request, raw: bytes, body: dict) -> web.Response:
        """/generate, its body read (``raw``, at most ``limits.generate``) and parsed (``body``)."""
        call = await off_loop_if_large(len(raw), self._parse_generate, body)  # it tokenises text prompts
        if call.stream:
            from torchtitan_grpo.server.routes.sglang_stream import stream_generate

            return await stream_generate(self, request, call)
        futures = [
            self.engine.submit(prompt, p, rid=rid, top_logprobs_num=k if lp else 0)
            for prompt, p, rid, lp, k in zip(call.prompts, call.params, call.rids, call.want_logprobs, call.top_logprobs)
        ]
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except asyncio.CancelledError:
            # The client went away: stop spending compute on its samples.
            for f, rid in zip(futures, call.rids):
                # (cancelling the wrapper also cancels f, so f.done() is no test)
                if f.cancelled() or not f.done():
                    self.engine.abort(rid, "client disconnected", wait=False)
            raise
        inputs = await self.input_logprobs(call)
        with gc_paused():  # a container per logprob token
            out = [
                self.sample_json(r, call.want_logprobs[i], call.text_in_logprobs, inputs[i], call.routes)
                for i, samples in enumerate(results)
                for r in samples
            ]
        return json_reply(out[0] if call.single else out)

    async def input_logprobs(self, call: "_GenerateCall") -> list[dict]:
        """Per prompt, the ``meta_info`` fields of its prompt logprobs ({} when
        not asked for: ``return_logprob`` with ``logprob_start_len`` >= 0)."""
        out: list[dict] = []
        for i, prompt in enumerate(call.prompts):
            start, k = call.logprob_starts[i], call.top_logprobs[i]
            if not call.want_logprobs[i] or start < 0:
                out.append({})
                continue
            (pl,) = await prompt_logprobs.compute_all(self.engine, [prompt], [k])
            out.append(prompt_logprobs.sglang_meta(self.engine, pl, start, k, call.text_in_logprobs))
        return out

    def _parse_generate(self, body: dict) -> "_GenerateCall":
        """Check a whole /generate body (every prompt) before anything is
        queued; every field's type before any prompt is tokenised."""
        inputs = self._prompt_inputs(body)
        n = len(inputs)
        sp_raw = body.get("sampling_params")
        if isinstance(sp_raw, list):
            if len(sp_raw) != n:
                raise BadRequest(f"field 'sampling_params' has {len(sp_raw)} entries for {n} prompt(s)")
            params = [sampling_params_from_sglang(p, f"sampling_params[{i}].") for i, p in enumerate(sp_raw)]
        else:
            params = [sampling_params_from_sglang({} if sp_raw is None else sp_raw)] * n
        top_n = _per_prompt(body, "top_logprobs_num", "int", 0, n)
        if any(k < 0 for k in top_n):
            raise BadRequest("field 'top_logprobs_num' must be a non-negative integer (or one per prompt)")
        starts = _per_prompt(body, "logprob_start_len", "int", -1, n)
        if any(start < -1 for start in starts):
            raise BadRequest("field 'logprob_start_len' must be -1 (output tokens only) or a prompt position >= 0")
        want_logprobs = _per_prompt(body, "return_logprob", "bool", False, n)
        rids = _per_prompt(body, "rid", "str", None, n)
        text_in_logprobs = _get(body, "return_text_in_logprobs", "bool", False)
        stream = _get(body, "stream", "bool", False)
        routes = _get(body, route_codec.REQUEST_FIELD, "bool", False)
        why = routes and moe_routes.refusal(self.engine.cfg.return_routed_experts, self.engine.model,
                                            route_codec.REQUEST_FIELD)
        if why:
            raise BadRequest(why)
        prompts = self._tokenize(inputs)
        raw_params = sp_raw if isinstance(sp_raw, list) else [sp_raw or {}] * n
        explicit = [d.get("max_new_tokens") for d in raw_params]  # (each checked to be an object above)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                self.engine.check_request(prompt, p)
                if explicit[i] is not None:
                    check_total_tokens(len(prompt), p.max_new_tokens, self.engine.max_context)
                if starts[i] > len(prompt):  # == the length: no prompt logprobs, as SGLang
                    raise RequestError(f"field 'logprob_start_len' is {starts[i]}, past the prompt's last "
                                       f"position ({len(prompt) - 1})")
            except RequestError as e:
                raise BadRequest(f"prompt {i}: {e}" if n > 1 else str(e)) from None
        return _GenerateCall(
            prompts=prompts,
            params=params,
            # Every prompt gets an id, so a disconnected client's work can be aborted.
            rids=[r if r is not None else uuid.uuid4().hex for r in rids],
            want_logprobs=want_logprobs,
            top_logprobs=top_n,
            text_in_logprobs=text_in_logprobs,
            logprob_starts=starts,
            stream=stream,
            routes=routes,
            # One object for one prompt and one sample; a prompt-major array otherwise.
            single=n == 1 and params[0].n == 1 and self._single_prompt_input(body),
        )

    @staticmethod
    def _single_prompt_input(body: dict) -> bool:
        """``"text": "..."`` or ``"input_ids": [1, 2]`` (not a batch of one)."""
        ids = body.get("input_ids")
        if ids is not None:  # SGLang takes the ids when both are given
            return isinstance(ids, list) and (not ids or not isinstance(ids[0], list))
        return isinstance(body.get("text"), str)

    def _prompt_inputs(self, body: dict) -> list[str] | list[list[int]]:
        """The prompts as sent (texts or token ids), their types and lengths
        checked, none tokenised yet: a text is bounded by its length in
        characters and ids by their count, each against the context."""
        text, ids = body.get("text"), body.get("input_ids")
        if text is None and ids is None:
            raise BadRequest("one of 'text' and 'input_ids' must be given")
        # both given: SGLang 0.5.23 uses the ids (docs/CONFORMANCE.md)
        if ids is not None:
            if isinstance(ids, list) and ids and not isinstance(ids[0], list):
                self._check_ids(ids, "input_ids")
                return [ids]
            if isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids):
                for i, p in enumerate(ids):
                    self._check_ids(p, f"input_ids[{i}]")
                return ids
            raise BadRequest("field 'input_ids' must be a non-empty list of token ids or a list of such lists")
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest(f"field 'text' must be a string or a non-empty list of strings, got "
                             f"{json.dumps(text)[:80]}")
        if self.engine.tokenizer is None:
            raise BadRequest("field 'text' needs a tokenizer and this model has none; send 'input_ids'")
        for i, t in enumerate(texts):
            self.engine.check_prompt_text(t, "text" if isinstance(text, str) else f"text[{i}]")
        return texts

    def _check_ids(self, ids: list, name: str) -> None:
        if len(ids) >= self.engine.max_context:  # before scanning them
            raise BadRequest(f"field {name!r} has {len(ids)} tokens; the model's context is "
                             f"{self.engine.max_context}")
        if not ids or not all(_is_int(t) for t in ids):
            raise BadRequest(f"field {name!r} must be a non-empty list of token ids")

    def _tokenize(self, inputs: list[str] | list[list[int]]) -> list[list[int]]:
        if isinstance(inputs[0], str):
            return [self.engine.tokenizer.encode(t) for t in inputs]
        return inputs

    def sample_json(self, r: SampleResult, with_logprobs: bool, with_text: bool, extra: dict | None = None,
                    routes: bool = False) -> dict:
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": _finish_json(r),
            "prompt_tokens": len(r.prompt_ids),
            "completion_tokens": len(r.output_ids),
            "cached_tokens": r.cached_tokens,
            "weight_version": r.weight_version,
            "e2e_latency": r.e2e_latency,
        }
        if r.weight_versions:
            meta["weight_versions"] = [
                {"version": s.version, "start": s.start, "end": s.end} for s in r.weight_versions
            ]
        if with_logprobs:
            tt = self.engine.token_text if with_text else (lambda _t: None)
            meta["output_token_logprobs"] = [[lp, t, tt(t)] for lp, t in zip(r.output_logprobs, r.output_ids)]
            if r.top_logprobs is not None:
                meta["output_top_logprobs"] = [[[lp, t, tt(t)] for lp, t in step] for step in r.top_logprobs]
        if routes and r.routed_experts is not None:
            meta[route_codec.SGLANG_FIELD] = route_codec.encode_sglang(r.routed_experts)
        meta.update(extra or {})
        return {"text": r.text if r.text is not None else "", "output_ids": r.output_ids, "meta_info": meta}

    # ---- inspection -------------------------------------------------------- #

    async def model_info(self, request: web.Request) -> web.Response:
        hf = self.engine.model.config
        return web.json_response(
            {
                "model_path": self.cfg.model,
                "tokenizer_path": self.cfg.model if self.engine.tokenizer is not None else None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.engine.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(hf, "model_type", None),
                "architectures": getattr(hf, "architectures", None),
                "device": str(self.engine.device),
                "dtype": str(next(self.engine.model.parameters()).dtype).removeprefix("torch."),
                "max_batch_size": self.cfg.max_batch_size,
                "engine": BUILTIN_ENGINE,
                # the update routes take ?ack=posted (see ack_posted): SGLang's, vLLM's
                "update_ack_posted": True,
                "vllm_update_ack_posted": True,
                # /end_weight_update takes the session's weight_version
                "end_weight_version": True,
            }
        )

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await json_body(request, self.limits.control)
        rid = _get(body, "rid", "str", None)
        if _get(body, "abort_all", "bool", False):
            n = await asyncio.to_thread(self.engine.abort_all, "aborted by /abort_request")
        elif rid:
            n = await asyncio.to_thread(self.engine.abort, rid, "aborted by /abort_request")
        else:
            raise BadRequest("give 'rid' or 'abort_all': true")
        return result(True, f"aborted {n} request(s)")

    async def get_load(self, request: web.Request) -> web.Response:
        return web.json_response([self.engine.load()])

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.alive else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        if not self.engine.alive:
            return web.Response(status=503)
        if self.engine.paused:  # a paused engine is healthy; a probe would only queue
            return web.Response(status=200)
        fut = self.engine.submit([0], SamplingParams(max_new_tokens=1, temperature=0.0), rid=f"health-{uuid.uuid4().hex[:8]}")
        try:
            await asyncio.wait_for(asyncio.wrap_future(fut), timeout=60)
        except Exception:
            return web.Response(status=503)
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        live = self.engine.num_live_requests()
        if live:
            return result(False, f"cannot flush the cache while {live} request(s) are running")
        return result(True, "cache flushed (the built-in server keeps no prefix cache)")
