"""Transport "disk": each version is written once as safetensors into a
folder every replica can read (``PushConfig.disk_folder``) and loaded with
SGLang's routes:

    begin -> /update_weights_from_disk (the version's folder) -> end

The first sender that needs a version writes it, off the event loop; the two
newest versions are kept. No weight group: nothing to join.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from typing import Callable

import torch

from torchtitan_grpo.weight_sync import buckets as bk
from torchtitan_grpo.weight_sync.control import Requests
from torchtitan_grpo.weight_sync.push_config import PushConfig
from torchtitan_grpo.weight_sync.sglang_push import begin_session, reset_replica, tag_version
from torchtitan_grpo.weight_sync.staging import Staged
from torchtitan_grpo.weight_sync.transport import Replica, Transport

KEEP_VERSIONS = 2
"""Version folders kept on disk: the newest and the one a slow replica may still be loading."""


class DiskPush(Transport):
    """Safetensors in a shared folder, over SGLang's /update_weights_from_disk."""

    def __init__(self, cfg: PushConfig, device):
        super().__init__(cfg, device)
        self._lock = asyncio.Lock()  # one writer per version
        self._written: dict[int, str] = {}  # version -> its folder

    @property
    def reads_host_memory(self) -> bool:
        return True  # safetensors are written from host memory

    async def start(self) -> None:
        await super().start()
        os.makedirs(self.cfg.disk_folder, exist_ok=True)

    async def connect(self, r: Replica) -> None:
        pass  # nothing to join: every replica reads the same folder

    async def tag(self, replicas: list[Replica], version: int) -> None:
        await tag_version(self, replicas, version)

    async def reset(self, r: Replica) -> None:
        await reset_replica(self, r)

    async def send(self, r: Replica, staged: Staged) -> None:
        """begin -> /update_weights_from_disk(folder of the version) -> end."""
        path = await self._on_disk(staged)
        await begin_session(r, Requests(self.session, r.url))
        body = {"model_path": path, "load_format": "safetensors", "weight_version": str(staged.version),
                "flush_cache": self.cfg.pause_mode != "in_place", "abort_all_requests": False}
        await self.post(r, "/update_weights_from_disk", body, self.cfg.deadline_s)
        if r.sessionful:
            await self.post(r, "/end_weight_update", {}, self.cfg.deadline_s)

    async def _on_disk(self, staged: Staged) -> str:
        """Write ``staged`` once as safetensors and return its folder (:func:`version_folder`)."""
        from safetensors.torch import save_file

        def save(tensors: dict[str, torch.Tensor], tmp: str) -> None:
            save_file(tensors, os.path.join(tmp, "model.safetensors"))

        return await version_folder(self._lock, self._written, self.cfg.disk_folder, staged, save)


def staged_tensors(staged: Staged) -> dict[str, torch.Tensor]:
    """Host copies of a staged version's tensors by name, once it is written."""
    staged.await_written()
    for done in staged.ready or []:  # staging "host": the copies from the GPU
        done.synchronize()
    tensors = {}
    for bucket, buf in zip(staged.plan, staged.buffers):
        for spec, t in zip(bucket, bk.unpack(buf.cpu(), bucket)):
            tensors[spec.name] = t.clone()
    return tensors


async def version_folder(lock: asyncio.Lock, written: dict[int, str], folder: str, staged: Staged,
                         save: Callable[[dict[str, torch.Tensor], str], None]) -> str:
    """``<folder>/v<version>`` of ``staged``, written once (the first sender to
    need it does it, off the event loop, by ``save(tensors, tmp_folder)``) and
    renamed into place, so replicas never see a half-written version; only the
    newest ``KEEP_VERSIONS`` folders are kept (``written``: version -> folder)."""
    async with lock:
        v = staged.version
        if v not in written:
            path = os.path.join(folder, f"v{v}")

            def write():
                tensors = staged_tensors(staged)
                tmp = path + ".tmp"
                shutil.rmtree(tmp, ignore_errors=True)  # a crashed writer's leftovers
                os.makedirs(tmp)
                save(tensors, tmp)
                shutil.rmtree(path, ignore_errors=True)
                os.replace(tmp, path)

            await asyncio.get_running_loop().run_in_executor(None, write)
            written[v] = path
            for old in sorted(written)[:-KEEP_VERSIONS]:
                shutil.rmtree(written.pop(old), ignore_errors=True)
        return written[v]
