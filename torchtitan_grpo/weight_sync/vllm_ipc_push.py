"""Transport "ipc" with the vLLM protocol: vLLM's IPC weight-transfer engine
(``--weight-transfer-config '{"backend":"ipc"}'``), for a server on the
trainer's GPU (NCCL refuses two ranks on one device). Per version:

    pause -> /start_weight_update -> one /update_weights per staging chunk
          -> /finish_weight_update -> /resume

Each /update_weights names one staging buffer (tensors back to back, aligned
as in ``buckets.plan_buckets``) by handle (``vllm_ipc``): the replica maps it,
copies its tensors out and loads them before it answers, so the buffer is
the trainer's again once the reply is in. On a GPU a buffer's handle, and
with it the whole body of its update, is made once and reused every
version: the metadata and the allocation do not change, only the bytes.

On CPU the handle is a shared-memory file (only the built-in server's vLLM
routes take that); on a GPU it is a CUDA IPC handle keyed by the GPU's uuid,
which a vLLM worker on that same GPU opens. Such a server must run with
VLLM_SERVER_DEV_MODE=1 and VLLM_ALLOW_INSECURE_SERIALIZATION=1 (it unpickles
the handles).
"""

from __future__ import annotations

import asyncio
import json
import weakref

import torch

from torchtitan_grpo.protocol import vllm
from torchtitan_grpo.weight_sync import buckets as bk
from torchtitan_grpo.weight_sync import ipc, vllm_ipc
from torchtitan_grpo.weight_sync.control import PushError
from torchtitan_grpo.weight_sync.group_push import spec_lists
from torchtitan_grpo.weight_sync.push_config import PushConfig
from torchtitan_grpo.weight_sync.staging import Staged
from torchtitan_grpo.weight_sync.transport import Replica, Transport
from torchtitan_grpo.weight_sync.vllm_push import PAUSE_MODES, detect_dialect, finish, reset_vllm, start


class VLLMIpcPush(Transport):
    """Handles to the staging chunks, over vLLM's IPC weight-transfer engine."""

    def __init__(self, cfg: PushConfig, device: torch.device):
        if cfg.staging != "device":
            raise ValueError(
                f'weight_sync.staging = {cfg.staging!r} cannot go with weight_sync.transport = "ipc" and the vLLM '
                'protocol: the replica maps the staging buffers through a CUDA IPC handle, which exists for '
                'device memory only; set weight_sync.staging = "device"')
        if cfg.protocol != "vllm":
            raise ValueError(f"VLLMIpcPush speaks the vLLM protocol, got protocol {cfg.protocol!r}")
        super().__init__(cfg, device)
        self.key = vllm_ipc.device_key(device)
        if device.type == "cpu":
            ipc.share_cpu_memory()  # staging buffers any process on the host can map
        self._bodies: dict[int, tuple[weakref.ref, bytes]] = {}
        """id(buffer) -> (the buffer, its update body): made once per buffer."""

    def plan(self, specs: list[bk.TensorSpec]) -> list[list[bk.TensorSpec]]:
        """Buffers of at most ``packed_buffer_bytes`` (one tensor past it gets
        its own), itemsize-aligned: vLLM splits a buffer by ``tensor_sizes``
        and views each piece as its dtype, which fails at an offset that is
        not a multiple of the itemsize (an fp32 tensor after a bf16 one of
        odd length). Each update names its own tensors, so any cut will do."""
        return bk.plan_buckets(specs, self.cfg.packed_buffer_bytes)

    def prepare_buffers(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        if buffers and buffers[0].device.type == "cpu":
            return [b.share_memory_() for b in buffers]  # a file in /dev/shm the replica maps
        return buffers

    async def connect(self, r: Replica) -> None:
        r.dialect = await detect_dialect(self, r)  # (and r.builtin)
        body = await self.get(r.url + vllm.WORLD_SIZE)
        workers = vllm.parse_world_size(body, r.url) if body is not None else 1
        if workers != 1:
            # Each worker opens the handle keyed by its own GPU's uuid, and the
            # trainer has one GPU: a second worker (TP, PP or DP) finds none.
            raise PushError(f"{r.url} has {workers} workers (/get_world_size); vLLM's IPC transfer reaches one "
                            f"worker on the trainer's GPU: use weight_sync.transport = \"nccl\" for this replica")
        r.world_size = 2
        await self.post(r, vllm.INIT_WEIGHT_TRANSFER, vllm.ipc_init_request(), self.cfg.init_timeout_s)

    async def reset(self, r: Replica) -> None:
        await reset_vllm(self, r)

    def _body(self, spec: list[bk.TensorSpec], buf: torch.Tensor) -> bytes:
        """The update body of chunk ``spec`` staged in ``buf`` (cached per buffer
        on a GPU). A shared-memory handle is pickled afresh each time: torch
        counts each pickle of a shared storage as one reference, which the
        receiver's unpickling releases, and the file is unlinked when the
        count reaches zero, so a cached CPU body opened twice names a file
        that is gone (a CUDA handle has no such count)."""
        if buf.device.type != "cuda":
            return self._encode(spec, buf)
        hit = self._bodies.get(id(buf))
        if hit is not None and hit[0]() is buf:
            return hit[1]
        body = self._encode(spec, buf)
        self._bodies = {k: v for k, v in self._bodies.items() if v[0]() is not None}  # drop freed buffers'
        self._bodies[id(buf)] = (weakref.ref(buf), body)
        return body

    def _encode(self, spec: list[bk.TensorSpec], buf: torch.Tensor) -> bytes:
        names, dtypes, shapes = spec_lists(spec)
        handles = vllm_ipc.encode_handles({self.key: vllm_ipc.share(buf)})
        return json.dumps(vllm.ipc_update_weights_request(names, dtypes, shapes, [s.nbytes for s in spec],
                                                          handles)).encode()

    def _ready_bodies(self, staged: Staged) -> list[bytes]:
        """Off the event loop: wait until the snapshot is in the buffers (the
        replica reads them through its own mapping, ordered by nothing on our
        streams), then the bodies."""
        staged.await_written()
        for done in staged.ready or []:
            done.synchronize()
        return [self._body(spec, buf) for spec, buf in zip(staged.plan, staged.buffers)]

    async def send(self, r: Replica, staged: Staged) -> None:
        """pause -> start -> one update per chunk (each answered once the
        replica has copied and loaded it) -> finish -> resume."""
        bodies = asyncio.get_running_loop().run_in_executor(None, self._ready_bodies, staged)
        try:
            await self.post(r, vllm.PAUSE, None, 30, params=vllm.pause_query(PAUSE_MODES[self.cfg.pause_mode]))
            await start(self, r)
            for body in await bodies:
                await self.post(r, vllm.UPDATE_WEIGHTS, body, self.cfg.deadline_s)
            await finish(self, r, staged.version)
        finally:
            if not bodies.done():
                bodies.cancel()
            await self.unpause(r, vllm.RESUME, None)
