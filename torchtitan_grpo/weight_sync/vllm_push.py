"""vLLM's weight-transfer protocol over a weight group (see PROTOCOLS.md):

    pause -> start -> one update_weights request while every packed chunk is broadcast
          -> finish(version) -> resume

in the dialect of the replica's release (``protocol.vllm.Dialect``, read
from GET /version at each connect: 0.26 takes the packing in the update and
no version at the finish).

A version is staged in vLLM's packed chunks (the tensors in order, a chunk
closing right after the tensor that takes it past ``packed_buffer_bytes``),
so the replica receives them into its double buffer as the trainer sends.
A real vLLM on NCCL meets the trainer through its own store layout and
PyNccl handshake (``vllm_group``); the built-in server's vLLM routes join
the same kind of group as its SGLang routes do.

The built-in server takes more (pipelined requests, ``?ack=posted``):
``builtin_push`` adds that beside this.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torchtitan_grpo.aio import DaemonExecutor
from torchtitan_grpo.net import free_port
from torchtitan_grpo.protocol import vllm
from torchtitan_grpo.weight_sync import buckets as bk
from torchtitan_grpo.weight_sync.control import PushError, Requests, answered
from torchtitan_grpo.weight_sync.group_push import GroupPush, spec_lists
from torchtitan_grpo.weight_sync.staging import Staged
from torchtitan_grpo.weight_sync.transport import Replica, Transport

logger = logging.getLogger(__name__)
_told: set[str] = set()  # releases already logged as unknown (once per process, not per connect)

PAUSE_MODES = {"none": "wait", "abort": "abort", "retract": "abort", "in_place": "keep"}
"""``PushConfig.pause_mode`` as vLLM's /pause mode: our "none" (let running
requests finish) is vLLM's "wait"; in_place keeps them, as "keep" does."""


async def detect_dialect(t: Transport, r: Replica) -> vllm.Dialect:
    """The dialect ``r`` speaks (and whether it is the built-in server, set on
    ``r``): the built-in server's is 0.33's; a real vLLM's is its
    /version's, or the nearest one known (logged once per release)."""
    r.builtin = (await t.probe_builtin(r)).builtin
    if r.builtin:
        return vllm.V0_33
    body = await t.get(r.url + vllm.VERSION)
    if body is None:
        version = "(no /version)"
        dialect, known = vllm.V0_33, False
    else:
        version = vllm.parse_version(body, r.url)
        dialect, known = vllm.nearest_dialect(version)
    if not known and version not in _told:
        _told.add(version)
        logger.warning("vLLM %s at %s is not a release we know (%s): speaking %s's bodies", version, r.url,
                       ", ".join(d.release for d in vllm.DIALECTS), dialect.release)
    return dialect


async def reset_vllm(t: Transport, r: Replica) -> None:
    """Close what a trainer may have left on ``r``: its transfer engine
    (0.33), an update round (0.26, which has no shutdown route and refuses a
    second start while a round is open), a pause. Each may already be gone."""
    if r.dialect.has_shutdown:
        paths = [vllm.SHUTDOWN_WEIGHT_TRANSFER]
    else:
        # 0.26 answers a finish without a round open with a 500 and a traceback
        # in its log: finish only a round this trainer opened, or one it cannot
        # know about (``round_open`` None: a replica met for the first time).
        paths = [] if r.round_open is False else [vllm.FINISH_WEIGHT_UPDATE]
    for path in (*paths, vllm.RESUME):
        try:
            await t.post(r, path, None, t.cfg.init_timeout_s)
        except Exception:
            pass
    r.round_open = False


async def start(t: Transport, r: Replica) -> None:
    """POST /start_weight_update: a round is open on ``r`` from now on."""
    await t.post(r, vllm.START_WEIGHT_UPDATE, None, 30)
    r.round_open = True


async def finish(t: Transport, r: Replica, version: int) -> None:
    """POST /finish_weight_update in ``r``'s dialect."""
    await t.post(r, vllm.FINISH_WEIGHT_UPDATE, vllm.finish_weight_update_request(str(version), r.dialect),
                 t.cfg.deadline_s)
    r.round_open = False


def refuse_unaligned(plan: list[list[bk.TensorSpec]], replica: str) -> None:
    """A real vLLM views each piece of a packed chunk as its dtype (0.26's
    ``packed_tensor.unpack_tensor``), which fails at a byte offset that is not
    a multiple of the itemsize, so a chunk with one (mixed itemsizes, e.g. an
    fp32 tensor after a bf16 one of odd length) would fail there after the
    bytes were sent: refuse it before anything is."""
    for chunk in plan:
        for spec, at in zip(chunk, bk.offsets(chunk)):
            if at % spec.itemsize:
                raise PushError(f"{replica}: {spec.name} ({bk.dtype_name(spec.dtype)}) would sit at byte {at} of "
                                f"its packed chunk, which vLLM cannot view as {bk.dtype_name(spec.dtype)}; push "
                                "one floating dtype (set weight_sync.dtype, e.g. bfloat16)")


class VLLMPush(GroupPush):
    """vLLM's protocol over a weight group (backend "gloo" or "nccl")."""

    group_name = "vllm_weight_transfer"  # the built-in server's vLLM-route group

    def plan(self, specs: list[bk.TensorSpec]) -> list[list[bk.TensorSpec]]:
        return bk.plan_packed_chunks(specs, self.cfg.packed_buffer_bytes)

    async def replica_ranks(self, r: Replica) -> int:
        """vLLM's /get_world_size, else 1 (the built-in server)."""
        body = await self.get(r.url + vllm.WORLD_SIZE)
        return vllm.parse_world_size(body, r.url) if body is not None else 1

    def _real_vllm_nccl(self, r: Replica) -> bool:
        return self.cfg.backend == "nccl" and not r.builtin

    async def rendezvous(self, r: Replica, executor: DaemonExecutor) -> tuple[int, Callable[[], Any]]:
        if not self._real_vllm_nccl(r):
            return await super().rendezvous(r, executor)
        # A real vLLM joins through its own store layout and PyNccl handshake,
        # its join making the store.
        from torchtitan_grpo.weight_sync.vllm_group import init_vllm_weight_group

        port = free_port(self.cfg.master_address)
        return port, lambda: init_vllm_weight_group(self.cfg.master_address, port, r.world_size,
                                                    device=self.device, timeout_s=self.cfg.init_timeout_s)

    async def connect(self, r: Replica) -> None:
        r.dialect = await detect_dialect(self, r)  # before the init body, which depends on it
        await super().connect(r)

    def init_request(self, r: Replica, port: int) -> tuple[str, dict]:
        return vllm.INIT_WEIGHT_TRANSFER, vllm.init_weight_transfer_request(
            r.world_size, 1, self.cfg.master_address, port, packed=True,
            packed_buffer_size_bytes=self.cfg.packed_buffer_bytes, dialect=r.dialect)

    # vLLM has no route that names the weights it loaded: its version is set by the first push (no ``tag``).

    async def reset(self, r: Replica) -> None:
        await reset_vllm(self, r)

    def update_requests(self, plan: list[list[bk.TensorSpec]], dialect: vllm.Dialect = vllm.V0_33) -> list[dict]:
        """The one update request of a version: every tensor of every chunk."""
        return [vllm.update_weights_request(*spec_lists([b for chunk in plan for b in chunk]), dialect=dialect,
                                            packed=True, packed_buffer_size_bytes=self.cfg.packed_buffer_bytes)]

    def update_body(self, r: Replica, plan: list[list[bk.TensorSpec]]) -> bytes | dict:
        """The update body for ``r``: 0.33's is encoded once per plan; another
        dialect's is built each time (a real vLLM parses it anyway)."""
        if r.dialect is vllm.V0_33:
            return self.encoded_updates(plan)[0]
        return self.update_requests(plan, r.dialect)[0]

    @property
    def pause_mode(self) -> str:
        return PAUSE_MODES[self.cfg.pause_mode]

    async def send(self, r: Replica, staged: Staged) -> None:
        """pause -> start -> one update_weights call while every packed chunk
        is broadcast -> finish(version) -> resume."""
        if not r.builtin:
            refuse_unaligned(staged.plan, r.url)
        mode, body = self.pause_mode, self.update_body(r, staged.plan)
        try:
            await self.post(r, vllm.PAUSE, None, 30, params=vllm.pause_query(mode))
            await start(self, r)
            update = Requests(self.session, r.url).post(vllm.UPDATE_WEIGHTS, body, self.cfg.deadline_s)
            await self.with_broadcasts(r, [update], staged, list(range(len(staged.buffers))))
            if r.dialect.finish_takes_version:  # (the built-in server takes it before the update's reply)
                await self.end_session(r, [update], vllm.FINISH_WEIGHT_UPDATE,
                                       vllm.finish_weight_update_request(str(staged.version), r.dialect))
            else:
                await answered([update])
                await finish(self, r, staged.version)
        finally:
            await self.unpause(r, vllm.RESUME, None)
