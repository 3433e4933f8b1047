"""vLLM 0.33's weight-transfer routes on the built-in server (the RL
router a trainer drives): ``/init_weight_transfer_engine``, ``/pause``,
``/resume``, ``/is_paused``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``, ``/weight_info``, ``/get_world_size`` and
``/shutdown_weight_transfer_engine``. Errors use vLLM's shape.

The transfer group is ours (``weight_sync/group.py``: gloo on a CPU server,
NCCL on a GPU one), joined as rank ``rank_offset`` (the server is one worker)
under the group name :data:`GROUP_NAME`; a trainer pushing to the built-in
server joins with ``init_weight_group(..., rank=0, group_name=GROUP_NAME)``.
Real vLLM speaks a different rendezvous: see ``weight_sync/vllm_group.py``.
``nccl_unique_id_b64`` is refused (a 400 naming it).

An empty ``init_info`` (``{}``, all that vLLM's IPC engine takes) sets up
the IPC engine instead: no group, each /update_weights names a buffer of the
trainer's by handle and is copied out of it before the reply
(``vllm_ipc_receive``; on a GPU a CUDA IPC handle, on CPU a shared-memory file).

A round (``start`` .. ``finish``) is loaded as one version when it finishes,
exactly as the SGLang routes' session: generation never runs on half of a
version. Receives run on one transfer thread, off the event loop; packed
mode's receive is ``packed_receive``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from torchtitan_grpo.fleet import vllm as proto
from torchtitan_grpo.server.engine.engine import Engine
from torchtitan_grpo.server.httputil import BodyLimits, ack_posted, debug_update_delay, parse_json_async, read_body, read_json, shielded
from torchtitan_grpo.server.receive.packed import receive_packed_update
from torchtitan_grpo.server.receive.vllm_ipc import is_ipc_update, parse_ipc_update_info, receive as receive_ipc
from torchtitan_grpo.server.engine.requests import WeightUpdateError
from torchtitan_grpo.server.vllm_http import PauseGate, VLLMError, bad as _bad, field as _field, vllm_api
from torchtitan_grpo.server.engine.weights import PendingVersion, PostedReceive, receive_check, receive_weights
from torchtitan_grpo.reasons import reason, typed_reason
from torchtitan_grpo.weight_sync.buckets import SpecError, TensorSpec, plan_packed_chunks, specs_from_lists

logger = logging.getLogger("torchtitan_grpo.server")

GROUP_NAME = "vllm_weight_transfer"
"""Group name of the built-in server's transfer group (trainer must match)."""


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


def parse_init_info(info: Any) -> _TransferInfo:
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


def parse_update_info(info: Any, previous: list[TensorSpec] | None) -> list[TensorSpec]:
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


@dataclass
class _Transfer:
    """The weight-transfer engine state of this server."""

    info: _TransferInfo | None = None
    group: Any = None
    """A ``WeightGroup`` once /init_weight_transfer_engine succeeded."""
    ipc: bool = False
    """The IPC engine (init_info ``{}``): updates name the trainer's buffers by handle."""
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


class VLLMWeightRoutes:
    """vLLM 0.33's weight-transfer routes (and pause / resume) over an :class:`Engine`."""

    def __init__(self, engine: Engine, cfg: Any, gate: PauseGate, limits: BodyLimits | None = None):
        self.engine = engine
        self.cfg = cfg
        """The server's ``ServerConfig``."""
        self.gate = gate
        """What the generation routes check (503 while paused with abort | wait)."""
        self.limits = limits or BodyLimits.for_engine(engine.max_context, engine.cfg.max_batch_size)
        self.t = _Transfer()
        # Receives and loads run here, off the event loop and one at a time.
        self._transfer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vllm-transfer")
        self._lock = asyncio.Lock()

    def register(self, app: web.Application) -> None:
        r = app.router
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
            r.add_post(path, shielded(vllm_api(handler)))
        r.add_get(proto.WEIGHT_INFO, vllm_api(self.weight_info))
        r.add_get(proto.WORLD_SIZE, vllm_api(self.get_world_size))
        r.add_get("/is_paused", vllm_api(self.is_paused))

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

    # ---- pause / resume --------------------------------------------------- #

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in proto.PAUSE_MODES:
            raise _bad(f"query 'mode' must be one of {', '.join(proto.PAUSE_MODES)}, got {mode!r}", "mode")
        if mode == "keep":
            # Live requests freeze (KV kept); new ones queue until /resume.
            self.gate.mode = None
            await asyncio.to_thread(self.engine.pause, "in_place")
            return web.json_response({"status": "paused"})
        self.gate.mode = mode
        if mode == "abort":
            await asyncio.to_thread(self.engine.pause, "abort")
            return web.json_response({"status": "paused"})
        self.gate.draining = True  # mode=wait: refuse new work, let the live work end
        try:
            # (requests frozen by an earlier in-place pause would never finish)
            while self.engine.num_live_requests() and self.engine.alive and self.engine.paused is None:
                await asyncio.sleep(0.01)
            await asyncio.to_thread(self.engine.pause, "in_place")
        finally:
            self.gate.draining = False
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self.gate.mode = None
        self.engine.resume()
        return web.json_response({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.engine.paused is not None})

    # ---- weight transfer --------------------------------------------------- #

    async def init_weight_transfer_engine(self, request: web.Request) -> web.Response:
        raw_info = (await read_json(request, self.limits.control))[1].get("init_info")
        if raw_info == {}:  # vLLM's IPC engine: nothing to set up
            async with self._lock:
                self._refuse_second_init()
                self.t = _Transfer(ipc=True)
            logger.info("vLLM weight transfer: IPC engine (updates by buffer handle)")
            return web.json_response({"message": "Weight transfer initialized"})
        info = parse_init_info(raw_info)
        async with self._lock:
            self._refuse_second_init()
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

    def _refuse_second_init(self) -> None:
        if self.t.group is not None or self.t.ipc:
            raise _bad("the weight transfer engine is already initialized; call "
                       "/shutdown_weight_transfer_engine first", "init_info")

    def _require_group(self) -> Any:
        if self.t.group is None:
            raise _bad("weight transfer is not initialized: call /init_weight_transfer_engine first")
        return self.t.group

    async def start_weight_update(self, request: web.Request) -> web.Response:
        if not self.t.ipc:
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
        if self.t.ipc:
            return await self._update_by_handle(raw)
        group = self._require_group()
        if self.t.update is None:
            raise _bad("no weight update in progress: call /start_weight_update first (nothing was received)")
        info = self.t.info
        parsed = self.t.parsed
        if parsed is None or parsed.raw != raw:
            # A trainer sends the same metadata every version: parsing it and
            # cutting its chunks again would hold the first receive back
            # (~0.8 ms for 399 tensors).
            specs = parse_update_info((await parse_json_async(raw)).get("update_info"), self.t.last_specs)
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
                logger.warning("vLLM weight receive failed: %s", reason(e))
                self.t.update.fail(typed_reason(e))
                raise VLLMError(500, f"receiving weights failed: {typed_reason(e)}") from None
            if ack and check is not None:
                parsed.accepted = adopt
            self.t.last_specs = parsed.specs
            await debug_update_delay(self.cfg)
            self.t.update.keep(posted.named, adopt=adopt, posted=posted)
        return web.json_response({"message": "Weights received, loaded at /finish_weight_update" if ack
                                  else "Weights updated"})

    async def _update_by_handle(self, raw: bytes) -> web.Response:
        """The IPC engine's /update_weights: check the metadata, map the
        trainer's buffer and copy the tensors out, all before the reply."""
        info = (await parse_json_async(raw)).get("update_info")
        if not is_ipc_update(info):
            raise _bad("the IPC engine takes update_info with ipc_handles_pickled (init_info was {})",
                       "update_info.ipc_handles_pickled")
        update = parse_ipc_update_info(info)
        if self.t.update is None:
            raise _bad("no weight update in progress: call /start_weight_update first (nothing was received)")
        async with self._lock:
            check, adopt = receive_check(self.engine, self.engine.device)
            try:
                check(update.specs)
            except WeightUpdateError as e:
                self.t.update.fail(str(e))
                raise _bad(f"weights not loaded (model unchanged): {e}", "update_info.names") from None
            try:
                named = await self._run(receive_ipc, update, self.engine.device)
            except VLLMError as e:
                self.t.update.fail(e.message)
                raise
            except Exception as e:  # e.g. a CUDA handle this process cannot open
                logger.warning("vLLM IPC receive failed: %s", reason(e))
                self.t.update.fail(typed_reason(e))
                raise VLLMError(500, f"mapping the trainer's buffer failed: {typed_reason(e)}") from None
            await debug_update_delay(self.cfg)
            self.t.update.keep(named, adopt=adopt)
        return web.json_response({"message": "Weights updated"})

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
