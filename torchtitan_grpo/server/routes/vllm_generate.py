"""vLLM's native ``/generate`` body on the built-in server: what atroposlib's
``VLLMServer`` handler posts (``server_type = "vllm"``, and so what its
``ManagedServer`` token and logprob tracking calls), as answered by the
``vllm_api_server.py`` of Atropos's example trainer (vLLM's old demo API
server with logprobs and token ids).

The path is SGLang's ``/generate`` too: ``server/app.py`` sends a body here when
it has ``prompt`` and neither of SGLang's ``text`` / ``input_ids``.

Request: ``{"prompt": str | {"prompt_token_ids": [int]} | {"prompt": str},
"stream": false, ...}`` where every other key is a field of vLLM's
``SamplingParams`` (``n``, ``max_tokens`` (16), ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``,
``min_tokens``, penalties, ``logit_bias``, ``logprobs`` (k: the sampled
token and the top k), ``skip_special_tokens``, ``include_stop_str_in_output``,
``detokenize``). vLLM builds ``SamplingParams(**rest)``, so an unknown key is
an error there; here it is a 400 naming it.

Reply: ``{"text": [str], "prompt": str, "finish_reasons": [str]}`` (one per
sample), and when ``logprobs`` is set also ``"logprobs"``: per sample, per
token ``[{"<token id>": logprob, ...}]`` (the sampled token first),
``"prompt_token_ids"`` and ``"token_ids"`` (per sample). Errors use vLLM's
shape; while vLLM's ``/pause`` (abort | wait) holds, a 503.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from torchtitan_grpo.server.engine.engine import Engine
from torchtitan_grpo.server.httputil import BodyLimits, is_int, json_reply, off_loop_if_large
from torchtitan_grpo.server.engine.requests import RequestError, SamplingParams
from torchtitan_grpo.server.vllm_http import MAX_LOGPROBS, PauseGate, VLLMError, bad, field
from torchtitan_grpo.server.routes.vllm_openai import gather_samples, refuse_unsupported, refused_field, sampling_params, top_entries, vllm_names

# vLLM SamplingParams fields this server implements (read by sampling_params
# or below); "prompt" and "stream" are the route's own.
SAMPLING_FIELDS = frozenset({
    "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "min_tokens", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
    "skip_special_tokens", "include_stop_str_in_output", "detokenize", "spaces_between_special_tokens",
})
# vLLM SamplingParams fields this server does not implement: a value other
# than the default is a 400 naming the field (``stream`` is the route's own).
_UNSUPPORTED = {
    "stream": False, "prompt_logprobs": None, "prompt_logprob_token_ids": None, "prompt_logprob_start": None,
    "logprob_token_ids": None, "flat_logprobs": False, "output_kind": None, "stream_interval": None,
    "skip_clone": False, "structured_outputs": None, "allowed_token_ids": None, "extra_args": None,
    "bad_words": None, "skip_reading_prefix_cache": None, "thinking_token_budget": None,
    "repetition_detection": None, "routed_experts_prompt_start": 0, "trace_decode_token_ids": None,
}


def is_vllm_generate_body(body: dict) -> bool:
    """A ``/generate`` body in vLLM's shape rather than SGLang's."""
    return "prompt" in body and "text" not in body and "input_ids" not in body


@dataclass
class _GenerateCall:
    prompt: list[int]
    prompt_text: str | None
    """The prompt as sent when it was text (vLLM echoes it), else None."""
    params: SamplingParams
    logprobs: int | None
    detokenize: bool


class VLLMGenerateRoute:
    """vLLM's native ``/generate`` over an :class:`Engine` (mounted by ``server/app.py``)."""

    def __init__(self, engine: Engine, gate: PauseGate, limits: BodyLimits | None = None):
        self.engine = engine
        self.gate = gate
        self.limits = limits or BodyLimits.for_engine(engine.max_context, engine.cfg.max_batch_size)

    async def generate_body(self, request: web.Request, raw: bytes, body: dict) -> web.Response:
        """/generate with its body read and parsed; errors in vLLM's shape."""
        try:
            self.gate.check()
            call = await off_loop_if_large(len(raw), self._parse, body)  # it tokenises a text prompt
            rid = f"generate-{uuid.uuid4().hex}"
            (samples,) = await gather_samples(self.engine, self.gate, [call.prompt], call.params, [rid],
                                              call.logprobs or 0)
        except VLLMError as e:
            return e.response()
        except RequestError as e:
            return bad(vllm_names(str(e))).response()
        prompt_text = call.prompt_text
        if prompt_text is None:
            prompt_text = self.engine.tokenizer.decode(call.prompt) if self.engine.tokenizer is not None else ""
        out: dict[str, Any] = {
            "text": [(r.text or "") if call.detokenize else "" for r in samples],
            "prompt": prompt_text,
            "finish_reasons": [r.finish_reason.kind for r in samples],
        }
        if call.logprobs is not None:
            out["logprobs"] = [[[{str(t): lp for t, lp in top_entries(r, step, call.logprobs)}]
                                for step in range(len(r.output_ids))] for r in samples]
            out["prompt_token_ids"] = call.prompt
            out["token_ids"] = [r.output_ids for r in samples]
        return json_reply(out)

    def _parse(self, body: dict) -> _GenerateCall:
        unknown = sorted(set(body) - SAMPLING_FIELDS - set(_UNSUPPORTED) - {"prompt"})
        if unknown:
            raise bad(f"unknown sampling parameter '{unknown[0]}': vLLM's SamplingParams has no such field",
                      unknown[0])
        refuse_unsupported(body, _UNSUPPORTED)
        if field(body, "spaces_between_special_tokens", "bool", True) is not True:
            raise bad("'spaces_between_special_tokens': false is not supported by the built-in server",
                      "spaces_between_special_tokens")
        params = sampling_params(body, field(body, "max_tokens", "int", 16))
        logprobs = field(body, "logprobs", "int", None)
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise bad(f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {logprobs}", "logprobs")
        prompt, text = self._prompt(body.get("prompt"))
        try:
            self.engine.check_request(prompt, params)
        except RequestError as e:
            raise bad(vllm_names(str(e)), refused_field(e)) from None
        return _GenerateCall(prompt, text, params, logprobs, field(body, "detokenize", "bool", True))

    def _prompt(self, prompt: Any) -> tuple[list[int], str | None]:
        """vLLM's single-prompt forms: a text, ``{"prompt": text}`` or
        ``{"prompt_token_ids": [...]}``."""
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise bad("'prompt' as an object must be {\"prompt_token_ids\": [...]} or {\"prompt\": \"...\"}",
                          "prompt")
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list) or not ids or not all(is_int(t) for t in ids):
                    raise bad("'prompt.prompt_token_ids' must be a non-empty list of token ids",
                              "prompt.prompt_token_ids")
                if len(ids) >= self.engine.max_context:
                    raise bad(f"'prompt.prompt_token_ids' has {len(ids)} tokens; the model's context is "
                              f"{self.engine.max_context}", "prompt.prompt_token_ids")
                return ids, None
        if not isinstance(prompt, str):
            raise bad("'prompt' must be a string or {\"prompt_token_ids\": [...]}", "prompt")
        if self.engine.tokenizer is None:
            raise bad("a text 'prompt' needs a tokenizer and this model has none; send prompt_token_ids", "prompt")
        try:
            self.engine.check_prompt_text(prompt, "prompt")
        except RequestError as e:
            raise bad(str(e), "prompt") from None
        return self.engine.tokenizer.encode(prompt), prompt
