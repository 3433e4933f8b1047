"""vLLM 0.33 HTTP protocol (see PROTOCOLS.md): request bodies and strict
parsing of responses, for /v1/completions and the weight-transfer routes.

The client-side twin of ``fleet/sglang.py``. The built-in server speaks the same
subset (``server/routes/vllm_openai.py``, ``server/routes/vllm_weights.py``), so everything here is
exercised against it in tests and checked against vLLM's own JSON schemas.

Logprob semantics differ between engines and are a deployment choice, not a
request field: vLLM 0.33 reports ``raw_logprobs`` (``log_softmax(logits)``,
before temperature) unless the server was started with
``--logprobs-mode processed_logprobs`` (after temperature *and* top-k/top-p).
The built-in server reports ``log_softmax(logits / T)`` untruncated on both of
its protocols. The three agree for greedy requests and for T=1 without
truncation, which is what a trainer that trusts rollout logprobs should use
(or recompute them).
"""

from __future__ import annotations

from typing import Any, Sequence

from torchtitan_grpo.protocol import route_codec
from torchtitan_grpo.fleet.types import Completion, MalformedResponse, SamplingParams, is_logprob, need, parse_spans
# The weight-transfer control plane (routes, bodies, parsers) is shared with the weight push:
# protocol.vllm, re-exported here.
from torchtitan_grpo.protocol.vllm import (  # noqa: F401
    DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_PACKED_NUM_BUFFERS, FINISH_WEIGHT_UPDATE, INIT_INFO_KEYS,
    INIT_WEIGHT_TRANSFER, PAUSE, PAUSE_MODES, RESUME, SHUTDOWN_WEIGHT_TRANSFER, START_WEIGHT_UPDATE,
    UPDATE_INFO_KEYS, UPDATE_WEIGHTS, WEIGHT_INFO, WORLD_SIZE, finish_weight_update_request,
    init_weight_transfer_request, parse_weight_info, parse_world_size, pause_query, update_weights_request)

FINISH_REASONS = ("stop", "length", "abort")
TOKEN_ID_PREFIX = "token_id:"
"""Token strings with ``return_tokens_as_token_ids``: ``"token_id:<id>"``."""

# Route paths (all POST but the GET).
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
GENERATE = "/generate"
"""vLLM's native generate body (what atroposlib's ``VLLMServer`` posts); the
built-in server answers it beside SGLang's body on the same path."""
MODELS = "/v1/models"  # GET


# --------------------------------------------------------------------------- #
# /v1/completions
# --------------------------------------------------------------------------- #


def completions_request(prompt_ids: Sequence[int], n: int, params: SamplingParams, model: str,
                        routes: bool = False) -> dict[str, Any]:
    """Body of POST /v1/completions for one token-id prompt and n samples, with
    the sampled token's logprob, token ids and weight-version spans per choice
    (``routes``: and the routed experts, which vLLM returns whenever it was
    started with --enable-return-routed-experts; the flag is SGLang's name,
    ignored by vLLM, refused by a built-in server that cannot answer it)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": [int(t) for t in prompt_ids],
        "max_tokens": params.max_new_tokens,
        "n": n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "stop_token_ids": list(params.stop_token_ids),
        "logprobs": 0,  # the sampled token only
        "return_token_ids": True,
        # Token strings become "token_id:<id>": no detokenization, and a check
        # that logprobs line up with token_ids.
        "return_tokens_as_token_ids": True,
        "return_weight_versions": True,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if routes:
        body[route_codec.REQUEST_FIELD] = True
    return body


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_logprobs(lp: Any, token_ids: list[int], replica: str, where: str) -> list[float]:
    need(isinstance(lp, dict), replica, where, "missing or not an object (was logprobs=0 sent?)")
    values = lp.get("token_logprobs")
    need(isinstance(values, list), replica, f"{where}.token_logprobs", "missing or not a list")
    need(len(values) == len(token_ids), replica, f"{where}.token_logprobs",
          f"{len(values)} entries for {len(token_ids)} token_ids")
    out = []
    for j, x in enumerate(values):
        need(is_logprob(x), replica, f"{where}.token_logprobs[{j}]", f"not a finite logprob: {x!r}")
        out.append(float(x))
    tokens = lp.get("tokens")
    if tokens is not None:
        need(isinstance(tokens, list) and len(tokens) == len(token_ids), replica, f"{where}.tokens",
              f"not a list of {len(token_ids)} strings")
        for j, t in enumerate(tokens):
            # With return_tokens_as_token_ids each entry names its id: it must
            # be the id at the same position, or the logprobs are misaligned.
            if isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX):
                need(t == f"{TOKEN_ID_PREFIX}{token_ids[j]}", replica, f"{where}.tokens[{j}]",
                      f"{t!r} does not match token_ids[{j}] = {token_ids[j]}")
    return out


def parse_completions(body: Any, n: int, replica: str, num_prompts: int = 1,
                      route_shape: tuple[int, int] | None = None) -> list[Completion]:
    """Validate and convert a /v1/completions reply for ``num_prompts`` prompts
    with n samples each (prompt-major: choice k is prompt k // n, sample k % n);
    ``route_shape`` (moe layers, top_k): decode the routed experts (one prompt)."""
    need(isinstance(body, dict), replica, "(top level)", "not a JSON object")
    if "error" in body and "choices" not in body:
        raise MalformedResponse(replica, "error", f"error reply in a 200 response: {str(body['error'])[:200]}")
    choices = body.get("choices")
    expected = n * num_prompts
    need(isinstance(choices, list), replica, "choices", "missing or not a list")
    need(len(choices) == expected, replica, "choices", f"expected {expected} choices, got {len(choices)}")
    out = []
    for k, c in enumerate(choices):
        where = f"choices[{k}]"
        need(isinstance(c, dict), replica, where, "not an object")
        need(c.get("index") == k, replica, f"{where}.index",
              f"expected {k} (prompt-major order), got {c.get('index')!r}")
        ids = c.get("token_ids")
        need(isinstance(ids, list) and all(_is_int(t) and t >= 0 for t in ids), replica, f"{where}.token_ids",
              "missing or not a list of token ids (was return_token_ids sent?)")
        logprobs = _parse_logprobs(c.get("logprobs"), ids, replica, f"{where}.logprobs")
        fr = c.get("finish_reason")
        need(fr in FINISH_REASONS, replica, f"{where}.finish_reason", f"expected one of {FINISH_REASONS}, got {fr!r}")
        # vLLM before 0.33 has no weight versions and leaves the field out (it
        # accepts and ignores return_weight_versions): the version is then
        # unknown here, and the producer labels the sample with the version its
        # group started under. A field that is there must be well formed.
        spans = ([] if "weight_versions" not in c else
                 parse_spans(c["weight_versions"], len(ids), replica, f"{where}.weight_versions"))
        versions = [v for v, _, _ in spans]
        # A choice without tokens (aborted before its first one) has no span,
        # hence no version: "" says so rather than inventing one.
        routes = None
        if route_shape is not None:
            at = f"{where}.{route_codec.VLLM_CHOICE_FIELD}"
            need(num_prompts == 1, replica, route_codec.VLLM_PROMPT_FIELD, "routed experts need one prompt per request")
            routes = route_codec.decode_vllm(body.get(route_codec.VLLM_PROMPT_FIELD),
                                             c.get(route_codec.VLLM_CHOICE_FIELD), *route_shape, replica, at)
            prompt_ids = c.get("prompt_token_ids")
            if isinstance(prompt_ids, list):
                route_codec.for_sample(routes, len(prompt_ids), len(ids), replica, at)
        out.append(Completion(ids, logprobs, fr, versions[-1] if versions else "", versions, replica, spans, routes))
    return out

