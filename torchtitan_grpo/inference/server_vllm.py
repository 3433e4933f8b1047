"""vLLM 0.33's HTTP subset on the built-in server (mounted by ``server.py``).

Routes: ``/v1/completions`` (non-streaming), ``/v1/models``, and the RL
weight-transfer routes a trainer drives (``/init_weight_transfer_engine``,
``/pause``, ``/resume``, ``/is_paused``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``, ``/weight_info``,
``/get_world_size``, ``/shutdown_weight_transfer_engine``). ``/health`` is
shared with the SGLang routes (same meaning); ``/update_weight_version`` is
SGLang's (it aborts live requests unless ``abort_all_requests`` is false).
Errors use vLLM's shape: ``{"error": {"message", "type", "param", "code"}}``.

Generation and weight loading are :class:`Engine`'s, exactly as for the SGLang
routes, so both protocols serve the same model and the same version.

The transfer group is ours (``weight_sync/group.py``: gloo on a CPU server,
NCCL on a GPU one), joined as rank ``rank_offset`` (the server is one worker)
under the group name :data:`GROUP_NAME`; a trainer pushing to the built-in
server joins with ``init_weight_group(..., rank=0, group_name=GROUP_NAME)``.
Real vLLM speaks a different rendezvous: see ``weight_sync/vllm_group.py``.

Deliberate differences from vLLM, each a 400 naming the field: streaming,
echo, suffix, prompt logprobs, beam search, structured output, and the
``nccl_unique_id_b64`` rendezvous. Logprobs are ``log_softmax(logits / T)``
(the SGLang routes' quantity), not vLLM's default raw logprobs.

Request bodies (both protocols, :func:`read_json`): each route reads at most
its :class:`BodyLimits` share (413 past it, refused from ``Content-Length``
before a byte is read), a body that is not UTF-8 JSON is a 400 naming the
body, and a large body is parsed on a worker thread so ``/health`` answers
meanwhile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import torch
from aiohttp import web

from torchtitan_grpo.inference import vllm as proto
from torchtitan_grpo.inference.engine import (
    Engine,
    PendingVersion,
    receive_check,
    RequestError,
    SampleResult,
    SamplingParams,
    parse_stop,
    SpecCheck,
    WeightUpdateError,
    PostedReceive,
    receive_weights,
    run_check,
)
from torchtitan_grpo.weight_sync.group import Posted
from torchtitan_grpo.weight_sync.buckets import (
    SpecError,
    TensorSpec,
    offsets,
    plan_packed_chunks,
    slots,
    specs_from_lists,
)

logger = logging.getLogger("torchtitan_grpo.inference.server")

GROUP_NAME = "vllm_weight_transfer"
"""Group name of the built-in server's transfer group (trainer must match)."""
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
# Valid in vLLM but not implemented here: a value other than the default is a 400.
_UNSUPPORTED = {
    "stream": False, "echo": False, "suffix": None, "prompt_logprobs": None, "use_beam_search": False,
    "response_format": None, "structured_outputs": None, "prompt_embeds": None, "logprob_token_ids": None,
    "allowed_token_ids": None, "bad_words": None, "truncate_prompt_tokens": None,
}


class VLLMError(Exception):
    """Becomes ``{"error": {...}}`` with HTTP ``code``."""

    _TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestEntityTooLargeError",
              500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, code: int, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param

    def response(self) -> web.Response:
        err = {"message": self.message, "type": self._TYPES.get(self.code, "BadRequestError"),
               "param": self.param, "code": self.code}
        return web.json_response({"error": err}, status=self.code)


def _bad(message: str, param: str | None = None) -> VLLMError:
    return VLLMError(400, message, param)


def _vllm_api(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Answer errors in vLLM's shape (the app's middleware would use SGLang's)."""

    async def run(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except VLLMError as e:
            return e.response()
        except BodyError as e:
            return VLLMError(e.status, str(e)).response()
        except RequestError as e:  # the engine refused a prompt or a parameter
            return _bad(str(e)).response()

    return run


def _shielded(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """State changes run to completion even if their caller hangs up."""

    async def run(request: web.Request) -> web.StreamResponse:
        return await asyncio.shield(handler(request))

    return run


# --------------------------------------------------------------------------- #
# Field helpers (each error names the field)
# --------------------------------------------------------------------------- #


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


JSON_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (_is_int, "an integer"),
    "num": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
}


def _field(body: dict, key: str, kind: str, default: Any = None, where: str = "") -> Any:
    """``body[key]`` checked against ``kind``; absent or null gives ``default``."""
    v = body.get(key)
    if v is None:
        return default
    ok, expected = JSON_KINDS[kind]
    if not ok(v):
        raise _bad(f"'{where}{key}' must be {expected}, got {str(v)[:80]}", f"{where}{key}")
    return float(v) if kind == "num" else v


# --------------------------------------------------------------------------- #
# Request bodies (shared with the SGLang routes)
# --------------------------------------------------------------------------- #

MiB = 1 << 20
_CONTROL_BODY = 1 * MiB
"""Control routes (pause, sessions, groups, versions): a few fields each."""
_WEIGHT_BODY = 256 * MiB
"""Weight-update metadata: per tensor a name, dtype and shape (~100 B), or a
pickled shared-memory / CUDA IPC handle in base64 (~1 KB); a 100k-tensor
checkpoint stays well under this. Also the cap of every other limit."""
_BYTES_PER_PROMPT_TOKEN = 32
"""JSON bytes one prompt token may take: an id (``"151643, "``: 8) or its text
(a few characters, up to 6 bytes each as a ``\\u`` escape) with headroom."""
_PARSE_OFF_LOOP = 256 * 1024
"""Bodies past this many bytes are parsed on a worker thread (a few ms of
``json.loads`` on the event loop would hold /health and every other route)."""


class BodyError(Exception):
    """A request body refused before (or while) it is parsed: HTTP ``status``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class BodyLimits:
    """Most bytes a request body may have, per kind of route: each sized to
    what a legitimate request needs, so a huge body is refused before it is
    read, parsed or tokenised (aiohttp's own ``client_max_size`` is only the
    backstop: the largest of these)."""

    generate: int
    """/generate and /v1/completions."""
    control: int = _CONTROL_BODY
    weights: int = _WEIGHT_BODY
    """Weight updates: name lists, shapes, by-reference handles."""

    @classmethod
    def for_engine(cls, max_context: int, max_batch_size: int) -> BodyLimits:
        # A body holding more prompt tokens than the whole batch's context could
        # never run at once; batches of many short prompts fit all the same.
        tokens = max_batch_size * max_context
        return cls(generate=min(_CONTROL_BODY + tokens * _BYTES_PER_PROMPT_TOKEN, _WEIGHT_BODY))

    @property
    def largest(self) -> int:
        return max(self.generate, self.control, self.weights)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The raw body, at most ``limit`` bytes (else :class:`BodyError` 413).
    A declared ``Content-Length`` past the limit is refused before anything
    is read; a chunked body is read only until it passes the limit."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyError(413, f"request body of {declared} bytes is larger than this route takes ({limit} bytes)")
    parts: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > limit:
            raise BodyError(413, f"request body is larger than this route takes ({limit} bytes)")
        parts.append(chunk)
    return b"".join(parts)


def parse_json_object(raw: bytes) -> dict:
    """A body as a JSON object (empty: ``{}``); :class:`BodyError` 400 naming
    what is wrong with the body otherwise."""
    if not raw or raw.isspace():  # (no stripped copy of a large body)
        return {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"request body is not UTF-8 text (byte {e.start} is 0x{raw[e.start]:02x}); "
                             "send a JSON object") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise BodyError(400, "request body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and e.g. an integer of too many digits
        raise BodyError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BodyError(400, f"request body must be a JSON object, got a JSON {type(body).__name__}")
    return body


async def off_loop_if_large(nbytes: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, on a worker thread when the body it works on has more
    than :data:`_PARSE_OFF_LOOP` bytes (parsing or tokenising megabytes on
    the event loop would stall /health and every other route meanwhile);
    inline otherwise (a thread hop costs more than a small body's parse)."""
    if nbytes > _PARSE_OFF_LOOP:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def parse_json_async(raw: bytes) -> dict:
    """:func:`parse_json_object`, on a worker thread for a large body."""
    return await off_loop_if_large(len(raw), parse_json_object, raw)


async def read_json(request: web.Request, limit: int) -> tuple[bytes, dict]:
    """(raw bytes, JSON object) of a body of at most ``limit`` bytes."""
    raw = await read_body(request, limit)
    return raw, await parse_json_async(raw)


# --------------------------------------------------------------------------- #
# /v1/completions
# --------------------------------------------------------------------------- #


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


def _sampling_params(body: dict, max_context: int) -> SamplingParams:
    """Map vLLM's CompletionRequest fields onto engine :class:`SamplingParams`."""
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
    # An explicit null means "up to the context": the engine stops there anyway.
    max_tokens = max_context if "max_tokens" in body and body["max_tokens"] is None else \
        _field(body, "max_tokens", "int", 16)
    return SamplingParams(
        max_new_tokens=max_tokens,
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


def _check_stream_options(body: dict) -> None:
    """vLLM refuses ``stream_options`` unless ``stream`` is true (its
    CompletionRequest validator), rather than ignoring it; so does this
    server (which then refuses ``stream`` itself, naming that field)."""
    options = body.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise _bad(f"'stream_options' must be an object, got {str(options)[:80]}", "stream_options")
    if options and body.get("stream") is not True:
        raise _bad("'stream_options' is only valid with 'stream': true (this request is not streamed); "
                   "drop it or stream", "stream_options")


_ENGINE_TO_VLLM = {"sampling_params.max_new_tokens": "max_tokens", "sampling_params.min_new_tokens": "min_tokens",
                   "sampling_params.sampling_seed": "seed", "sampling_params.": ""}


def _vllm_names(message: str) -> str:
    """Engine messages use SGLang's field names; say vLLM's instead."""
    for engine_name, vllm_name in _ENGINE_TO_VLLM.items():
        message = message.replace(engine_name, vllm_name)
    return message


def _version_spans(r: SampleResult) -> list[dict]:
    """vLLM reports spans covering every output token, even when the version
    never changed (the engine records spans only on a change)."""
    if r.weight_versions:
        return [{"version": s.version, "start": s.start, "end": s.end} for s in r.weight_versions]
    n = len(r.output_ids)
    return [{"version": r.weight_version, "start": 0, "end": n}] if n else []


# --------------------------------------------------------------------------- #
# Weight transfer state
# --------------------------------------------------------------------------- #


@dataclass
class _TransferInfo:
    """A checked ``init_info`` (what the receive side must agree on)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int = proto.DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = proto.DEFAULT_PACKED_NUM_BUFFERS
    """Only paces vLLM's double buffering; the bytes on the wire do not depend
    on it, and the built-in server's receive (``receive_packed``) ignores it."""


def _parse_init_info(info: Any) -> _TransferInfo:
    if not isinstance(info, dict):
        raise _bad("'init_info' must be an object", "init_info")
    unknown = sorted(set(info) - proto.INIT_INFO_KEYS)
    if unknown:
        raise _bad(f"Invalid init_info: unexpected key(s) {unknown}; accepted: {sorted(proto.INIT_INFO_KEYS)}",
                   f"init_info.{unknown[0]}")
    if info.get("nccl_unique_id_b64") is not None:
        raise _bad("init_info.nccl_unique_id_b64: the built-in server rendezvouses through "
                   "master_address/master_port only", "init_info.nccl_unique_id_b64")
    w = "init_info."
    for key in ("master_address", "master_port", "rank_offset", "world_size"):
        if info.get(key) is None:
            raise _bad(f"missing required field '{w}{key}'", f"{w}{key}")
    t = _TransferInfo(
        master_address=_field(info, "master_address", "str", where=w),
        master_port=_field(info, "master_port", "int", where=w),
        rank_offset=_field(info, "rank_offset", "int", where=w),
        world_size=_field(info, "world_size", "int", where=w),
        packed=_field(info, "packed", "bool", False, where=w),
        packed_buffer_size_bytes=_field(info, "packed_buffer_size_bytes", "int",
                                        proto.DEFAULT_PACKED_BUFFER_SIZE_BYTES, where=w),
        packed_num_buffers=_field(info, "packed_num_buffers", "int", proto.DEFAULT_PACKED_NUM_BUFFERS, where=w),
    )
    if not 0 < t.master_port < 65536:
        raise _bad(f"'{w}master_port' must be in [1, 65535], got {t.master_port}", f"{w}master_port")
    # This server is one worker, so its rank is rank_offset itself.
    if not 0 < t.rank_offset < t.world_size:
        raise _bad(f"'{w}rank_offset' must be in [1, world_size={t.world_size}), got {t.rank_offset}",
                   f"{w}rank_offset")
    if t.packed_buffer_size_bytes <= 0 or t.packed_num_buffers < 1:
        raise _bad(f"'{w}packed_buffer_size_bytes' must be > 0 and '{w}packed_num_buffers' >= 1",
                   f"{w}packed_buffer_size_bytes")
    return t


def _parse_update_info(info: Any, previous: list[TensorSpec] | None) -> list[TensorSpec]:
    """Specs of one /update_weights call; all-empty lists reuse the previous
    call's (vLLM 0.33 lets a trainer ship unchanged metadata only once)."""
    if isinstance(info, list):
        raise _bad("'update_info' as a list (per-worker payloads) is not supported: the built-in "
                   "server is one worker", "update_info")
    if not isinstance(info, dict):
        raise _bad("'update_info' must be an object", "update_info")
    unknown = sorted(set(info) - proto.UPDATE_INFO_KEYS)
    if unknown:
        raise _bad(f"Invalid update_info: unexpected key(s) {unknown}; packing is fixed by init_info",
                   f"update_info.{unknown[0]}")
    w = "update_info."
    names = _field(info, "names", "list", [], where=w)
    dtypes = _field(info, "dtype_names", "list", [], where=w)
    shapes = _field(info, "shapes", "list", [], where=w)
    if not (names or dtypes or shapes):
        if previous is None:
            raise _bad("empty update_info reuses the previous call's metadata, and there was none", "update_info")
        return previous
    try:
        return specs_from_lists(names, dtypes, shapes, ("names", "dtype_names", "shapes"), prefix=w,
                                empty_names=False)
    except SpecError as e:
        raise _bad(str(e), e.field or "update_info") from None


def post_packed(group: Any, specs: list[TensorSpec], buffer_bytes: int,
                num_buffers: int = proto.DEFAULT_PACKED_NUM_BUFFERS,
                check: SpecCheck | None = None,
                chunks: list[list[TensorSpec]] | None = None) -> PostedReceive:
    """Post the receives of vLLM packed-mode chunks: one uint8 broadcast per
    chunk, cut exactly as the sender cuts (``plan_packed_chunks``). Returns
    once every receive is posted, the views cut and ``check`` passed; the
    bytes arrive meanwhile (``PostedReceive.wait``).

    Each chunk is received into a buffer of its own, and a tensor whose byte
    offset in its chunk is a multiple of its itemsize is returned as a typed
    view of that buffer: no copy, and ``install_weights`` adopts the view as
    the parameter's storage. Only the others (offsets made odd by mixed
    itemsizes, e.g. an fp32 tensor after a bf16 one of odd length) are copied
    out into tensors of their own once their chunk is in: on GPUs on a second
    CUDA stream that waits for the chunk, on CPU (gloo) by ``wait``. Every
    receive is posted before any view is cut or copy queued, and nothing
    waits on the host, so the link is never idle between chunks; only the
    last chunk's copies (if any) follow its receive.

    Memory: the chunk buffers add up to the update's bytes, plus a copy of
    each unaligned tensor (in practice the few odd-sized small ones between
    bf16 weights). That replaces per-tensor destinations (the update's bytes)
    plus up to ``num_buffers`` chunk buffers, so it is no more than before
    unless unaligned tensors outweigh those buffers. A buffer is freed once
    no view of it is used (a chunk of unaligned tensors only: at return).
    ``num_buffers`` means nothing here: a real vLLM worker double-buffers its
    receives with it, so it stays for protocol compatibility. ``check``
    (``Engine.check_weights``) runs while the chunks arrive; what it raises is
    raised once every chunk is in (the group stays in step with the sender).
    ``chunks``: ``plan_packed_chunks(specs, buffer_bytes)`` when the caller
    has it already.
    """
    if chunks is None:
        chunks = plan_packed_chunks(specs, buffer_bytes)
    if not chunks:
        return PostedReceive([], group)
    cuda = group.device.type == "cuda"
    # Streams named by device: this runs on a worker thread, whose current
    # device need not be the group's (an event recorded on "the current
    # stream" there would order nothing).
    main = torch.cuda.current_stream(group.device) if cuda else None
    received = [_post_chunk(group, chunk, main) for chunk in chunks]
    side = torch.cuda.Stream(group.device) if cuda and any(r.spills for r in received) else None
    out: list[tuple[str, torch.Tensor]] = []
    later: list[tuple[torch.Tensor, torch.Tensor]] = []
    for r in received:
        out.extend(_chunk_tensors(r, side, later))
    error = run_check(check, specs)
    posted = [r.posted for r in received]
    if side is not None:  # every copy of an unaligned tensor
        copied = torch.cuda.Event()
        copied.record(side)
        posted.append(Posted(event=copied))

    def copy_out() -> None:  # gloo: each unaligned tensor, once its chunk is in
        for dest, slot in later:
            dest.view(-1).view(torch.uint8).copy_(slot)

    receive = PostedReceive(out, group, posted, copy_out if later else None)
    if error is not None:
        receive.wait()
        raise error
    return receive


def receive_packed(group: Any, specs: list[TensorSpec], buffer_bytes: int,
                   num_buffers: int = proto.DEFAULT_PACKED_NUM_BUFFERS,
                   check: SpecCheck | None = None,
                   chunks: list[list[TensorSpec]] | None = None) -> list[tuple[str, torch.Tensor]]:
    """Receive vLLM packed-mode chunks completely (:func:`post_packed`, then
    its ``wait``)."""
    return post_packed(group, specs, buffer_bytes, num_buffers, check, chunks).wait()


@dataclass
class _PostedChunk:
    """A chunk whose receive is posted."""

    specs: list[TensorSpec]
    buf: torch.Tensor
    spills: list[torch.Tensor]
    """Where the chunk's unaligned tensors go, in order."""
    posted: Posted
    """Done once the chunk is in."""
    ready: Any = None
    """GPUs: a CUDA event after the receive and the allocation of ``spills``
    (``posted`` waits for it; the copies out of the chunk too)."""


def receive_packed_update(ack: bool, group: Any, specs: list[TensorSpec], buffer_bytes: int, num_buffers: int,
                          check: SpecCheck | None, chunks: list[list[TensorSpec]] | None) -> PostedReceive:
    """One packed update on the transfer thread (one hop either way): posted
    (:func:`post_packed`), then, unless ``ack``, waited for."""
    posted = post_packed(group, specs, buffer_bytes, num_buffers, check, chunks)
    if not ack:
        posted.wait()
    return posted


def ack_posted(request: web.Request) -> bool:
    """Our extension of both update routes: ``?ack=posted`` asks for the
    reply once the receive is posted, and the session's end
    (/end_weight_update, /finish_weight_update) then waits for the bytes.
    Without it the reply comes after the bytes, as from SGLang and vLLM.

    * SGLang's /update_weights_from_distributed: the metadata is checked
      before the post (refused, nothing posted), so a sender that broadcasts
      only after the reply can queue the next bucket behind the one in flight.
    * vLLM's /update_weights (packed): the sender broadcasts once the round
      is started, so the receive is always posted and a refused update is
      answered after its bytes, as without it; an accepted one is answered
      at once, and a pipelined /finish_weight_update is then handled while
      the bytes arrive instead of after them.

    Either way an update once accepted is not checked again. Raises
    ValueError naming the parameter for any other value."""
    ack = request.query.get("ack")
    if ack not in (None, "posted"):
        raise ValueError(f"query parameter 'ack' must be 'posted' or absent, got {ack!r}")
    return ack == "posted"


def _post_chunk(group: Any, chunk: list[TensorSpec], main: Any) -> _PostedChunk:
    pos = offsets(chunk)
    buf = torch.empty(pos[-1], dtype=torch.uint8, device=group.device)
    posted = group.post_broadcast(buf, src=0, stream=main)
    # Allocated after the receive is posted (the first receive goes out sooner)
    # and before ``ready``: a block the allocator hands out on ``main`` may still
    # be in use by work queued there earlier (another thread's generation, say),
    # so the copies into it, on another stream, must wait for an event after it.
    spills = [torch.empty(s.shape, dtype=s.dtype, device=group.device)
              for s, p in zip(chunk, pos) if p % s.itemsize]
    if main is None:
        return _PostedChunk(chunk, buf, spills, posted)
    ready = torch.cuda.Event()
    ready.record(main)
    return _PostedChunk(chunk, buf, spills, Posted(event=ready), ready)


def _chunk_tensors(r: _PostedChunk, side: Any,
                   later: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a posted chunk: views of its buffer where aligned, else
    its spill tensors, filled on ``side`` (GPU) once the chunk is in, or (CPU)
    listed in ``later`` as (spill, raw bytes) to copy once it is."""
    spills = iter(r.spills)
    out: list[tuple[str, torch.Tensor]] = []
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        if side is not None and r.spills:
            side.wait_event(r.ready)
        for spec, slot in zip(r.specs, slots(r.buf, r.specs)):
            if slot.dtype != spec.dtype:  # unaligned: ``slot`` holds the raw bytes
                dest = next(spills)
                if side is not None:
                    dest.view(-1).view(torch.uint8).copy_(slot)
                else:
                    later.append((dest, slot))
                slot = dest
            out.append((spec.name, slot))
    return out


@dataclass
class _Transfer:
    """The weight-transfer engine state of this server."""

    info: _TransferInfo | None = None
    group: Any = None
    """A ``WeightGroup`` once /init_weight_transfer_engine succeeded."""
    update: PendingVersion | None = None
    """Between /start_weight_update and /finish_weight_update: what the round
    has received, loaded as one version by /finish_weight_update (a round
    that is shut down loads nothing)."""
    last_specs: list[TensorSpec] | None = None
    """Metadata of the last /update_weights (an all-empty update_info reuses it)."""
    parsed: _ParsedUpdate | None = None
    """The last /update_weights body parsed."""


@dataclass
class _ParsedUpdate:
    """An /update_weights body, parsed once: a trainer sends the same one every version."""

    raw: bytes
    specs: list[TensorSpec]
    chunks: list[list[TensorSpec]] | None
    """Packed mode: the chunks the sender cuts."""
    accepted: list[bool] | None = None
    """Its adopt flags, once it was checked and accepted with ``?ack=posted``."""


def served_names(model: str) -> list[str]:
    """The names the server answers to: the model path as given, then its
    last component (``/ckpt/Qwen3-0.6B/`` -> ``Qwen3-0.6B``), once each."""
    return list(dict.fromkeys([model, os.path.basename(os.path.normpath(model))]))


class VLLMRoutes:
    """vLLM 0.33's completions and weight-transfer routes over an :class:`Engine`."""

    def __init__(self, engine: Engine, cfg: Any, limits: BodyLimits | None = None):
        self.engine = engine
        self.cfg = cfg
        """The server's ``ServerConfig``."""
        self.limits = limits or BodyLimits.for_engine(engine.max_context, engine.cfg.max_batch_size)
        self.served_names = served_names(cfg.model)
        self.t = _Transfer()
        self.gate: str | None = None
        """Pause mode (abort | wait) under which new completions get 503."""
        self.draining = False
        self._created = int(time.time())
        # Receives and loads run here, off the event loop and one at a time.
        self._transfer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vllm-transfer")
        self._lock = asyncio.Lock()

    def register(self, app: web.Application) -> None:
        r = app.router
        r.add_post(proto.COMPLETIONS, _vllm_api(self.completions))
        r.add_get(proto.MODELS, _vllm_api(self.models))
        for path, handler in [
            (proto.INIT_WEIGHT_TRANSFER, self.init_weight_transfer_engine),
            (proto.PAUSE, self.pause),
            (proto.RESUME, self.resume),
            (proto.START_WEIGHT_UPDATE, self.start_weight_update),
            (proto.UPDATE_WEIGHTS, self.update_weights),
            (proto.FINISH_WEIGHT_UPDATE, self.finish_weight_update),
            (proto.SHUTDOWN_WEIGHT_TRANSFER, self.shutdown_weight_transfer_engine),
        ]:
            # shield outside: a caller that hangs up still gets its errors turned into replies
            r.add_post(path, _shielded(_vllm_api(handler)))
        r.add_get(proto.WEIGHT_INFO, _vllm_api(self.weight_info))
        r.add_get(proto.WORLD_SIZE, _vllm_api(self.get_world_size))
        r.add_get("/is_paused", _vllm_api(self.is_paused))

    def close(self) -> None:
        if self.t.group is not None:
            try:
                self.t.group.close()
            except Exception as e:  # shutting down anyway
                logger.warning("closing the vLLM transfer group: %s", e)
            self.t.group = None
        self._transfer.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._transfer, fn, *args)

    # ---- generation ------------------------------------------------------ #

    def _rejecting(self) -> bool:
        # The gate holds while draining (mode=wait) and while the engine stays
        # paused; a resume through the SGLang route lifts it too.
        return self.gate is not None and (self.draining or self.engine.paused is not None)

    async def completions(self, request: web.Request) -> web.Response:
        if self._rejecting():
            raise VLLMError(503, f"generation is paused (mode={self.gate}); retry after /resume")
        raw, body = await read_json(request, self.limits.generate)
        call = await off_loop_if_large(len(raw), self._parse_completions, body)  # it tokenises text prompts
        rids = [f"cmpl-{uuid.uuid4().hex}" for _ in call.prompts]
        top = max(call.logprobs or 0, 0)
        futures = [self.engine.submit(p, call.params, rid=rid, top_logprobs_num=top)
                   for p, rid in zip(call.prompts, rids)]
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except asyncio.CancelledError:
            for f, rid in zip(futures, rids):  # the client went away: stop its samples
                if f.cancelled() or not f.done():
                    self.engine.abort(rid, "client disconnected", wait=False)
            raise
        choices: list[dict] = []
        for samples in results:  # prompt-major: index = prompt * n + sample
            for r in samples:
                choices.append(self._choice(len(choices), r, call))
        n_prompt = sum(len(p) for p in call.prompts)
        n_out = sum(len(r.output_ids) for samples in results for r in samples)
        return web.json_response({
            "id": rids[0], "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or self.served_names[0], "choices": choices,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out},
        })

    def _parse_completions(self, body: dict) -> _CompletionCall:
        """Check a whole body (every prompt) before anything is queued; every
        field before any prompt is tokenised."""
        model = _field(body, "model", "str", None)
        if model is not None and model not in self.served_names:
            raise VLLMError(404, f"The model `{model}` does not exist.", "model")
        _check_stream_options(body)
        for key, default in _UNSUPPORTED.items():
            value = body.get(key)
            if value is not None and value != default and value != []:  # [] = no bad words etc.
                raise _bad(f"'{key}' is not supported by the built-in server", key)
        params = _sampling_params(body, self.engine.max_context)
        logprobs = _field(body, "logprobs", "int", None)
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise _bad(f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {logprobs}", "logprobs")
        prompts = self._prompts(body.get("prompt"))
        for i, p in enumerate(prompts):
            try:
                self.engine.check_request(p, params)
            except RequestError as e:
                msg = _vllm_names(str(e))
                raise _bad(f"prompt {i}: {msg}" if len(prompts) > 1 else msg, "prompt") from None
        return _CompletionCall(
            prompts=prompts, params=params, logprobs=logprobs,
            return_token_ids=bool(_field(body, "return_token_ids", "bool", False)),
            tokens_as_ids=bool(_field(body, "return_tokens_as_token_ids", "bool", False)),
            return_weight_versions=bool(_field(body, "return_weight_versions", "bool", False)),
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

    def _token_str(self, token_id: int, as_id: bool) -> str:
        text = None if as_id else self.engine.token_text(token_id)
        return f"{proto.TOKEN_ID_PREFIX}{token_id}" if text is None else text

    def _logprobs(self, r: SampleResult, k: int, as_ids: bool) -> dict:
        """OpenAI completions logprobs: per token its string, its logprob and a
        dict of the sampled token plus the top k (at most k+1 entries)."""
        tokens = [self._token_str(t, as_ids) for t in r.output_ids]
        values = [max(lp, -9999.0) for lp in r.output_logprobs]  # -inf is not JSON
        tops = []
        for step, (tok, lp) in enumerate(zip(tokens, values)):
            d = {tok: lp}
            for top_lp, top_id in (r.top_logprobs[step] if r.top_logprobs else [])[:k]:
                if len(d) > k:
                    break
                d.setdefault(self._token_str(top_id, as_ids), max(top_lp, -9999.0))
            tops.append(d)
        offsets, pos = [], 0
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens, "top_logprobs": tops}

    def _choice(self, index: int, r: SampleResult, call: _CompletionCall) -> dict:
        f = r.finish_reason
        # stop_reason: the stop string or stop token id; None for EOS or length.
        stop_reason = None
        if f.kind == "stop" and (isinstance(f.matched, str) or f.matched in call.params.stop_token_ids):
            stop_reason = f.matched
        choice: dict[str, Any] = {
            "index": index, "text": r.text or "",
            "logprobs": None if call.logprobs is None else self._logprobs(r, call.logprobs, call.tokens_as_ids),
            "finish_reason": f.kind, "stop_reason": stop_reason,
        }
        if call.return_token_ids:
            choice["prompt_token_ids"] = r.prompt_ids
            choice["token_ids"] = r.output_ids
        if call.return_weight_versions:
            choice["weight_versions"] = _version_spans(r)
        return choice

    async def models(self, request: web.Request) -> web.Response:
        # Every name /v1/completions accepts as 'model' (vLLM lists each
        # --served-model-name, all with the same root).
        cards = [{"id": name, "object": "model", "created": self._created, "owned_by": "vllm",
                  "root": self.cfg.model, "parent": None, "max_model_len": self.engine.max_context}
                 for name in self.served_names]
        return web.json_response({"object": "list", "data": cards})

    # ---- pause / resume --------------------------------------------------- #

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in proto.PAUSE_MODES:
            raise _bad(f"query 'mode' must be one of {', '.join(proto.PAUSE_MODES)}, got {mode!r}", "mode")
        if mode == "keep":
            # Live requests freeze (KV kept); new ones queue until /resume.
            self.gate = None
            await asyncio.to_thread(self.engine.pause, "in_place")
            return web.json_response({"status": "paused"})
        self.gate = mode
        if mode == "abort":
            await asyncio.to_thread(self.engine.pause, "abort")
            return web.json_response({"status": "paused"})
        self.draining = True  # mode=wait: refuse new work, let the live work end
        try:
            # (requests frozen by an earlier in-place pause would never finish)
            while self.engine.num_live_requests() and self.engine.alive and self.engine.paused is None:
                await asyncio.sleep(0.01)
            await asyncio.to_thread(self.engine.pause, "in_place")
        finally:
            self.draining = False
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self.gate = None
        self.engine.resume()
        return web.json_response({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.engine.paused is not None})

    # ---- weight transfer --------------------------------------------------- #

    async def init_weight_transfer_engine(self, request: web.Request) -> web.Response:
        info = _parse_init_info((await read_json(request, self.limits.control))[1].get("init_info"))
        async with self._lock:
            if self.t.group is not None:
                raise _bad("the weight transfer engine is already initialized; call "
                           "/shutdown_weight_transfer_engine first", "init_info")
            from torchtitan_grpo.weight_sync.group import init_weight_group

            backend = "nccl" if self.engine.device.type == "cuda" else "gloo"
            try:
                # Blocks until the trainer (rank 0, hosts the store) joins; a
                # plain thread keeps the event loop serving meanwhile.
                group = await asyncio.to_thread(
                    init_weight_group, info.master_address, info.master_port, info.rank_offset,
                    info.world_size, backend, GROUP_NAME, self.cfg.weight_group_timeout_s,
                    self.engine.device if backend == "nccl" else None,
                )
            except Exception as e:
                raise VLLMError(500, f"weight transfer rendezvous at {info.master_address}:{info.master_port} "
                                     f"failed: {type(e).__name__}: {e}") from None
            self.t = _Transfer(info=info, group=group)
        logger.info("vLLM weight transfer: rank %d of %d (%s, packed=%s)", info.rank_offset, info.world_size,
                    backend, info.packed)
        return web.json_response({"message": "Weight transfer initialized"})

    def _require_group(self) -> Any:
        if self.t.group is None:
            raise _bad("weight transfer is not initialized: call /init_weight_transfer_engine first")
        return self.t.group

    async def start_weight_update(self, request: web.Request) -> web.Response:
        self._require_group()
        if self.t.update is not None:
            raise _bad("a weight update is already in progress; call /finish_weight_update first")
        self.t.update = PendingVersion()
        return web.json_response({"message": "Weight update started"})

    async def update_weights(self, request: web.Request) -> web.Response:
        raw = await read_body(request, self.limits.weights)
        # Everything that can be refused is refused before the first receive:
        # a receive posted for a refused update would desynchronise the group.
        try:
            ack = ack_posted(request)
        except ValueError as e:
            raise _bad(str(e), "ack") from None
        group = self._require_group()
        if self.t.update is None:
            raise _bad("no weight update in progress: call /start_weight_update first (nothing was received)")
        info = self.t.info
        parsed = self.t.parsed
        if parsed is None or parsed.raw != raw:
            # A trainer sends the same metadata every version: parsing it and
            # cutting its chunks again would hold the first receive back
            # (~0.8 ms for 399 tensors).
            specs = _parse_update_info((await parse_json_async(raw)).get("update_info"), self.t.last_specs)
            chunks = plan_packed_chunks(specs, info.packed_buffer_size_bytes) if info.packed else None
            parsed = self.t.parsed = _ParsedUpdate(raw, specs, chunks)
        ack = ack and info.packed  # per-tensor receives (packed off) are answered after their bytes
        async with self._lock:
            # The metadata is checked while the bytes arrive and refused once
            # they have (``check``): the group stays in step with the sender.
            check, adopt = receive_check(self.engine, group.device)
            if ack and parsed.accepted is not None:
                # The parameters' names, shapes and dtypes never change: an
                # update once accepted stays accepted, and checking it again
                # (~1 ms for 399 tensors) would hold its early reply back.
                check, adopt = None, parsed.accepted
            try:
                if info.packed:
                    posted = await self._run(receive_packed_update, ack, group, parsed.specs,
                                             info.packed_buffer_size_bytes, info.packed_num_buffers, check,
                                             parsed.chunks)
                else:
                    posted = PostedReceive(await self._run(receive_weights, group, parsed.specs, False, check),
                                           group)
            except WeightUpdateError as e:
                self.t.last_specs = parsed.specs
                self.t.update.fail(str(e))
                raise _bad(f"weights not loaded (model unchanged): {e}", "update_info.names") from None
            except Exception as e:
                logger.warning("vLLM weight receive failed: %s", e)
                self.t.update.fail(f"{type(e).__name__}: {e}")
                raise VLLMError(500, f"receiving weights failed: {type(e).__name__}: {e}") from None
            if ack and check is not None:
                parsed.accepted = adopt
            self.t.last_specs = parsed.specs
            await debug_update_delay(self.cfg)
            self.t.update.keep(posted.named, adopt=adopt, posted=posted)
        return web.json_response({"message": "Weights received, loaded at /finish_weight_update" if ack
                                  else "Weights updated"})

    async def finish_weight_update(self, request: web.Request) -> web.Response:
        """End the update and load what it received, all at once (waiting,
        unless paused, for running requests to finish)."""
        version = _field((await read_json(request, self.limits.control))[1], "weight_version", "str", None)
        if self.t.update is None:
            raise _bad("no weight update in progress: call /start_weight_update first")
        async with self._lock:  # after any update in flight
            update, self.t.update = self.t.update, None
            try:
                await self._run(update.load, self.engine, version)
            except WeightUpdateError as e:
                raise _bad(str(e)) from None
        return web.json_response({"message": "Weight update finished"})

    async def shutdown_weight_transfer_engine(self, request: web.Request) -> web.Response:
        update = self.t.update
        if self.t.group is not None and (self._lock.locked() or
                                         (update is not None and update.in_flight(self.t.group))):
            # An update is stuck in a receive (trainer gone), or one answered
            # early (``?ack=posted``) still has receives posted: aborting the
            # group ends an NCCL receive at once; a gloo one only ends at its
            # timeout (--weight-group-timeout), and the shutdown waits for it.
            await asyncio.to_thread(self.t.group.abort)
        async with self._lock:
            group, self.t = self.t.group, _Transfer()
            if group is not None:
                await asyncio.to_thread(group.close)
        return web.json_response({"message": "Weight transfer shut down"})

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    async def get_world_size(self, request: web.Request) -> web.Response:
        # One worker (no TP/PP/DP); include_dp makes no difference.
        return web.json_response({"world_size": 1})


async def debug_update_delay(cfg: Any) -> None:
    """``--debug-update-delay-s``: a test knob that makes every weight update
    slow (its reply comes this much later: after the bytes, or with SGLang's
    ``?ack=posted`` after the post, so a trainer sends the next bucket or the
    session's end that much later) to simulate a lagging replica in fault
    tests and benchmarks. Never set it in production."""
    delay = getattr(cfg, "debug_update_delay_s", 0.0) or 0.0
    if delay > 0:
        await asyncio.sleep(delay)
