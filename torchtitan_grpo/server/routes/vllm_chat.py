"""vLLM 0.33's ``/v1/chat/completions`` on the built-in server:
``messages`` rendered with the model's chat template (``chat_template``),
then generated exactly as ``/v1/completions`` does, answered in the shape of
vLLM's ``ChatCompletionResponse`` (or, with ``"stream": true``, as
``chat.completion.chunk`` events: ``vllm_stream``).

Request fields, as vLLM names them: ``messages``, ``model``, ``n``,
``max_completion_tokens`` (before ``max_tokens``; neither: up to the
context), ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``stop``,
``stop_token_ids``, ``seed``, ``ignore_eos``, ``min_tokens``, penalties,
``logit_bias``, ``skip_special_tokens``, ``include_stop_str_in_output``,
``logprobs`` (bool) + ``top_logprobs`` (0..20, needs ``logprobs``), and the
rendering fields ``add_generation_prompt``, ``continue_final_message``,
``add_special_tokens``, ``chat_template`` (needs
``--trust-request-chat-template``), ``chat_template_kwargs``, ``documents``,
``reasoning_effort`` (passed to the template), ``tools`` (rendered into the
prompt with ``tool_choice: "none"``; the server parses no tool calls).
vLLM's token-id extensions: ``return_token_ids`` (``prompt_token_ids`` at the
top, ``token_ids`` per choice), ``return_tokens_as_token_ids`` (logprob
tokens as ``"token_id:<id>"``), ``return_prompt_text`` (the rendered prompt)
and ``return_weight_versions`` (per-choice version spans).

Reply: ``{id: "chatcmpl-...", object: "chat.completion", created, model,
choices: [{index, message: {role: "assistant", content, ...}, logprobs:
{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}
| null, finish_reason, stop_reason, token_ids}], usage, prompt_token_ids}``.
As in vLLM, each position's ``top_logprobs`` are the first ``top_logprobs``
entries of its logprob dict, which holds the sampled token first.

A field of the wrong type is a 400 naming it; a vLLM field this server does
not implement (echo, beam search, structured output, tool-call parsing) is
a 400 naming it unless it has its default; an explicit ``max_tokens`` /
``max_completion_tokens`` that does not fit beside the prompt is vLLM's 400;
an unknown field is ignored and logged, as vLLM ignores it.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from torchtitan_grpo.server.routes import logprob_json, prompt_logprobs as plp
from torchtitan_grpo.protocol import route_codec
from torchtitan_grpo.fleet import vllm as proto
from torchtitan_grpo.models.chat_template import ChatRenderer, ChatTemplateError
from torchtitan_grpo.server.engine.engine import Engine
from torchtitan_grpo import jsonfast
from torchtitan_grpo.server.httputil import BodyLimits, gc_paused, json_reply, off_loop_if_large, read_json
from torchtitan_grpo.server.engine.requests import RequestError, SampleResult, SamplingParams
from torchtitan_grpo.server.vllm_http import MAX_LOGPROBS, PauseGate, bad, check_model, field, served_names, vllm_api
from torchtitan_grpo.server.routes.vllm_openai import check_output_room, choice_routes, gather_samples, prompt_routes, refuse_unsupported, routes_wanted, sampling_params, token_names, stream_fields, top_entries, vllm_names
from torchtitan_grpo.server.vllm_http import stop_reason, version_spans

logger = logging.getLogger("torchtitan_grpo.server")

# vLLM's ChatCompletionRequest fields this server does not implement: a value
# other than the default is a 400 naming the field.
_UNSUPPORTED = {
    "echo": False, "use_beam_search": False, "response_format": None,
    "structured_outputs": None, "logprob_token_ids": None, "allowed_token_ids": None, "bad_words": None,
    "truncate_prompt_tokens": None,
}
KNOWN_FIELDS = frozenset({
    *_UNSUPPORTED, "stream", "prompt_logprobs", "messages", "model", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "min_p", "stop", "stop_token_ids", "seed", "ignore_eos", "min_tokens", "repetition_penalty",
    "frequency_penalty", "presence_penalty", "logit_bias", "skip_special_tokens", "include_stop_str_in_output",
    "logprobs", "top_logprobs", "stream_options", "add_generation_prompt", "continue_final_message",
    "add_special_tokens", "chat_template", "chat_template_kwargs", "documents", "reasoning_effort", "tools",
    "tool_choice", "return_token_ids", "return_tokens_as_token_ids", "return_prompt_text", "return_weight_versions",
})
"""What this route reads; any other key is ignored (and logged once)."""


@dataclass
class _ChatCall:
    """A checked /v1/chat/completions body."""

    prompt: list[int]
    prompt_text: str
    params: SamplingParams
    logprobs: bool
    top_logprobs: int
    return_token_ids: bool
    tokens_as_ids: bool
    return_prompt_text: bool
    return_weight_versions: bool
    prompt_logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    routes: bool = False
    """Routed experts: ``prompt_routed_experts`` on the response, ``routed_experts`` per choice."""


class ChatRoutes:
    """vLLM 0.33's ``/v1/chat/completions`` over an :class:`Engine`."""

    def __init__(self, engine: Engine, cfg: Any, gate: PauseGate, limits: BodyLimits | None = None):
        self.engine = engine
        self.cfg = cfg
        """The server's ``ServerConfig`` (``chat_template``, ``trust_request_chat_template``)."""
        self.gate = gate
        self.limits = limits or BodyLimits.for_engine(engine.max_context, engine.cfg.max_batch_size)
        self.served_names = served_names(cfg.model)
        self.renderer = ChatRenderer(engine.tokenizer, getattr(cfg, "chat_template", None),
                                     getattr(cfg, "trust_request_chat_template", False))
        self._ignored_logged: set[frozenset] = set()

    def register(self, app: web.Application) -> None:
        app.router.add_post(proto.CHAT_COMPLETIONS, vllm_api(self.chat_completions))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self.gate.check()
        raw, body = await read_json(request, self.limits.generate)
        call = await off_loop_if_large(len(raw), self._parse, body)  # it renders and tokenises
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if call.stream:
            from torchtitan_grpo.server.routes.vllm_stream import stream_chat

            return await stream_chat(self, request, body, call, rid)
        (samples,) = await gather_samples(self.engine, self.gate, [call.prompt], call.params, [rid],
                                          call.top_logprobs if call.logprobs else 0)
        prompt_lps = None
        if call.prompt_logprobs is not None:
            (pl,) = await plp.compute_all(self.engine, [call.prompt], [call.prompt_logprobs])
            prompt_lps = plp.vllm_prompt_logprobs(self.engine, pl)
        n_out = sum(len(r.output_ids) for r in samples)
        routes = {route_codec.VLLM_PROMPT_FIELD: prompt_routes(samples, len(call.prompt))} if call.routes else {}
        with gc_paused():  # a dict and a list per logprob token
            choices = [self._choice(i, r, call) for i, r in enumerate(samples)]
        return json_reply({**routes,
            "id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model") or self.served_names[0],
            "choices": choices,
            "service_tier": None, "system_fingerprint": None,
            "usage": {"prompt_tokens": len(call.prompt), "total_tokens": len(call.prompt) + n_out,
                      "completion_tokens": n_out, "prompt_tokens_details": None},
            "prompt_logprobs": prompt_lps,
            "prompt_token_ids": call.prompt if call.return_token_ids else None,
            "prompt_text": call.prompt_text if call.return_prompt_text else None,
            "kv_transfer_params": None,
        })

    # ---- the request ------------------------------------------------------ #

    def _parse(self, body: dict) -> _ChatCall:
        """Check every field, then render and tokenise the chat."""
        check_model(body, self.served_names)
        stream, include_usage, continuous_usage, prompt_lps = stream_fields(body)
        refuse_unsupported(body, _UNSUPPORTED)
        self._log_ignored(body)
        if "messages" not in body:
            raise bad("missing required field 'messages'", "messages")
        # max_completion_tokens first (vLLM); neither: up to the context, where the engine stops
        completion_tokens = field(body, "max_completion_tokens", "int", None)
        tokens = field(body, "max_tokens", "int", None)
        max_key = "max_tokens" if completion_tokens is None else "max_completion_tokens"
        max_new = completion_tokens if completion_tokens is not None else tokens
        params = sampling_params(body, self.engine.max_context if max_new is None else max_new)
        logprobs = field(body, "logprobs", "bool", False)
        top = field(body, "top_logprobs", "int", 0)
        if not 0 <= top <= MAX_LOGPROBS:
            raise bad(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
        if top > 0 and not logprobs:
            raise bad("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        tools = self._tools(body)
        render = self._render_fields(body)
        try:
            text, prompt = self.renderer.render(body["messages"], tools=tools, check_text=self._check_text, **render)
        except ChatTemplateError as e:
            raise bad(str(e), e.param) from None
        try:
            self.engine.check_request(prompt, params)
        except RequestError as e:
            msg = vllm_names(str(e)).replace("max_tokens", max_key)
            first = msg.split(" ", 1)[0]  # the engine's messages start with the field they refuse, if any
            raise bad(msg, first if first in KNOWN_FIELDS else "messages") from None
        if max_new is not None:
            check_output_room(len(prompt), max_new, self.engine.max_context, max_key)
        return _ChatCall(
            prompt_logprobs=prompt_lps, stream=stream, include_usage=include_usage, continuous_usage=continuous_usage,
            prompt=prompt, prompt_text=text, params=params, logprobs=logprobs, top_logprobs=top,
            return_token_ids=field(body, "return_token_ids", "bool", False),
            tokens_as_ids=field(body, "return_tokens_as_token_ids", "bool", False),
            return_prompt_text=field(body, "return_prompt_text", "bool", False),
            return_weight_versions=field(body, "return_weight_versions", "bool", False),
            # As vLLM: routes whenever the server captures them (no request field on this route).
            routes=routes_wanted(self.engine, {}, 1),
        )

    def _check_text(self, text: str) -> None:
        """The rendered prompt, bounded by its length before it is tokenised."""
        try:
            self.engine.check_prompt_text(text, "messages")
        except RequestError as e:
            raise ChatTemplateError(str(e)) from None

    def _render_fields(self, body: dict) -> dict[str, Any]:
        cont = field(body, "continue_final_message", "bool", False)
        add_gen = field(body, "add_generation_prompt", "bool", None)
        if cont and add_gen:
            raise bad("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                      "continue_final_message")
        kwargs = dict(field(body, "chat_template_kwargs", "dict", {}))
        effort = field(body, "reasoning_effort", "str", None)
        if effort is not None:  # vLLM hands it to the template (and turns thinking on unless told)
            kwargs.setdefault("reasoning_effort", effort)
            kwargs.setdefault("enable_thinking", effort != "none")
        documents = field(body, "documents", "list", None)
        if documents is not None and not all(isinstance(d, dict) for d in documents):
            raise bad("'documents' must be a list of objects", "documents")
        return {
            "add_generation_prompt": (not cont) if add_gen is None else add_gen,
            "continue_final_message": cont,
            "add_special_tokens": field(body, "add_special_tokens", "bool", False),
            "chat_template": field(body, "chat_template", "str", None),
            "template_kwargs": kwargs,
            "documents": documents,
        }

    @staticmethod
    def _tools(body: dict) -> list | None:
        """``tools`` go into the prompt; parsing tool calls out of the reply
        (vLLM's ``--enable-auto-tool-choice``) is not done here, so only
        ``tool_choice: "none"`` is served (vLLM without that flag refuses the
        others too)."""
        tools = field(body, "tools", "list", None)
        choice = body.get("tool_choice")
        if tools == []:
            raise bad("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                      "entirely.", "tools")
        if tools is None:
            if choice not in (None, "none"):
                raise bad("When using `tool_choice`, `tools` must be set.", "tool_choice")
            return None
        for i, t in enumerate(tools):
            if not (isinstance(t, dict) and t.get("type", "function") == "function"
                    and isinstance(t.get("function"), dict)):
                raise bad(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{...}}}}", f"tools[{i}]")
        if choice != "none":
            raise bad(f"'tool_choice' {choice if choice is not None else 'auto'!r}: the built-in server parses no "
                      "tool calls; send \"tool_choice\": \"none\" (the tools are then rendered into the prompt "
                      "and the reply comes back as text)", "tool_choice")
        return tools

    def _log_ignored(self, body: dict) -> None:
        ignored = frozenset(body) - KNOWN_FIELDS
        if ignored and ignored not in self._ignored_logged and len(self._ignored_logged) < 64:
            self._ignored_logged.add(ignored)
            logger.warning("/v1/chat/completions: ignored field(s) %s (vLLM ignores them too)", sorted(ignored))

    # ---- the reply -------------------------------------------------------- #

    def _choice(self, index: int, r: SampleResult, call: _ChatCall) -> dict:
        choice: dict[str, Any] = {
            "index": index,
            "message": {"role": "assistant", "content": r.text or "", "refusal": None, "annotations": None,
                        "audio": None, "function_call": None, "reasoning": None},
            "logprobs": self._logprobs(r, call) if call.logprobs else None,
            "finish_reason": r.finish_reason.kind,
            "stop_reason": stop_reason(r, call.params),
            "token_ids": r.output_ids if call.return_token_ids else None,
        }
        if call.return_weight_versions:
            choice["weight_versions"] = version_spans(r)
        if call.routes:
            choice[route_codec.VLLM_CHOICE_FIELD] = choice_routes(r)
        return choice

    def _logprobs(self, r: SampleResult, call: _ChatCall) -> dict:
        """vLLM's ChatCompletionLogProbs: per output token its string, logprob
        and UTF-8 bytes (of its text), and the first ``top_logprobs`` entries
        of its position's logprob dict (sampled token first).

        With ``top_logprobs`` 0 (the default) and orjson, the array is JSON
        text made from per-id pieces (``logprob_json``); otherwise each
        distinct id's name and bytes are worked out once per reply."""
        k = call.top_logprobs
        if not k and jsonfast.Fragment is not None:
            return {"content": jsonfast.Fragment(
                logprob_json.chat_content(self.engine, r.output_ids, r.output_logprobs, call.tokens_as_ids))}
        tops = [top_entries(r, step, k)[:k] for step in range(len(r.output_ids))] if k else None
        ids = list(dict.fromkeys(r.output_ids if tops is None else [*r.output_ids, *(t for e in tops for t, _ in e)]))
        texts = self.engine.token_texts(ids)
        names = token_names(self.engine, ids, call.tokens_as_ids, texts)
        name_bytes = _utf8_of(names)
        token_bytes = _text_bytes(ids, texts, names, name_bytes)
        content = []
        for step, (t, lp) in enumerate(zip(r.output_ids, r.output_logprobs)):
            content.append({
                "token": names[t],
                "logprob": max(lp, logprob_json.FLOOR),  # -inf is not JSON
                "bytes": token_bytes[t],
                "top_logprobs": [] if tops is None else [
                    {"token": names[tid], "logprob": v, "bytes": name_bytes[tid]} for tid, v in tops[step]],
            })
        return {"content": content}


def _utf8_of(names: dict[int, str]) -> dict[int, list[int]]:
    """Each id's name as a list of UTF-8 byte values (one list per distinct
    string: json writes a shared list as often as it is referenced)."""
    by_text: dict[str, list[int]] = {}
    out = {}
    for t, name in names.items():
        b = by_text.get(name)
        if b is None:
            b = by_text[name] = logprob_json.utf8(name)
        out[t] = b
    return out


def _text_bytes(ids: list[int], texts: list[str | None], names: dict[int, str],
                name_bytes: dict[int, list[int]]) -> dict[int, list[int] | None]:
    """Each id's ``bytes`` field: the UTF-8 of its text, None when it has none.
    A token's name is its text unless it is named by id
    (``return_tokens_as_token_ids``), so the name's bytes serve where they match."""
    return {t: None if text is None else name_bytes[t] if names[t] == text
            else logprob_json.utf8(text) for t, text in zip(ids, texts)}
