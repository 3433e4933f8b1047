"""Transport "ipc": a replica on the trainer's host maps the staging buffer
(a CUDA IPC handle on a GPU, a shared-memory file on CPU; ``weight_sync.ipc``)
and copies each version out of it, over SGLang's routes:

    begin -> /update_weights_from_tensor (handles to the buffer's tensors) -> end

The replica copies the tensors before it answers, so the staging buffer is
given back only after the answer. No weight group: the replica is asked for
its ranks only (one entry of handles per rank).
"""

from __future__ import annotations

import asyncio

import torch

from torchtitan_grpo.weight_sync import buckets as bk
from torchtitan_grpo.weight_sync import ipc
from torchtitan_grpo.weight_sync.control import Requests
from torchtitan_grpo.weight_sync.push_config import PushConfig
from torchtitan_grpo.weight_sync.sglang_push import begin_session, reset_replica, server_ranks, tag_version
from torchtitan_grpo.weight_sync.staging import Staged
from torchtitan_grpo.weight_sync.transport import Replica, Transport


class IpcPush(Transport):
    """Handles to the staging buffers, over SGLang's /update_weights_from_tensor."""

    def __init__(self, cfg: PushConfig, device: torch.device):
        if cfg.staging != "device" or cfg.protocol != "sglang":
            raise ValueError('backend "ipc" needs staging "device" (replicas map the staging buffers) and the '
                             f'SGLang protocol (/update_weights_from_tensor), got staging {cfg.staging!r}, '
                             f'protocol {cfg.protocol!r}')
        super().__init__(cfg, device)
        if device.type == "cpu":
            ipc.share_cpu_memory()  # staging buffers any process on the host can map

    def prepare_buffers(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        if buffers and buffers[0].device.type == "cpu":
            return [b.share_memory_() for b in buffers]  # a file in /dev/shm the replica maps
        return buffers

    async def connect(self, r: Replica) -> None:
        r.world_size = 1 + await server_ranks(self, r)

    async def tag(self, replicas: list[Replica], version: int) -> None:
        await tag_version(self, replicas, version)

    async def reset(self, r: Replica) -> None:
        await reset_replica(self, r)

    async def send(self, r: Replica, staged: Staged) -> None:
        """begin -> /update_weights_from_tensor (handles to the staging buffer's
        tensors; the replica copies them before it answers) -> end."""
        await begin_session(r, Requests(self.session, r.url))

        def handles() -> str:  # off the event loop: waits for the snapshot's copies
            staged.await_written()
            for done in staged.ready or []:
                done.synchronize()
            return ipc.serialize([(spec.name, t) for bucket, buf in zip(staged.plan, staged.buffers)
                                  for spec, t in zip(bucket, bk.unpack(buf, bucket))])

        entry = await asyncio.get_running_loop().run_in_executor(None, handles)
        body = {"serialized_named_tensors": [entry] * (r.world_size - 1), "load_format": None,
                "weight_version": str(staged.version), "flush_cache": self.cfg.pause_mode != "in_place",
                "abort_all_requests": False}
        await self.post(r, "/update_weights_from_tensor", body, self.cfg.deadline_s)
        if r.sessionful:
            await self.post(r, "/end_weight_update", {}, self.cfg.deadline_s)
