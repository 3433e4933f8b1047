"""vLLM 0.33 HTTP protocol (see PROTOCOLS.md): request bodies and strict
parsing of responses, for /v1/completions and the weight-transfer routes.

The client-side twin of ``sglang.py``. The built-in server speaks the same
subset (``vllm_openai.py``, ``vllm_weights.py``), so everything here is
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

from torchtitan_grpo.inference.types import Completion, MalformedResponse, SamplingParams, is_logprob, need, parse_spans

FINISH_REASONS = ("stop", "length", "abort")
PAUSE_MODES = ("abort", "wait", "keep")
"""abort: end in-flight requests; wait: let them finish; keep: freeze them.
abort and wait answer new requests with 503 until /resume."""
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30
DEFAULT_PACKED_NUM_BUFFERS = 2
TOKEN_ID_PREFIX = "token_id:"
"""Token strings with ``return_tokens_as_token_ids``: ``"token_id:<id>"``."""

# The keys vLLM 0.33's NCCLWeightTransferInitInfo accepts (it is built with
# ``cls(**init_info)``, so any other key is a 400). ``nccl_unique_id_b64`` is
# the store-free rendezvous: exclusive with master_address/master_port.
INIT_INFO_KEYS = frozenset(
    {
        "master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64",
        "packed", "packed_buffer_size_bytes", "packed_num_buffers",
    }
)
UPDATE_INFO_KEYS = frozenset({"names", "dtype_names", "shapes"})

# Route paths (all POST except the three GETs).
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
GENERATE = "/generate"
"""vLLM's native generate body (what atroposlib's ``VLLMServer`` posts); the
built-in server answers it beside SGLang's body on the same path."""
INIT_WEIGHT_TRANSFER = "/init_weight_transfer_engine"
PAUSE = "/pause"
RESUME = "/resume"
START_WEIGHT_UPDATE = "/start_weight_update"
UPDATE_WEIGHTS = "/update_weights"
FINISH_WEIGHT_UPDATE = "/finish_weight_update"
SHUTDOWN_WEIGHT_TRANSFER = "/shutdown_weight_transfer_engine"
WEIGHT_INFO = "/weight_info"  # GET
WORLD_SIZE = "/get_world_size"  # GET
MODELS = "/v1/models"  # GET


# --------------------------------------------------------------------------- #
# /v1/completions
# --------------------------------------------------------------------------- #


def completions_request(prompt_ids: Sequence[int], n: int, params: SamplingParams, model: str) -> dict[str, Any]:
    """Body of POST /v1/completions for one token-id prompt and n samples, with
    the sampled token's logprob, token ids and weight-version spans per choice."""
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


def parse_completions(body: Any, n: int, replica: str, num_prompts: int = 1) -> list[Completion]:
    """Validate and convert a /v1/completions reply for ``num_prompts`` prompts
    with n samples each (prompt-major: choice k is prompt k // n, sample k % n)."""
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
        spans = parse_spans(c.get("weight_versions"), len(ids), replica, f"{where}.weight_versions")
        versions = [v for v, _, _ in spans]
        # A choice without tokens (aborted before its first one) has no span,
        # hence no version: "" says so rather than inventing one.
        out.append(Completion(ids, logprobs, fr, versions[-1] if versions else "", versions, replica, spans))
    return out


# --------------------------------------------------------------------------- #
# Weight-transfer control plane (bodies only; the pusher sends them)
# --------------------------------------------------------------------------- #


def init_weight_transfer_request(
    world_size: int,
    rank_offset: int = 1,
    master_address: str | None = None,
    master_port: int | None = None,
    *,
    nccl_unique_id_b64: str | None = None,
    packed: bool = False,
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
) -> dict[str, Any]:
    """Body of POST /init_weight_transfer_engine.

    Rendezvous through the trainer's TCP store (``master_address`` +
    ``master_port``) or, vLLM 0.33 only, through an NCCL unique id minted by
    the trainer (``nccl_unique_id_b64``): exactly one of the two.
    """
    by_store = master_address is not None or master_port is not None
    if by_store == (nccl_unique_id_b64 is not None):
        raise ValueError("give master_address and master_port, or nccl_unique_id_b64 (not both)")
    if by_store and (master_address is None or master_port is None):
        raise ValueError("master_address and master_port go together")
    if not 0 < rank_offset < world_size:
        raise ValueError(f"rank_offset must be in [1, world_size={world_size}), got {rank_offset}")
    if packed_buffer_size_bytes <= 0 or packed_num_buffers < 1:
        raise ValueError("packed_buffer_size_bytes must be > 0 and packed_num_buffers >= 1")
    info: dict[str, Any] = {"rank_offset": rank_offset, "world_size": world_size, "packed": packed,
                            "packed_buffer_size_bytes": packed_buffer_size_bytes,
                            "packed_num_buffers": packed_num_buffers}
    if by_store:
        info |= {"master_address": master_address, "master_port": master_port}
    else:
        info["nccl_unique_id_b64"] = nccl_unique_id_b64
    return {"init_info": info}


def pause_query(mode: str = "abort") -> dict[str, str]:
    """Query string of POST /pause (the mode is not a body field)."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
    return {"mode": mode}


def update_weights_request(names: Sequence[str], dtype_names: Sequence[str],
                           shapes: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Body of POST /update_weights. Dtype names are bare torch attribute
    names ("bfloat16"); whether the bytes come packed was fixed at init."""
    if not len(names) == len(dtype_names) == len(shapes):
        raise ValueError("names, dtype_names and shapes differ in length "
                         f"({len(names)}, {len(dtype_names)}, {len(shapes)})")
    bad = next((d for d in dtype_names if d.startswith("torch.")), None)
    if bad is not None:
        raise ValueError(f"dtype name {bad!r}: use the bare name, vLLM resolves it with getattr(torch, name)")
    return {"update_info": {"names": list(names), "dtype_names": list(dtype_names),
                            "shapes": [[int(x) for x in s] for s in shapes]}}


def finish_weight_update_request(weight_version: str | None) -> dict[str, Any]:
    """Body of POST /finish_weight_update: the version served from now on."""
    return {} if weight_version is None else {"weight_version": str(weight_version)}


def parse_weight_info(body: Any, replica: str) -> str:
    """The version a replica serves, from GET /weight_info."""
    need(isinstance(body, dict) and isinstance(body.get("weight_version"), str), replica, "weight_version",
          f"expected {{'weight_version': str}}, got {str(body)[:200]}")
    return body["weight_version"]


def parse_world_size(body: Any, replica: str) -> int:
    """Inference ranks behind a replica (TP*PP*DP), from GET /get_world_size:
    the trainer's group has world_size = 1 + the sum over replicas."""
    ws = body.get("world_size") if isinstance(body, dict) else None
    need(_is_int(ws) and ws >= 1, replica, "world_size", f"expected a positive integer, got {ws!r}")
    return ws
