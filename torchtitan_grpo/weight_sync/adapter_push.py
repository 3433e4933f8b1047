"""Transport "adapter" (``weight_sync.lora_push = "adapter"``): each version
sends only the LoRA adapter, through the engines' own LoRA routes.

The trainer pushes its peft-named adapter tensors (:func:`adapter_tensors`,
``base_model.model.<HF module>.lora_A.weight`` / ``.lora_B.weight``) instead
of the merged weights; the Pusher stages and versions them as any push
(deadline, ejection, readmission are its own). Per replica, per version:

    write <disk_folder>/v<version>/ (adapter_config.json + adapter_model.safetensors; once)
    -> load route (lora_name "<ADAPTER_PREFIX>-v<version>", lora_path that folder)
    -> SGLang (not the built-in server): /update_weight_version
    -> on_adapter(url, name): the rollout pool names it in its requests from now on
    -> unload route of the replica's previous adapter

SGLang: ``/load_lora_adapter``, ``/unload_lora_adapter``, a request names the
adapter in ``lora_path``; vLLM: ``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter``, a request names it as its ``model``
(``protocol.sglang`` / ``protocol.vllm``; docs/PROTOCOL_NOTES.md). The
built-in server merges the adapter into its own copy of the base and takes the
version in the load body itself (``inference.lora_receive``). The folder must
be one every replica can read, as for the "disk" transport. The previous
adapter is unloaded only once the new one serves and the pool names it, so no
request is sent to an adapter that is gone; a failed unload is logged, not
an ejection (the replica serves the new version).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Callable

import torch

from torchtitan_grpo.protocol import sglang as sglang_proto
from torchtitan_grpo.protocol import vllm as vllm_proto
from torchtitan_grpo.reasons import reason
from torchtitan_grpo.weight_sync.disk_push import version_folder
from torchtitan_grpo.weight_sync.push_config import PushConfig
from torchtitan_grpo.weight_sync.sglang_push import tag_version
from torchtitan_grpo.weight_sync.staging import Staged
from torchtitan_grpo.weight_sync.transport import Replica, Transport

__all__ = ["ADAPTER_PREFIX", "AdapterPush", "adapter_config", "adapter_name", "adapter_tensors", "config_from_lora"]

logger = logging.getLogger(__name__)

ADAPTER_PREFIX = "grpo-lora"


def adapter_name(version: int) -> str:
    """The name version ``version``'s adapter is loaded under (a new one each
    version: neither engine reloads an adapter under a name it already has)."""
    return f"{ADAPTER_PREFIX}-v{version}"


def adapter_tensors(model: torch.nn.Module, sd_adapter) -> dict[str, torch.Tensor]:
    """What the trainer pushes with ``lora_push = "adapter"``: the peft-named
    adapter tensors of ``model`` (``sd_adapter``: the train spec's state-dict
    adapter, for the HF names)."""
    from torchtitan_grpo.lora.peft import peft_adapter_tensors

    return peft_adapter_tensors(model, sd_adapter)


def adapter_config(model: torch.nn.Module, sd_adapter, base_path: str) -> dict:
    """The peft ``adapter_config.json`` of ``model``'s adapters, for the base
    checkpoint ``base_path`` (``PushConfig.adapter_config``)."""
    from torchtitan_grpo.lora.peft import _adapter_config, peft_adapter_tensors

    return _adapter_config(model, peft_adapter_tensors(model, sd_adapter), base_path)


# TorchTitan's projection names ([lora] target_modules) -> the HF module names peft targets
_HF_TARGETS = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
               "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def config_from_lora(lora_cfg, base_path: str) -> dict:
    """The peft ``adapter_config.json`` the trainer's adapters will have, from
    the ``[lora]`` section alone (the session builds the pusher before the
    model exists); the same fields :func:`adapter_config` reads off a model."""
    alpha = float(lora_cfg.alpha)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": os.path.abspath(base_path),
            "r": int(lora_cfg.rank), "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
            "lora_dropout": float(lora_cfg.dropout),
            "target_modules": sorted(_HF_TARGETS[m] for m in lora_cfg.target_modules),
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "modules_to_save": None, "inference_mode": True}


class AdapterPush(Transport):
    """peft folders in a shared folder, over the replicas' LoRA routes."""

    def __init__(self, cfg: PushConfig, device):
        super().__init__(cfg, device)
        if not cfg.adapter_config:
            raise ValueError("weight_sync.lora_push = \"adapter\": PushConfig.adapter_config is not set")
        if not cfg.disk_folder:
            raise ValueError("weight_sync.lora_push = \"adapter\": PushConfig.disk_folder is not set")
        self.on_adapter: Callable[[str, str], None] = lambda url, name: None
        """Called (on the pusher's loop) once ``url`` serves adapter ``name``:
        the rollout pool's ``set_adapter``."""
        self._lock = asyncio.Lock()  # one writer per version
        self._written: dict[int, str] = {}
        self._serving: dict[str, str] = {}  # url -> the adapter it serves

    @property
    def reads_host_memory(self) -> bool:
        return True  # safetensors are written from host memory

    async def start(self) -> None:
        await super().start()
        os.makedirs(self.cfg.disk_folder, exist_ok=True)

    async def connect(self, r: Replica) -> None:
        r.builtin = (await self.probe_builtin(r)).builtin

    async def tag(self, replicas: list[Replica], version: int) -> None:
        if self.cfg.protocol == "sglang":
            await tag_version(self, replicas, version)

    async def send(self, r: Replica, staged: Staged) -> None:
        path = await self._on_disk(staged)
        name = adapter_name(staged.version)
        if self.cfg.protocol == "vllm":
            route, body = vllm_proto.LOAD_LORA_ADAPTER, vllm_proto.load_lora_adapter_request(name, path)
        else:
            route, body = sglang_proto.LOAD_LORA_ADAPTER, sglang_proto.load_lora_adapter_request(name, path)
        if r.builtin:
            body["weight_version"] = str(staged.version)  # the built-in server's extension: merged and tagged at once
        try:
            await self.post(r, route, body, self.cfg.deadline_s)
        except Exception:
            # A transfer given up after its load went through leaves the name
            # loaded, which both engines then refuse to load again: unload it
            # (harmless if it is not there) and load once more.
            await self._unload(r, name, quiet=True)
            await self.post(r, route, body, self.cfg.deadline_s)
        if self.cfg.protocol == "sglang" and not r.builtin:
            await tag_version(self, [r], staged.version)
        previous = self._serving.get(r.url)
        self._serving[r.url] = name
        self.on_adapter(r.url, name)
        if previous is not None and previous != name:
            await self._unload(r, previous)

    async def _unload(self, r: Replica, name: str, quiet: bool = False) -> None:
        if self.cfg.protocol == "vllm":
            route, body = vllm_proto.UNLOAD_LORA_ADAPTER, vllm_proto.unload_lora_adapter_request(name)
        else:
            route, body = sglang_proto.UNLOAD_LORA_ADAPTER, sglang_proto.unload_lora_adapter_request(name)
        try:
            await self.post(r, route, body, self.cfg.deadline_s)
        except Exception as e:
            if not quiet:
                logger.warning("unloading adapter %s from %s failed: %s", name, r.url, reason(e))

    async def _on_disk(self, staged: Staged) -> str:
        """Write ``staged`` once as a peft folder and return it (``disk_push.version_folder``)."""
        from safetensors.torch import save_file

        def save(tensors: dict[str, torch.Tensor], tmp: str) -> None:
            save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
            with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
                json.dump(self.cfg.adapter_config, f, indent=2)

        return await version_folder(self._lock, self._written, self.cfg.disk_folder, staged, save)
