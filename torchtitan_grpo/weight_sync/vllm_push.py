"""vLLM 0.33's weight-transfer protocol over a weight group (see PROTOCOLS.md):

    pause -> start -> one update_weights request while every packed chunk is broadcast
          -> finish(version) -> resume

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

from collections.abc import Callable
from typing import Any

from torchtitan_grpo.aio import DaemonExecutor
from torchtitan_grpo.net import free_port
from torchtitan_grpo.protocol import vllm
from torchtitan_grpo.weight_sync import buckets as bk
from torchtitan_grpo.weight_sync.control import Requests
from torchtitan_grpo.weight_sync.group_push import GroupPush, spec_lists
from torchtitan_grpo.weight_sync.staging import Staged
from torchtitan_grpo.weight_sync.transport import Replica

PAUSE_MODES = {"none": "wait", "abort": "abort", "retract": "abort", "in_place": "keep"}
"""``PushConfig.pause_mode`` as vLLM's /pause mode: our "none" (let running
requests finish) is vLLM's "wait"; in_place keeps them, as "keep" does."""


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

    def init_request(self, r: Replica, port: int) -> tuple[str, dict]:
        return vllm.INIT_WEIGHT_TRANSFER, vllm.init_weight_transfer_request(
            r.world_size, 1, self.cfg.master_address, port, packed=True,
            packed_buffer_size_bytes=self.cfg.packed_buffer_bytes)

    # vLLM has no route that names the weights it loaded: its version is set by the first push (no ``tag``).

    async def reset(self, r: Replica) -> None:
        for path in (vllm.SHUTDOWN_WEIGHT_TRANSFER, vllm.RESUME):
            try:
                await self.post(r, path, None, self.cfg.init_timeout_s)
            except Exception:
                pass

    def update_requests(self, plan: list[list[bk.TensorSpec]]) -> list[dict]:
        """The one update request of a version: every tensor of every chunk."""
        return [vllm.update_weights_request(*spec_lists([b for chunk in plan for b in chunk]))]

    @property
    def pause_mode(self) -> str:
        return PAUSE_MODES[self.cfg.pause_mode]

    async def send(self, r: Replica, staged: Staged) -> None:
        """pause -> start -> one update_weights call while every packed chunk
        is broadcast -> finish(version) -> resume."""
        mode, body = self.pause_mode, self.encoded_updates(staged.plan)[0]
        finish = vllm.finish_weight_update_request(str(staged.version))
        try:
            await self.post(r, vllm.PAUSE, None, 30, params=vllm.pause_query(mode))
            await self.post(r, vllm.START_WEIGHT_UPDATE, None, 30)
            update = Requests(self.session, r.url).post(vllm.UPDATE_WEIGHTS, body, self.cfg.deadline_s)
            await self.with_broadcasts(r, [update], staged, list(range(len(staged.buffers))))
            await self.end_session(r, [update], vllm.FINISH_WEIGHT_UPDATE, finish)
        finally:
            await self.unpause(r, vllm.RESUME, None)
