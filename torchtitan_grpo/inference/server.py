"""Built-in inference server: an HF model behind SGLang's HTTP protocol (and
vLLM's /v1/completions + weight-transfer subset, see ``server_vllm.py``).

    python -m torchtitan_grpo.inference.server --model DIR --port 30000 \
        [--host 127.0.0.1] [--device cpu|cuda|cuda:N] [--dtype auto|float32|bfloat16|float16] \
        [--seed 0] [--max-batch-size 64] [--api-key KEY] [--weight-group-timeout 300] \
        [--num-threads N] [--debug-update-delay-s X] [--debug-decode-delay-s S]

It is the embedded default backend and the stand-in for SGLang in tests, so
the routes below follow docs PROTOCOLS.md field by field (request names,
defaults, reply shapes, status codes). Generation and weight loading live in
:mod:`torchtitan_grpo.inference.engine`; this module only parses and answers
HTTP. ``--port 0`` picks a free port; the ``ready http://HOST:PORT`` line on
stdout says which.

Deliberate differences from SGLang, all answered with a 400 naming the field
rather than silently ignored: ``stream``, prompt logprobs
(``logprob_start_len`` >= 0) and structured output (``json_schema``, ``regex``,
``ebnf``, ``structural_tag``, ``stop_regex``) are not supported. The server has
no cross-request prefix cache, so ``flush_cache`` has nothing to drop.
Weight updates are received during a session (``/begin_weight_update`` ..
``/end_weight_update``, and vLLM's ``start`` .. ``finish``) and loaded as one
version when it ends: generation never runs on half of a version, and a
session that fails or is abandoned loads nothing.

``--debug-update-delay-s X`` is a test knob: every weight-update handler of
either protocol sleeps X seconds after receiving, to play a slow replica in
fault tests and benchmarks. ``--debug-decode-delay-s S`` is its generation
twin: every decode step of the engine's batch takes S seconds longer.

Bounded requests: a body is refused with 413 past its route's limit
(``BodyLimits``: generation bodies sized from the context and batch, weight
metadata larger, control bodies small) before it is read, a text prompt is
refused by its length before it is tokenised, large bodies are parsed off
the event loop, and a body or field of the wrong type is a 400 naming it.

``--api-key KEY``: every route but ``/health`` and ``/health_generate`` needs
``Authorization: Bearer KEY``, the vLLM routes included (see ``_middlewares``).
Without a key the server warns at start-up when it listens beyond loopback:
its weight routes load whatever they are sent.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hmac
import ipaddress
import json
import logging
import os
import signal
import sys
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import torch
from aiohttp import web

from torchtitan_grpo.inference.engine import (
    PAUSE_MODES,
    parse_stop,
    Engine,
    EngineConfig,
    FlatLayout,
    PendingVersion,
    PostedReceive,
    post_receive,
    receive_check,
    ModelLoadError,
    RequestError,
    SampleResult,
    SamplingParams,
    WeightUpdateError,
    read_safetensors_dir,
)

from torchtitan_grpo.inference.server_vllm import (
    JSON_KINDS,
    BodyError,
    BodyLimits,
    VLLMRoutes,
    ack_posted,
    debug_update_delay,
    off_loop_if_large,
    parse_json_async,
    read_body,
    read_json,
)
from torchtitan_grpo.inference.types import BUILTIN_ENGINE
from torchtitan_grpo.weight_sync import ipc
from torchtitan_grpo.weight_sync.buckets import TensorSpec, specs_from_lists
from torchtitan_grpo.weight_sync.ipc import IpcFormatError

logger = logging.getLogger("torchtitan_grpo.inference.server")

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
_OPEN_PATHS = frozenset({"/health", "/health_generate"})
"""Routes answered without the API key: liveness probes only. SGLang exempts
its /health* routes (and /metrics); vLLM's current middleware exempts /health
and a few read-only probes (/ping, /load, /version, /metrics, docs) and guards
everything else, weight transfer included (older vLLM guarded only /v1/*).
Here every other route of both protocols needs the key."""


class BadRequest(Exception):
    """Turns into HTTP 400 ``{"object": "error", "message": ...}``."""


# --------------------------------------------------------------------------- #
# Small parsing helpers (each error names the field)
# --------------------------------------------------------------------------- #


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _get(body: dict, key: str, kind: str, default: Any = None, required: bool = False, where: str = "") -> Any:
    """Read ``body[key]`` checking its JSON type; None/absent gives ``default``."""
    name = f"{where}{key}"
    if key not in body or body[key] is None:
        if required:
            raise BadRequest(f"missing required field {name!r}")
        return default
    v = body[key]
    ok, expected = JSON_KINDS[kind]
    if not ok(v):
        raise BadRequest(f"field {name!r} must be {expected}, got {json.dumps(v)[:80]}")
    return float(v) if kind == "num" else v


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


def _finish_json(r: SampleResult) -> dict | None:
    f = r.finish_reason
    if f is None:
        return None
    if f.kind == "stop":
        return {"type": "stop", "matched": f.matched}
    if f.kind == "length":
        return {"type": "length", "length": f.length}
    return {"type": "abort", "message": f.message, "status_code": None}


# --------------------------------------------------------------------------- #
# The SGLang route set
# --------------------------------------------------------------------------- #


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


@dataclass
class ServerConfig:
    """Command-line settings of the built-in server."""

    model: str
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "cpu"
    dtype: str = "auto"
    seed: int = 0
    max_batch_size: int = 64
    api_key: str | None = None
    """If set, every route except /health and /health_generate needs
    ``Authorization: Bearer KEY``."""
    weight_group_timeout_s: float = 300.0
    """Rendezvous and per-broadcast timeout of weight-update groups."""
    num_threads: int | None = None
    debug_update_delay_s: float = 0.0
    """Test knob: every weight-update handler (both protocols) sleeps this long
    after receiving, to simulate a slow replica. 0 in production."""
    debug_decode_delay_s: float = 0.0
    """Debug knob for benchmarks: every decode step of the engine's batch takes
    this much longer (a replica N times slower at generating). 0 in
    production."""


class SGLangRoutes:
    """SGLang 0.5.23's /generate and weight-update routes over an :class:`Engine`."""

    def __init__(self, engine: Engine, cfg: ServerConfig, limits: BodyLimits | None = None):
        self.engine = engine
        self.cfg = cfg
        self.limits = limits or BodyLimits.for_engine(engine.max_context, engine.cfg.max_batch_size)
        self.groups: dict[str, Any] = {}  # group_name -> WeightGroup
        # The open weight-update session (buckets arrive one request at a
        # time; /end_weight_update loads them as one version), or None.
        self.session: PendingVersion | None = None
        # Receives and copies run here, off the event loop and one at a time.
        self._transfer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-transfer")
        self._update_lock = asyncio.Lock()
        self._updates_seen: dict[bytes, _BucketUpdate] = {}
        """An update's body (one without a version) -> what it says, parsed once."""

    def register(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        # State changes run to completion even if their caller hangs up.
        r.add_post("/init_weights_update_group", _shielded(self.init_weights_update_group))
        r.add_post("/begin_weight_update", _shielded(self.begin_weight_update))
        r.add_post("/update_weights_from_distributed", _shielded(self.update_weights_from_distributed))
        r.add_post("/end_weight_update", _shielded(self.end_weight_update))
        r.add_post("/destroy_weights_update_group", _shielded(self.destroy_weights_update_group))
        r.add_post("/update_weights_from_disk", _shielded(self.update_weights_from_disk))
        r.add_post("/update_weights_from_tensor", _shielded(self.update_weights_from_tensor))
        r.add_post("/update_weight_version", _shielded(self.update_weight_version))
        r.add_post("/pause_generation", _shielded(self.pause_generation))
        r.add_post("/continue_generation", _shielded(self.continue_generation))
        r.add_get("/get_weights_by_name", self.get_weights_by_name)
        r.add_post("/get_weights_by_name", self.get_weights_by_name)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_post("/abort_request", _shielded(self.abort_request))
        r.add_get("/get_load", self.get_load)
        r.add_get("/flush_cache", self.flush_cache)
        r.add_post("/flush_cache", self.flush_cache)

    def close(self) -> None:
        for g in self.groups.values():
            try:
                g.close()
            except Exception as e:  # shutting down anyway
                logger.warning("closing weight group %s: %s", g.group_name, e)
        self.groups.clear()
        self._transfer.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._transfer, fn, *args)

    # ---- generation ------------------------------------------------------ #

    async def generate(self, request: web.Request) -> web.Response:
        raw, body = await read_json(request, self.limits.generate)
        call = await off_loop_if_large(len(raw), self._parse_generate, body)  # it tokenises text prompts
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
        out = [
            self._sample_json(r, call.want_logprobs[i], call.text_in_logprobs)
            for i, samples in enumerate(results)
            for r in samples
        ]
        return web.json_response(out[0] if call.single else out)

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
        if any(start != -1 for start in _per_prompt(body, "logprob_start_len", "int", -1, n)):
            raise BadRequest(
                "field 'logprob_start_len' >= 0 asks for prompt logprobs, which the built-in server "
                "does not compute; use -1 (output tokens only)"
            )
        want_logprobs = _per_prompt(body, "return_logprob", "bool", False, n)
        rids = _per_prompt(body, "rid", "str", None, n)
        text_in_logprobs = _get(body, "return_text_in_logprobs", "bool", False)
        if _get(body, "stream", "bool", False):
            raise BadRequest("field 'stream': streaming is not supported by the built-in server")
        prompts = self._tokenize(inputs)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                self.engine.check_request(prompt, p)
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
            # One object for one prompt and one sample; a prompt-major array otherwise.
            single=n == 1 and params[0].n == 1 and self._single_prompt_input(body),
        )

    @staticmethod
    def _single_prompt_input(body: dict) -> bool:
        """``"text": "..."`` or ``"input_ids": [1, 2]`` (not a batch of one)."""
        if body.get("text") is not None:
            return isinstance(body["text"], str)
        ids = body.get("input_ids")
        return isinstance(ids, list) and (not ids or not isinstance(ids[0], list))

    def _prompt_inputs(self, body: dict) -> list[str] | list[list[int]]:
        """The prompts as sent (texts or token ids), their types and lengths
        checked, none tokenised yet: a text is bounded by its length in
        characters and ids by their count, each against the context."""
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise BadRequest("exactly one of 'text' and 'input_ids' must be given")
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

    def _sample_json(self, r: SampleResult, with_logprobs: bool, with_text: bool) -> dict:
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
        return {"text": r.text if r.text is not None else "", "output_ids": r.output_ids, "meta_info": meta}

    # ---- weight-update session and groups -------------------------------- #

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _json_body(request, self.limits.control)
        address = _get(body, "master_address", "str", required=True)
        port = _get(body, "master_port", "int", required=True)
        rank_offset = _get(body, "rank_offset", "int", required=True)
        world_size = _get(body, "world_size", "int", required=True)
        group_name = _get(body, "group_name", "str", "weight_update_group")
        backend = _get(body, "backend", "str", "nccl")
        if not group_name:
            return _result(False, "field 'group_name' must not be empty")
        if group_name in self.groups:
            return _result(False, f"a weight update group named {group_name!r} already exists")
        if backend not in ("nccl", "gloo"):
            return _result(False, f"field 'backend' must be 'nccl' or 'gloo', got {backend!r}")
        if backend == "nccl" and self.engine.device.type != "cuda":
            return _result(False, f"field 'backend': nccl needs a CUDA device and this server runs on "
                                  f"{self.engine.device}; use 'gloo'")
        if not 0 < rank_offset < world_size:
            return _result(False, f"field 'rank_offset' must be in [1, world_size={world_size}), got {rank_offset}")
        from torchtitan_grpo.weight_sync.group import init_weight_group

        try:
            # Blocks until rank 0 (the trainer) joins; a plain thread keeps the
            # event loop (and any transfer on another group) going meanwhile.
            group = await asyncio.to_thread(
                init_weight_group, address, port, rank_offset, world_size, backend, group_name,
                self.cfg.weight_group_timeout_s, self.engine.device if backend == "nccl" else None,
            )
        except Exception as e:
            logger.warning("joining weight group %s failed: %s", group_name, e)
            return _result(False, f"could not join weight update group {group_name!r} at "
                                  f"{address}:{port}: {type(e).__name__}: {e}")
        if group_name in self.groups:  # lost a race with a concurrent init of the same name
            group.close()
            return _result(False, f"a weight update group named {group_name!r} already exists")
        self.groups[group_name] = group
        return _result(True, f"joined weight update group {group_name!r} as rank {rank_offset} of {world_size} ({backend})")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _json_body(request, self.limits.control)
        group_name = _get(body, "group_name", "str", "weight_update_group")
        stuck = self.groups.get(group_name)
        if stuck is not None and (self._update_lock.locked()
                                  or (self.session is not None and self.session.in_flight(stuck))):
            # An update may be stuck in a receive on this group (its trainer
            # gone, or its transfer abandoned at a deadline): aborting ends an
            # NCCL receive at once; a gloo one only ends at its timeout
            # (--weight-group-timeout), and the destroy waits for it.
            await asyncio.to_thread(stuck.abort)
        async with self._update_lock:
            group = self.groups.pop(group_name, None)
            if group is None:
                return _result(False, f"no weight update group named {group_name!r}")
            await asyncio.to_thread(group.close)
            if self.session is not None and (self.session.received_any or self.session.version is not None):
                self.session.fail(f"group {group_name!r} was destroyed during the session")
        return _result(True, f"weight update group {group_name!r} destroyed")

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        body = await _json_body(request, self.limits.control)
        selector = _get(body, "selector", "str", "all")
        if selector not in ("all", "target", "draft"):
            return _result(False, f"field 'selector' must be 'all', 'target' or 'draft', got {selector!r}")
        if self.session is not None:
            return _result(False, "a weight update session is already open; call /end_weight_update first")
        self.session = PendingVersion()
        return _result(True, "weight update session open")

    async def end_weight_update(self, request: web.Request) -> web.Response:
        """Close the session and load what it received, all at once (waiting,
        unless paused, for running requests to finish). Our extension:
        ``weight_version`` (str), the version loaded, in place of one that
        an update carried; a trainer that sends it here sends the same
        update bodies every version (``end_weight_version`` in /model_info)."""
        version = _get(await _json_body(request, self.limits.control), "weight_version", "str", None)
        if self.session is None:
            return _result(False, "no weight update session is open (call /begin_weight_update first)")
        async with self._update_lock:  # let an update in flight finish first
            session, self.session = self.session, None
            try:
                n = await self._run(session.load, self.engine, version)
            except WeightUpdateError as e:
                return _result(False, f"weight update session closed; {e}")
        return _result(True, f"weight update session closed; loaded {n} tensor(s), serving weight "
                             f"version {self.engine.weight_version!r}")

    def _keep(self, named: list, version: str | None, what: str, adopt: list[bool] | None = None,
              posted: PostedReceive | None = None, **extra: Any) -> web.Response:
        self.session.keep(named, version, adopt, posted)
        return _result(True, f"received {what}; loaded at /end_weight_update", **extra)

    def _refuse(self, message: str, **extra: Any) -> web.Response:
        """A received update that cannot be loaded fails its whole session."""
        self.session.fail(message)
        return _result(False, message, **extra)

    def _require_session(self) -> None:
        if self.session is None:
            raise _Refused(
                "no weight update session is open: call /begin_weight_update before updating weights "
                "(nothing was received)"
            )

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        raw = await read_body(request, self.limits.weights)
        # A trainer sends the same buckets every version, with the version in
        # none of them (it comes with the session's end): each distinct body
        # is parsed once, its specs and layout kept, and the first receive of
        # each version goes out ~0.5 ms sooner (269 tensors on an H200 host).
        update = self._updates_seen.get(raw)
        version = None
        if update is None:
            body = await parse_json_async(raw)
            names = _get(body, "names", "list", required=True)
            dtypes = _get(body, "dtypes", "list", required=True)
            shapes = _get(body, "shapes", "list", required=True)
            group_name = _get(body, "group_name", "str", "weight_update_group")
            _get(body, "flush_cache", "bool", True)  # nothing to flush: no prefix cache
            abort_all = _get(body, "abort_all_requests", "bool", False)
            version = _get(body, "weight_version", "str", None)
            load_format = _get(body, "load_format", "str", None)
            try:
                specs = _tensor_specs(names, dtypes, shapes)
            except _Refused as e:
                return _result(False, str(e))
            update = _BucketUpdate(specs, group_name, abort_all, load_format,
                                   FlatLayout.of(specs) if load_format == "flattened_bucket" else None)
            if version is None:  # a body with a version is seen once
                if len(self._updates_seen) >= 256:
                    self._updates_seen.clear()
                self._updates_seen[raw] = update
        try:
            # Everything that can be refused is refused before the first receive:
            # a receive posted for a refused update would desynchronise the group.
            try:
                ack = ack_posted(request)
            except ValueError as e:
                raise _Refused(str(e)) from None
            self._require_session()
            if update.load_format not in (None, "flattened_bucket"):
                raise _Refused(f"field 'load_format' must be null or 'flattened_bucket', got {update.load_format!r}")
            flattened = update.load_format == "flattened_bucket"
            group = self.groups.get(update.group_name)
            if group is None:
                raise _Refused(f"no weight update group named {update.group_name!r} "
                               "(call /init_weights_update_group)")
        except _Refused as e:
            return _result(False, str(e))
        async with self._update_lock:
            if update.abort_all:
                await asyncio.to_thread(self.engine.abort_all, "aborted for a weight update")
            try:
                # Checked while the bytes arrive, refused once they have (the
                # group stays in step). ``?ack=posted``: checked first, answered
                # once posted; the session's end waits for the bytes.
                check, adopt = receive_check(self.engine, group.device)
                if ack and update.accepted is not None:
                    # Checked first, this would hold the receive back by a few ms
                    # per bucket; the parameters' names, shapes and dtypes never
                    # change, so a bucket once accepted stays accepted.
                    check, adopt = None, update.accepted
                posted = await self._run(receive_update, ack, group, update.specs, flattened, check,
                                         update.layout)
                cut_views_later(self._transfer, posted)
                if ack and check is not None:
                    update.accepted = adopt
            except WeightUpdateError as e:
                return self._refuse(f"{'refused, nothing received' if ack else 'received, not loaded'}: {e}")
            except Exception as e:
                logger.warning("weight receive on %s failed: %s", update.group_name, e)
                return self._refuse(f"receiving weights on group {update.group_name!r} failed: "
                                    f"{type(e).__name__}: {e}")
            await debug_update_delay(self.cfg)
            return self._keep(posted.named, version, f"{len(posted.named)} tensor(s)", adopt=adopt, posted=posted)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _json_body(request, self.limits.control)
        path = _get(body, "model_path", "str", required=True)
        load_format, version, abort_all = _load_fields(body)
        try:
            self._require_session()
            if load_format not in (None, "auto", "safetensors"):
                raise _Refused(f"field 'load_format' must be null, 'auto' or 'safetensors', got {load_format!r}")
        except _Refused as e:
            return _result(False, str(e))
        async with self._update_lock:
            if abort_all:
                await asyncio.to_thread(self.engine.abort_all, "aborted for a weight update")
            paused = self.engine.num_live_requests() if self.engine.paused else 0
            try:
                named = await self._run(self._read_checked, path)
            except WeightUpdateError as e:
                return self._refuse(str(e), num_paused_requests=paused)
            except Exception as e:
                return self._refuse(f"cannot read weights from {path!r}: {type(e).__name__}: {e}",
                                    num_paused_requests=paused)
            await debug_update_delay(self.cfg)
            return self._keep(named, version, f"{len(named)} tensor(s) from {path}", num_paused_requests=paused)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """SGLang's same-host update: ``serialized_named_tensors`` holds one
        entry per TP rank (this server is one rank), each mapping tensors of
        the sender's memory (CUDA IPC or a shared-memory file, see
        ``weight_sync.ipc``). They are copied into memory of this server
        before the reply, so the sender may reuse its buffers once answered."""
        body = await _json_body(request, self.limits.weights)
        entries = _get(body, "serialized_named_tensors", "list", required=True)
        load_format, version, abort_all = _load_fields(body)
        try:
            self._require_session()
            if len(entries) != 1:
                raise _Refused(f"field 'serialized_named_tensors' must hold one entry per TP rank, and this server "
                               f"is one rank: got {len(entries)}")
            if load_format is not None:
                raise _Refused(f"field 'load_format' must be null (a list of (name, tensor) pairs), got "
                               f"{load_format!r}")
        except _Refused as e:
            return _result(False, str(e))
        async with self._update_lock:
            if abort_all:
                await asyncio.to_thread(self.engine.abort_all, "aborted for a weight update")
            try:
                named, adopt = await self._run(self._copy_shared, entries[0])
            except WeightUpdateError as e:
                return self._refuse(str(e))
            except IpcFormatError as e:
                return self._refuse(f"field 'serialized_named_tensors' entry 0 {e}")
            await debug_update_delay(self.cfg)
            return self._keep(named, version, f"{len(named)} tensor(s) by reference", adopt)

    def _copy_shared(self, entry: str) -> tuple[list, list[bool]]:
        shared = ipc.deserialize(entry)
        device = self.engine.device
        self.engine.check_weights([TensorSpec.of(n, t) for n, t in shared])  # names and shapes first
        # One pass over the bytes: the copy casts to the parameter's dtype, and the
        # session's end then installs these tensors as the parameters (no second copy).
        named = [(n, torch.empty(t.shape, dtype=self.engine.param_spec(n).dtype, device=device).copy_(t))
                 for n, t in shared]
        adopt = self.engine.check_received([TensorSpec.of(n, t) for n, t in named], device)
        if device.type == "cuda":  # the sender reuses its buffers once answered: the copies must be done
            torch.cuda.current_stream(device).synchronize()
        return named, adopt

    def _read_checked(self, path: str) -> list:
        named = read_safetensors_dir(path, self.engine.device)
        self.engine.check_weights([TensorSpec.of(n, t) for n, t in named])
        return named

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json_body(request, self.limits.control)
        version = _get(body, "new_version", "str", required=True)
        if _get(body, "abort_all_requests", "bool", True):
            await asyncio.to_thread(self.engine.abort_all, "aborted by /update_weight_version")
        self.engine.set_weight_version(version)
        return _result(True, f"serving weight version {version!r}")

    # ---- pause / resume --------------------------------------------------- #

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await _json_body(request, self.limits.control)
        mode = _get(body, "mode", "str", "abort")
        if mode not in PAUSE_MODES:
            return _result(False, f"field 'mode' must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        kept = await asyncio.to_thread(self.engine.pause, mode)
        return _result(True, f"generation paused (mode={mode}); {kept} request(s) waiting")

    async def continue_generation(self, request: web.Request) -> web.Response:
        await _json_body(request, self.limits.control)
        self.engine.resume()
        return _result(True, "generation resumed")

    # ---- inspection -------------------------------------------------------- #

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        if request.method == "GET":  # query values are strings
            name = request.query.get("name")
            try:
                size = int(request.query.get("truncate_size", 100))
            except ValueError:
                raise BadRequest("field 'truncate_size' must be an integer") from None
        else:
            body = await _json_body(request, self.limits.control)
            name = _get(body, "name", "str", required=True)
            size = _get(body, "truncate_size", "int", 100)
        if not name:
            raise BadRequest("missing required field 'name'")
        try:
            values = await asyncio.to_thread(self.engine.get_weights, name, size)
        except RequestError as e:
            raise BadRequest(str(e)) from None
        return web.json_response(values)

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
        body = await _json_body(request, self.limits.control)
        rid = _get(body, "rid", "str", None)
        if _get(body, "abort_all", "bool", False):
            n = await asyncio.to_thread(self.engine.abort_all, "aborted by /abort_request")
        elif rid:
            n = await asyncio.to_thread(self.engine.abort, rid, "aborted by /abort_request")
        else:
            raise BadRequest("give 'rid' or 'abort_all': true")
        return _result(True, f"aborted {n} request(s)")

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
            return _result(False, f"cannot flush the cache while {live} request(s) are running")
        return _result(True, "cache flushed (the built-in server keeps no prefix cache)")


class _Refused(Exception):
    """A weight-update request refused before anything was received."""


@dataclass
class _BucketUpdate:
    """An SGLang update request's fields, parsed once per distinct body."""

    specs: list[TensorSpec]
    group_name: str
    abort_all: bool
    load_format: str | None
    layout: FlatLayout | None
    """``flattened_bucket``'s layout (None for per-tensor broadcasts)."""
    accepted: list[bool] | None = None
    """Its adopt flags, once it was checked and accepted with ``?ack=posted``."""


def _load_fields(body: dict) -> tuple[str | None, str | None, bool]:
    """``load_format``, ``weight_version`` and ``abort_all_requests`` of an
    update from disk or by reference (``flush_cache`` is checked: there is no
    prefix cache to flush)."""
    _get(body, "flush_cache", "bool", True)
    return (_get(body, "load_format", "str", None), _get(body, "weight_version", "str", None),
            _get(body, "abort_all_requests", "bool", False))


def _tensor_specs(names: list, dtypes: list, shapes: list) -> list[TensorSpec]:
    """SGLang's ``names``/``dtypes``/``shapes``; a bad entry is refused naming
    its field and index (``field 'dtypes[3]' (tensor 'x'): ...``)."""
    try:
        return specs_from_lists(names, dtypes, shapes)
    except ValueError as e:
        raise _Refused(str(e)) from None


def receive_update(ack: bool, group: Any, specs: list[TensorSpec], flattened: bool,
                   check: Any, layout: FlatLayout | None = None) -> PostedReceive:
    """One update's receive on the transfer thread (one hop either way):
    posted, then, unless ``ack``, waited for."""
    posted = post_receive(group, specs, flattened, check, check_first=ack, layout=layout)
    if not ack:
        posted.wait()
    return posted


def cut_views_later(transfer: concurrent.futures.Executor, posted: PostedReceive) -> None:
    """After the reply to an update answered once posted: its views are cut
    on the (one) transfer thread while its bytes arrive, ahead of the next
    update's post. ``wait`` cuts them if this never ran."""
    if posted.cut is not None:
        try:
            transfer.submit(posted.cut_views)
        except RuntimeError:  # shut down: ``wait``, if it ever comes, cuts them
            pass


def _shielded(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Handlers are cancelled when the client disconnects (so abandoned
    generations stop); a weight update or pause must not stop half-way."""

    async def run(request: web.Request) -> web.StreamResponse:
        return await asyncio.shield(handler(request))

    return run


def _result(success: bool, message: str, **extra: Any) -> web.Response:
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


async def _json_body(request: web.Request, limit: int) -> dict:
    """A body of at most ``limit`` bytes as a JSON object (``BodyError`` otherwise)."""
    return (await read_json(request, limit))[1]


# --------------------------------------------------------------------------- #
# App and entry point
# --------------------------------------------------------------------------- #


def _authorized(header: str | None, api_key: str) -> bool:
    """``Authorization: Bearer KEY``, compared in constant time (a plain ``==``
    returns at the first differing byte, which leaks the key's prefix)."""
    expected = f"Bearer {api_key}".encode()
    return hmac.compare_digest((header or "").encode("utf-8", "surrogateescape"), expected)


def _middlewares(cfg: ServerConfig) -> list:
    @web.middleware
    async def errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        try:
            return await handler(request)
        except (BadRequest, RequestError) as e:
            return web.json_response({"object": "error", "message": str(e)}, status=400)
        except BodyError as e:
            return web.json_response({"object": "error", "message": str(e)}, status=e.status)
        except web.HTTPException:  # aiohttp's own answers (404, 405, ...)
            raise
        except Exception as e:
            # A bug, not the client's fault; still a JSON answer naming it
            # rather than aiohttp's bare 500.
            logger.exception("%s %s failed", request.method, request.path)
            return web.json_response({"object": "error", "message": f"internal error: {type(e).__name__}: {e}"},
                                     status=500)

    @web.middleware
    async def auth(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        # Outermost: an unauthorized body is never read. Both protocols' routes
        # pass here (the vLLM ones too), so the key guards every weight route.
        if cfg.api_key and request.path not in _OPEN_PATHS:
            if not _authorized(request.headers.get("Authorization"), cfg.api_key):
                # Both SGLang and vLLM answer exactly this.
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return [auth, errors]


def build_app(engine: Engine, cfg: ServerConfig) -> tuple[web.Application, SGLangRoutes]:
    limits = BodyLimits.for_engine(engine.max_context, cfg.max_batch_size)
    # Each route reads at most its own limit (read_body); aiohttp's is the backstop.
    app = web.Application(client_max_size=limits.largest, middlewares=_middlewares(cfg))
    routes = SGLangRoutes(engine, cfg, limits)
    routes.register(app)
    vllm_routes = VLLMRoutes(engine, cfg, limits)  # the vLLM subset beside SGLang's
    vllm_routes.register(app)

    async def close_vllm(_app: web.Application) -> None:
        vllm_routes.close()

    app.on_cleanup.append(close_vllm)
    return app, routes


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_grpo.inference.server",
        description="Built-in inference server (SGLang and vLLM HTTP protocols) for an HF causal LM.",
    )
    p.add_argument("--model", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--port", type=int, required=True, help="TCP port (0 = pick a free one)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    p.add_argument("--max-batch-size", type=int, default=64, help="most sequences decoded together")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and /health_generate")
    p.add_argument("--weight-group-timeout", type=float, default=300.0,
                   help="seconds to wait for the trainer to join a weight group / finish a broadcast")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--debug-update-delay-s", type=float, default=0.0,
                   help="TEST KNOB: sleep this long in every weight-update handler after receiving "
                        "(simulates a slow replica for fault tests and benchmarks)")
    p.add_argument("--debug-decode-delay-s", type=float, default=0.0, metavar="S",
                   help="DEBUG KNOB for benchmarks: the engine sleeps S seconds in every decode step of "
                        "its batch, so this replica generates more slowly than its peers (default 0: off)")
    a = p.parse_args(argv)
    if a.max_batch_size < 1:
        p.error("--max-batch-size must be >= 1")
    if a.debug_update_delay_s < 0:
        p.error("--debug-update-delay-s must be >= 0")
    if not a.debug_decode_delay_s >= 0:  # (NaN too)
        p.error("--debug-decode-delay-s must be >= 0")
    if not a.device.startswith(("cpu", "cuda")):
        p.error(f"--device must be cpu, cuda or cuda:N, got {a.device!r}")
    return ServerConfig(
        model=a.model, host=a.host, port=a.port, device=a.device, dtype=a.dtype, seed=a.seed,
        max_batch_size=a.max_batch_size, api_key=a.api_key,
        weight_group_timeout_s=a.weight_group_timeout, num_threads=a.num_threads,
        debug_update_delay_s=a.debug_update_delay_s, debug_decode_delay_s=a.debug_decode_delay_s,
    )


def engine_config(cfg: ServerConfig) -> EngineConfig:
    return EngineConfig(cfg.model, cfg.device, cfg.dtype, cfg.seed, cfg.max_batch_size,
                        debug_decode_delay_s=cfg.debug_decode_delay_s)


def exposure_warning(cfg: ServerConfig) -> str | None:
    """What to warn about when the server listens beyond this host without an
    API key (None when it does not): anyone who can reach the port can
    generate, and the weight routes load whatever weights they are sent."""
    if cfg.api_key or _is_loopback(cfg.host):
        return None
    return (f"the server listens on {cfg.host} WITHOUT --api-key: anyone who can reach this port "
            "can generate, pause generation and replace the model's weights (the update routes load whatever "
            "they are sent, from the network, from a path on this host, or from shared memory). Bind to "
            "127.0.0.1 or start it with --api-key KEY.")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


async def serve(engine: Engine, cfg: ServerConfig) -> None:
    """Serve until SIGINT/SIGTERM."""
    app, routes = build_app(engine, cfg)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else cfg.port
    warning = exposure_warning(cfg)
    if warning:
        logger.warning("%s\n!!! %s\n%s", "!" * 100, warning, "!" * 100)
    # Before "ready": a supervisor may stop the server as soon as it reads it.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    logger.info("ready: model %s on http://%s:%d (device %s)", cfg.model, cfg.host, port, engine.device)
    print(f"ready http://{cfg.host}:{port}", flush=True)
    await stop.wait()
    logger.info("shutting down")
    engine.shutdown()
    routes.close()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=os.environ.get("LOGLEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    import torch

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    try:
        engine = Engine(engine_config(cfg))
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    engine.start()
    code = 0
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(serve(engine, cfg))
    except OSError as e:  # port in use, bad host
        print(f"error: cannot listen on {cfg.host}:{cfg.port}: {e}", file=sys.stderr, flush=True)
        engine.shutdown()
        code = 3
    # A thread may still sit in a collective (a trainer that vanished mid-push)
    # or in a rendezvous; waiting for it would hang shutdown until its timeout.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
