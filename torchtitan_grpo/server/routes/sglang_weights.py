"""SGLang 0.5.23's weight-update routes on the built-in server: weight
groups (``/init_weights_update_group``, ``/destroy_weights_update_group``),
the update session (``/begin_weight_update`` .. ``/end_weight_update``) and
what it receives (``/update_weights_from_distributed``, ``_from_disk``,
``_from_tensor``), versions, pause / continue, and ``/get_weights_by_name``.

Updates are received during a session and loaded as one version when it ends
(:class:`PendingVersion`): generation never runs on half of a version, and a
session that fails or is abandoned loads nothing. Receives and copies run on
one transfer thread, off the event loop. Our extensions, each advertised in
``/model_info``: ``?ack=posted`` on updates (``httputil.ack_posted``) and the
session's ``weight_version`` on ``/end_weight_update``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from aiohttp import web

from torchtitan_grpo.server.engine.engine import Engine
from torchtitan_grpo.server.httputil import BadRequest, BodyLimits, ack_posted, debug_update_delay, get_field as _get, json_body, parse_json_async, read_body, result, shielded
from torchtitan_grpo.server.engine.requests import PAUSE_MODES, RequestError, WeightUpdateError
from torchtitan_grpo.server.settings import ServerConfig
from torchtitan_grpo.server.engine.weights import FlatLayout, PendingVersion, PostedReceive, post_receive, read_safetensors_dir, receive_check
from torchtitan_grpo.reasons import reason, typed_reason
from torchtitan_grpo.weight_sync import ipc
from torchtitan_grpo.weight_sync.buckets import TensorSpec, specs_from_lists
from torchtitan_grpo.weight_sync.ipc import IpcFormatError

logger = logging.getLogger("torchtitan_grpo.server")


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


class SGLangWeightRoutes:
    """SGLang 0.5.23's weight-update routes over an :class:`Engine`."""

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
        # State changes run to completion even if their caller hangs up.
        r.add_post("/init_weights_update_group", shielded(self.init_weights_update_group))
        r.add_post("/begin_weight_update", shielded(self.begin_weight_update))
        r.add_post("/update_weights_from_distributed", shielded(self.update_weights_from_distributed))
        r.add_post("/end_weight_update", shielded(self.end_weight_update))
        r.add_post("/destroy_weights_update_group", shielded(self.destroy_weights_update_group))
        r.add_post("/update_weights_from_disk", shielded(self.update_weights_from_disk))
        r.add_post("/update_weights_from_tensor", shielded(self.update_weights_from_tensor))
        r.add_post("/update_weight_version", shielded(self.update_weight_version))
        r.add_post("/pause_generation", shielded(self.pause_generation))
        r.add_post("/continue_generation", shielded(self.continue_generation))
        r.add_get("/get_weights_by_name", self.get_weights_by_name)
        r.add_post("/get_weights_by_name", self.get_weights_by_name)

    def close(self) -> None:
        for g in self.groups.values():
            try:
                g.close()
            except Exception as e:  # shutting down anyway
                logger.warning("closing weight group %s: %s", g.group_name, reason(e))
        self.groups.clear()
        self._transfer.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._transfer, fn, *args)

    # ---- weight-update session and groups -------------------------------- #

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await json_body(request, self.limits.control)
        address = _get(body, "master_address", "str", required=True)
        port = _get(body, "master_port", "int", required=True)
        rank_offset = _get(body, "rank_offset", "int", required=True)
        world_size = _get(body, "world_size", "int", required=True)
        group_name = _get(body, "group_name", "str", "weight_update_group")
        backend = _get(body, "backend", "str", "nccl")
        if not group_name:
            return result(False, "field 'group_name' must not be empty")
        if group_name in self.groups:
            return result(False, f"a weight update group named {group_name!r} already exists")
        if backend not in ("nccl", "gloo"):
            return result(False, f"field 'backend' must be 'nccl' or 'gloo', got {backend!r}")
        if backend == "nccl" and self.engine.device.type != "cuda":
            return result(False, f"field 'backend': nccl needs a CUDA device and this server runs on "
                                  f"{self.engine.device}; use 'gloo'")
        if not 0 < rank_offset < world_size:
            return result(False, f"field 'rank_offset' must be in [1, world_size={world_size}), got {rank_offset}")
        from torchtitan_grpo.weight_sync.group import init_weight_group

        try:
            # Blocks until rank 0 (the trainer) joins; a plain thread keeps the
            # event loop (and any transfer on another group) going meanwhile.
            group = await asyncio.to_thread(
                init_weight_group, address, port, rank_offset, world_size, backend, group_name,
                self.cfg.weight_group_timeout_s, self.engine.device if backend == "nccl" else None,
            )
        except Exception as e:
            logger.warning("joining weight group %s failed: %s", group_name, reason(e))
            return result(False, f"could not join weight update group {group_name!r} at "
                                  f"{address}:{port}: {typed_reason(e)}")
        if group_name in self.groups:  # lost a race with a concurrent init of the same name
            group.close()
            return result(False, f"a weight update group named {group_name!r} already exists")
        self.groups[group_name] = group
        return result(True, f"joined weight update group {group_name!r} as rank {rank_offset} of {world_size} ({backend})")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await json_body(request, self.limits.control)
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
                return result(False, f"no weight update group named {group_name!r}")
            await asyncio.to_thread(group.close)
            if self.session is not None and (self.session.received_any or self.session.version is not None):
                self.session.fail(f"group {group_name!r} was destroyed during the session")
        return result(True, f"weight update group {group_name!r} destroyed")

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        body = await json_body(request, self.limits.control)
        selector = _get(body, "selector", "str", "all")
        if selector not in ("all", "target", "draft"):
            return result(False, f"field 'selector' must be 'all', 'target' or 'draft', got {selector!r}")
        if self.session is not None:
            return result(False, "a weight update session is already open; call /end_weight_update first")
        self.session = PendingVersion()
        return result(True, "weight update session open")

    async def end_weight_update(self, request: web.Request) -> web.Response:
        """Close the session and load what it received, all at once (waiting,
        unless paused, for running requests to finish). Our extension:
        ``weight_version`` (str), the version loaded, in place of one that
        an update carried; a trainer that sends it here sends the same
        update bodies every version (``end_weight_version`` in /model_info)."""
        version = _get(await json_body(request, self.limits.control), "weight_version", "str", None)
        if self.session is None:
            return result(False, "no weight update session is open (call /begin_weight_update first)")
        async with self._update_lock:  # let an update in flight finish first
            session, self.session = self.session, None
            try:
                n = await self._run(session.load, self.engine, version)
            except WeightUpdateError as e:
                return result(False, f"weight update session closed; {e}")
        return result(True, f"weight update session closed; loaded {n} tensor(s), serving weight "
                             f"version {self.engine.weight_version!r}")

    def _keep(self, named: list, version: str | None, what: str, adopt: list[bool] | None = None,
              posted: PostedReceive | None = None, **extra: Any) -> web.Response:
        self.session.keep(named, version, adopt, posted)
        return result(True, f"received {what}; loaded at /end_weight_update", **extra)

    def _refuse(self, message: str, **extra: Any) -> web.Response:
        """A received update that cannot be loaded fails its whole session."""
        self.session.fail(message)
        return result(False, message, **extra)

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
                return result(False, str(e))
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
            return result(False, str(e))
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
                logger.warning("weight receive on %s failed: %s", update.group_name, reason(e))
                return self._refuse(f"receiving weights on group {update.group_name!r} failed: "
                                    f"{typed_reason(e)}")
            await debug_update_delay(self.cfg)
            return self._keep(posted.named, version, f"{len(posted.named)} tensor(s)", adopt=adopt, posted=posted)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await json_body(request, self.limits.control)
        path = _get(body, "model_path", "str", required=True)
        load_format, version, abort_all = _load_fields(body)
        try:
            self._require_session()
            if load_format not in (None, "auto", "safetensors"):
                raise _Refused(f"field 'load_format' must be null, 'auto' or 'safetensors', got {load_format!r}")
        except _Refused as e:
            return result(False, str(e))
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
        body = await json_body(request, self.limits.weights)
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
            return result(False, str(e))
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
        body = await json_body(request, self.limits.control)
        version = _get(body, "new_version", "str", required=True)
        if _get(body, "abort_all_requests", "bool", True):
            await asyncio.to_thread(self.engine.abort_all, "aborted by /update_weight_version")
        self.engine.set_weight_version(version)
        return result(True, f"serving weight version {version!r}")

    # ---- pause / resume --------------------------------------------------- #

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await json_body(request, self.limits.control)
        mode = _get(body, "mode", "str", "abort")
        if mode not in PAUSE_MODES:
            return result(False, f"field 'mode' must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        kept = await asyncio.to_thread(self.engine.pause, mode)
        return result(True, f"generation paused (mode={mode}); {kept} request(s) waiting")

    async def continue_generation(self, request: web.Request) -> web.Response:
        await json_body(request, self.limits.control)
        self.engine.resume()
        return result(True, "generation resumed")

    # ---- inspection -------------------------------------------------------- #

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        if request.method == "GET":  # query values are strings
            name = request.query.get("name")
            try:
                size = int(request.query.get("truncate_size", 100))
            except ValueError:
                raise BadRequest("field 'truncate_size' must be an integer") from None
        else:
            body = await json_body(request, self.limits.control)
            name = _get(body, "name", "str", required=True)
            size = _get(body, "truncate_size", "int", 100)
        if not name:
            raise BadRequest("missing required field 'name'")
        try:
            values = await asyncio.to_thread(self.engine.get_weights, name, size)
        except RequestError as e:
            raise BadRequest(str(e)) from None
        return web.json_response(values)
