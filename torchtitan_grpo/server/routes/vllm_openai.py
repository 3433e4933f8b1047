"""vLLM 0.33's OpenAI routes on the built-in server: ``/v1/completions``
and ``/v1/models``. Errors use vLLM's shape (``vllm_http``); generation is
the :class:`Engine`'s, exactly as for the SGLang routes, so both protocols
serve the same model and the same version. ``"stream": true`` answers
server-sent events (``vllm_stream``); ``prompt_logprobs`` come from one
forward over the prompt (``prompt_logprobs``); ``max_tokens`` that does not
fit the context beside the prompt is vLLM's 400 (:func:`check_output_room`).

Deliberate differences from vLLM, each a 400 naming the field: echo,
suffix, beam search, structured output. Logprobs are
``log_softmax(logits / T)`` (the SGLang routes' quantity), not vLLM's default
raw logprobs. Unknown top-level fields are ignored, as vLLM ignores them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

from aiohttp import web

from torchtitan_grpo.server.engine import moe_routes
from torchtitan_grpo.protocol import route_codec
from torchtitan_grpo import jsonfast
from torchtitan_grpo.server.routes import logprob_json, prompt_logprobs as plp
from torchtitan_grpo.fleet import vllm as proto
from torchtitan_grpo.server.engine.engine import Engine
from torchtitan_grpo.server.httputil import BodyLimits, gc_paused, is_int as _is_int, json_reply, off_loop_if_large, read_json
from torchtitan_grpo.server.engine.requests import RequestError, SampleResult, SamplingParams, parse_stop
from torchtitan_grpo.server.vllm_http import (MAX_LOGPROBS, PauseGate, bad as _bad, check_model, field as _field, served_names,
                                                stop_reason, version_spans, vllm_api)

# Valid in vLLM but not implemented here: a value other than the default is a 400.
_UNSUPPORTED = {
    "echo": False, "suffix": None, "use_beam_search": False,
    "response_format": None, "structured_outputs": None, "prompt_embeds": None, "logprob_token_ids": None,
    "allowed_token_ids": None, "bad_words": None, "truncate_prompt_tokens": None,
}



@dataclass
class _CompletionCall:
    """A checked /v1/completions body."""

    prompts: list[list[int]]
    params: SamplingParams
    logprobs: int | None
    """None: no logprobs object; k: the sampled token plus the top k."""
    return_token_ids: bool
    tokens_as_ids: bool
    return_weight_versions: bool
    prompt_logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    routes: bool = False
    """Routed experts: ``prompt_routed_experts`` on the response, ``routed_experts`` per choice."""


def sampling_params(body: dict, max_new_tokens: int) -> SamplingParams:
    """Map vLLM's sampling fields (those its CompletionRequest,
    ChatCompletionRequest and SamplingParams share) onto engine
    :class:`SamplingParams`; ``max_new_tokens`` is resolved by the caller
    (each request type names and defaults it its own way)."""
    stop_t = parse_stop(body.get("stop"))
    if stop_t is None:
        raise _bad("'stop' must be a string or a list of strings", "stop")
    stop_ids = _field(body, "stop_token_ids", "list", [])
    if not all(_is_int(t) for t in stop_ids):
        raise _bad("'stop_token_ids' must be a list of integers", "stop_token_ids")
    bias = _field(body, "logit_bias", "dict", None)
    try:
        bias = {int(k): float(v) for k, v in bias.items()} if bias else None
    except (TypeError, ValueError):
        raise _bad("'logit_bias' must map token ids to numbers", "logit_bias") from None
    top_k = _field(body, "top_k", "int", -1)
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=_field(body, "temperature", "num", 1.0),
        top_p=_field(body, "top_p", "num", 1.0),
        top_k=-1 if top_k in (0, -1) else top_k,  # vLLM: 0 and -1 both keep all
        min_p=_field(body, "min_p", "num", 0.0),
        min_new_tokens=_field(body, "min_tokens", "int", 0),
        stop_token_ids=tuple(stop_ids),
        stop=stop_t,
        ignore_eos=_field(body, "ignore_eos", "bool", False),
        n=_field(body, "n", "int", 1),
        seed=_field(body, "seed", "int", None),
        repetition_penalty=_field(body, "repetition_penalty", "num", 1.0),
        frequency_penalty=_field(body, "frequency_penalty", "num", 0.0),
        presence_penalty=_field(body, "presence_penalty", "num", 0.0),
        logit_bias=bias,
        skip_special_tokens=_field(body, "skip_special_tokens", "bool", True),
        no_stop_trim=_field(body, "include_stop_str_in_output", "bool", False),
    )


def check_stream_options(body: dict) -> None:
    """vLLM refuses ``stream_options`` unless ``stream`` is true (its
    CompletionRequest validator), rather than ignoring it; so does this server."""
    options = body.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise _bad(f"'stream_options' must be an object, got {str(options)[:80]}", "stream_options")
    if options and body.get("stream") is not True:
        raise _bad("'stream_options' is only valid with 'stream': true (this request is not streamed); "
                   "drop it or stream", "stream_options")


def check_output_room(prompt_tokens: int, max_tokens: int, context: int, key: str = "max_tokens") -> None:
    """vLLM's context check of a request's explicit ``max_tokens`` (its
    renderer's ``TokenizeParams``): more than the context is refused naming
    ``key``, more than fits beside the prompt naming ``input_tokens``."""
    if max_tokens > context:
        raise _bad(f"{key}={max_tokens} cannot be greater than max_model_len={context}. Please request fewer "
                   f"output tokens. (parameter={key}, value={max_tokens})", key)
    if prompt_tokens + max_tokens > context:
        raise _bad(f"This model's maximum context length is {context} tokens. However, you requested {max_tokens} "
                   f"output tokens and your prompt contains {prompt_tokens} input tokens, for a total of "
                   f"{prompt_tokens + max_tokens} tokens. Please reduce the length of the input prompt or the number "
                   f"of requested output tokens. (parameter=input_tokens, value={prompt_tokens})", "input_tokens")


def stream_fields(body: dict) -> tuple[bool, bool, bool, int | None]:
    """(stream, include_usage, continuous_usage_stats, prompt_logprobs) of a
    completions or chat body, with vLLM's checks: ``stream_options`` only
    when streaming, ``prompt_logprobs`` in [0, 20] and not > 0 when streaming."""
    check_stream_options(body)
    stream = bool(_field(body, "stream", "bool", False))
    options = body.get("stream_options") or {}
    include = bool(_field(options, "include_usage", "bool", False, where="stream_options."))
    continuous = include and bool(_field(options, "continuous_usage_stats", "bool", False, where="stream_options."))
    k = _field(body, "prompt_logprobs", "int", None)
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise _bad(f"'prompt_logprobs' must be in [0, {MAX_LOGPROBS}], got {k}", "prompt_logprobs")
    if stream and k:
        raise _bad("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    return stream, include, continuous, k


_ENGINE_TO_VLLM = {"sampling_params.max_new_tokens": "max_tokens", "sampling_params.min_new_tokens": "min_tokens",
                   "sampling_params.sampling_seed": "seed", "sampling_params.": ""}


def vllm_names(message: str) -> str:
    """Engine messages use SGLang's field names; say vLLM's instead."""
    for engine_name, vllm_name in _ENGINE_TO_VLLM.items():
        message = message.replace(engine_name, vllm_name)
    return message


def refused_field(e: RequestError, default: str = "prompt") -> str:
    """The vLLM field an engine refusal names: the sampling field it refused
    (``n``, ``temperature``, ``max_tokens`` ...), else ``default``."""
    return vllm_names(f"sampling_params.{e.field}") if e.field else default


def refuse_unsupported(body: dict, unsupported: dict[str, Any]) -> None:
    """A field vLLM has but this server does not implement, sent with a value
    other than its default (``[]`` counts as the default: no bad words etc.)."""
    for key, default in unsupported.items():
        value = body.get(key)
        if value is not None and value != default and value != []:
            raise _bad(f"'{key}' is not supported by the built-in server", key)


def token_str(engine: Engine, token_id: int, as_id: bool) -> str:
    """:func:`logprob_json.token_name` of one id, its text fetched from the engine."""
    return token_names(engine, [token_id], as_id)[token_id]


def token_names(engine: Engine, token_ids: Iterable[int], as_id: bool,
                texts: list[str | None] | None = None) -> dict[int, str]:
    """:func:`token_str` of every distinct id in ``token_ids``, texts fetched
    in one :meth:`Engine.token_texts` call (a reply's tokens repeat: each is
    named once). ``texts``: those ids' texts when the caller has them already
    (``token_ids`` then distinct, in that order)."""
    ids = list(dict.fromkeys(token_ids))
    if as_id:
        texts = [None] * len(ids)
    elif texts is None:
        texts = engine.token_texts(ids)
    return {t: logprob_json.token_name(t, text, as_id) for t, text in zip(ids, texts)}


def top_entries(r: SampleResult, step: int, k: int) -> list[tuple[int, float]]:
    """vLLM's per-position logprob dict as ``(token_id, logprob)`` pairs:
    the sampled token first, then the top ``k`` by rank, each id once (the
    sampled token keeps the first place when it is among the top)."""
    out = {r.output_ids[step]: max(r.output_logprobs[step], logprob_json.FLOOR)}  # -inf is not JSON
    for top_lp, top_id in (r.top_logprobs[step] if r.top_logprobs else [])[:k]:
        out.setdefault(top_id, max(top_lp, logprob_json.FLOOR))
    return list(out.items())


def _merged(entries: list[tuple[int, float]], names: dict[int, str]) -> dict[str, float]:
    """One position's completions logprob dict: name -> logprob, the first
    entry kept where two ids share a name."""
    d: dict[str, float] = {}
    for t, lp in entries:
        d.setdefault(names[t], lp)
    return d


async def gather_samples(engine: Engine, gate: PauseGate, prompts: list[list[int]], params: SamplingParams,
                         rids: list[str], top_logprobs: int) -> list[list[SampleResult]]:
    """Submit every prompt and wait for all their samples; a client that goes
    away aborts what is still running. The pause gate is checked again right
    before the submit (nothing awaited in between): a request that was being
    read when ``/pause?mode=wait`` arrived is refused, not queued behind it."""
    gate.check()
    futures = [engine.submit(p, params, rid=rid, top_logprobs_num=top_logprobs) for p, rid in zip(prompts, rids)]
    try:
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
    except asyncio.CancelledError:
        for f, rid in zip(futures, rids):  # the client went away: stop its samples
            # (cancelling the wrapper also cancels f, so f.done() is no test)
            if f.cancelled() or not f.done():
                engine.abort(rid, "client disconnected", wait=False)
        raise


def routes_wanted(engine: Engine, body: dict, num_prompts: int) -> bool:
    """Whether a completion reply carries routed experts (``moe_routes.vllm_wanted``);
    a 400 naming the field when they were asked for and cannot be had."""
    asked = bool(_field(body, route_codec.REQUEST_FIELD, "bool", False))
    want, why = moe_routes.vllm_wanted(engine.cfg.return_routed_experts, engine.model, asked)
    if why:
        raise _bad(why, route_codec.REQUEST_FIELD)
    if want and num_prompts > 1:  # the prompt's rows are one field of the response
        raise _bad(f"routed experts are returned for one prompt per request, got {num_prompts}", "prompt")
    return want


def prompt_routes(samples: list[SampleResult], prompt_len: int) -> list | None:
    """The response's ``prompt_routed_experts`` (the prompt's rows, shared by its samples)."""
    r = next((r for r in samples if r.routed_experts is not None), None)
    return None if r is None else route_codec.encode_vllm(r.routed_experts, prompt_len)[0]


def choice_routes(r: SampleResult) -> list | None:
    """A choice's ``routed_experts`` (the completion's rows)."""
    return None if r.routed_experts is None else route_codec.encode_vllm(r.routed_experts, len(r.prompt_ids))[1]


class OpenAIRoutes:
    """vLLM 0.33's OpenAI completions routes over an :class:`Engine`."""

    def __init__(self, engine: Engine, cfg: Any, gate: PauseGate, limits: BodyLimits | None = None):
        self.engine = engine
        self.cfg = cfg
        """The server's ``ServerConfig``."""
        self.gate = gate
        """503 while vLLM's /pause (abort | wait) holds."""
        self.limits = limits or BodyLimits.for_engine(engine.max_context, engine.cfg.max_batch_size)
        self.served_names = served_names(cfg.model)
        self._created = int(time.time())

    def register(self, app: web.Application) -> None:
        r = app.router
        r.add_post(proto.COMPLETIONS, vllm_api(self.completions))
        r.add_get(proto.MODELS, vllm_api(self.models))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.gate.check()
        raw, body = await read_json(request, self.limits.generate)
        call = await off_loop_if_large(len(raw), self._parse_completions, body)  # it tokenises text prompts
        rids = [f"cmpl-{uuid.uuid4().hex}" for _ in call.prompts]
        if call.stream:
            from torchtitan_grpo.server.routes.vllm_stream import stream_completions

            return await stream_completions(self, request, body, call, rids)
        results = await gather_samples(self.engine, self.gate, call.prompts, call.params, rids,
                                       max(call.logprobs or 0, 0))
        prompt_lps = None
        if call.prompt_logprobs is not None:
            prompt_lps = await plp.compute_all(self.engine, call.prompts, [call.prompt_logprobs] * len(call.prompts))
        choices: list[dict] = []
        with gc_paused():  # a container per logprob token
            for i, samples in enumerate(results):  # prompt-major: index = prompt * n + sample
                for r in samples:
                    choices.append(self._choice(len(choices), r, call))
                    if prompt_lps is not None:
                        choices[-1]["prompt_logprobs"] = plp.vllm_prompt_logprobs(self.engine, prompt_lps[i])
        n_prompt = sum(len(p) for p in call.prompts)
        n_out = sum(len(r.output_ids) for samples in results for r in samples)
        reply = {
            "id": rids[0], "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or self.served_names[0], "choices": choices,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out},
        }
        if call.routes:
            reply[route_codec.VLLM_PROMPT_FIELD] = prompt_routes(results[0], len(call.prompts[0]))
        return json_reply(reply)

    def _parse_completions(self, body: dict) -> _CompletionCall:
        """Check a whole body (every prompt) before anything is queued; every
        field before any prompt is tokenised."""
        check_model(body, self.served_names)
        stream, include_usage, continuous_usage, prompt_lps = stream_fields(body)
        refuse_unsupported(body, _UNSUPPORTED)
        # An explicit null means "up to the context": the engine stops there anyway.
        explicit = not ("max_tokens" in body and body["max_tokens"] is None)
        max_tokens = _field(body, "max_tokens", "int", 16) if explicit else self.engine.max_context
        params = sampling_params(body, max_tokens)
        logprobs = _field(body, "logprobs", "int", None)
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise _bad(f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {logprobs}", "logprobs")
        prompts = self._prompts(body.get("prompt"))
        routes = routes_wanted(self.engine, body, len(prompts))
        for i, p in enumerate(prompts):
            try:
                self.engine.check_request(p, params)
            except RequestError as e:
                msg = vllm_names(str(e))
                if e.field:  # a sampling field: the same for every prompt
                    raise _bad(msg, refused_field(e)) from None
                raise _bad(f"prompt {i}: {msg}" if len(prompts) > 1 else msg, "prompt") from None
            if explicit:
                check_output_room(len(p), max_tokens, self.engine.max_context)
        return _CompletionCall(
            prompt_logprobs=prompt_lps, stream=stream, include_usage=include_usage, continuous_usage=continuous_usage,
            prompts=prompts, params=params, logprobs=logprobs,
            return_token_ids=bool(_field(body, "return_token_ids", "bool", False)),
            tokens_as_ids=bool(_field(body, "return_tokens_as_token_ids", "bool", False)),
            return_weight_versions=bool(_field(body, "return_weight_versions", "bool", False)),
            routes=routes,
        )

    def _prompts(self, prompt: Any) -> list[list[int]]:
        """str | [str] | [int] | [[int]] -> token-id prompts. Each is checked
        against the context by its length before its ids are scanned or its
        text tokenised (:meth:`Engine.check_prompt_text`)."""
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], (list, str)):
            self._check_ids(prompt, "prompt")
            return [prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            for i, p in enumerate(prompt):
                self._check_ids(p, f"prompt[{i}]")
            return prompt
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise _bad("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
                       "prompt")
        if self.engine.tokenizer is None:
            raise _bad("a text 'prompt' needs a tokenizer and this model has none; send token ids", "prompt")
        for i, t in enumerate(texts):
            try:
                self.engine.check_prompt_text(t, "prompt" if isinstance(prompt, str) else f"prompt[{i}]")
            except RequestError as e:
                raise _bad(str(e), "prompt") from None
        return [self.engine.tokenizer.encode(t) for t in texts]

    def _check_ids(self, ids: list, name: str) -> None:
        if len(ids) >= self.engine.max_context:
            raise _bad(f"'{name}' has {len(ids)} tokens; the model's context is {self.engine.max_context}", "prompt")
        if not ids or not all(_is_int(t) for t in ids):
            raise _bad(f"'{name}' must be a non-empty list of token ids", "prompt")

    def _logprobs(self, r: Any, k: int, as_ids: bool, offset: int = 0) -> Any:
        """OpenAI completions logprobs: per token its string, its logprob and a
        dict of the sampled token plus the top k (at most k+1 entries); text
        offsets count from ``offset`` (a stream's text sent before). With k 0
        and orjson: JSON text from per-id pieces (``logprob_json``)."""
        if k == 0 and jsonfast.Fragment is not None:
            return jsonfast.Fragment(
                logprob_json.completion_logprobs(self.engine, r.output_ids, r.output_logprobs, as_ids, offset))
        values = logprob_json.floored(r.output_logprobs)  # -inf is not JSON
        if k == 0:  # each position's dict is the sampled token alone: no merging needed
            names = token_names(self.engine, r.output_ids, as_ids)
            tokens = [names[t] for t in r.output_ids]
            tops = [{tok: v} for tok, v in zip(tokens, values)]
        else:
            entries = [top_entries(r, step, k) for step in range(len(r.output_ids))]
            names = token_names(self.engine, (t for e in entries for t, _ in e), as_ids)  # sampled ids included
            tokens = [names[t] for t in r.output_ids]
            tops = [_merged(e, names) for e in entries]
        offsets, pos = [], offset
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens, "top_logprobs": tops}

    def _choice(self, index: int, r: SampleResult, call: _CompletionCall) -> dict:
        choice: dict[str, Any] = {
            "index": index, "text": r.text or "",
            "logprobs": None if call.logprobs is None else self._logprobs(r, call.logprobs, call.tokens_as_ids),
            "finish_reason": r.finish_reason.kind, "stop_reason": stop_reason(r, call.params),
        }
        if call.return_token_ids:
            choice["prompt_token_ids"] = r.prompt_ids
            choice["token_ids"] = r.output_ids
        if call.return_weight_versions:
            choice["weight_versions"] = version_spans(r)
        if call.routes:
            choice[route_codec.VLLM_CHOICE_FIELD] = choice_routes(r)
        return choice

    async def models(self, request: web.Request) -> web.Response:
        # Every name /v1/completions accepts as 'model' (vLLM lists each
        # --served-model-name, all with the same root).
        cards = [{"id": name, "object": "model", "created": self._created, "owned_by": "vllm",
                  "root": self.cfg.model, "parent": None, "max_model_len": self.engine.max_context}
                 for name in self.served_names]
        return web.json_response({"object": "list", "data": cards})
