"""The built-in server's end of an adapter push (``weight_sync.lora_push = "adapter"``).

Both engines' LoRA routes (docs/PROTOCOL_NOTES.md, "LoRA adapter routes"):
SGLang's ``/load_lora_adapter`` and ``/unload_lora_adapter``, vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, each naming a peft
folder (``adapter_config.json`` + ``adapter_model.safetensors``) by path.

Unlike SGLang and vLLM, which run the adapter beside the base weights per
request, the built-in server *merges* it: loading an adapter writes
``W = W0 + scale * B A`` into every targeted weight (``scale`` = alpha / r, or
alpha / sqrt(r) with rsLoRA), all of them in one :meth:`Engine.load_weights`
(under ``Engine.exclusive``: no forward pass sees half an adapter, and the
version changes with the weights). ``W0`` is this module's own copy of each
targeted weight, taken the first time an adapter touches it, so every
version merges onto the base and never onto the previous merge; a weight the
previous adapter touched and the new one does not is put back to ``W0``.

So the server serves one adapter at a time, the newest loaded: a request
naming any loaded adapter (SGLang's ``lora_path``, vLLM's ``model``) or none
runs on it. The adapter's name is what vLLM's routes answer to as a model
(``served`` lists). A load body may carry ``weight_version`` (a built-in
extension; the adapter push sends it to built-in replicas): the version the
merged weights are served as, set in the same exclusive section.

Not taken: SGLang's ``/load_lora_adapter_from_tensors`` (its
``serialized_tensors`` is a pickle of torch multiprocessing handles, which a
server must not unpickle from the network; answered 400 naming the folder
route), DoRA adapters, a full-weight push between two adapter versions (the
kept ``W0`` would be stale).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from dataclasses import dataclass

import torch
from aiohttp import web

from torchtitan_grpo.server.httputil import BodyLimits, BadRequest, get_field, json_body, shielded
from torchtitan_grpo.server.vllm_http import VLLMError
from torchtitan_grpo.protocol import sglang as sglang_proto
from torchtitan_grpo.protocol import vllm as vllm_proto

__all__ = ["AdapterError", "LoRAAdapter", "LoraMerger", "LoraRoutes", "read_adapter"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


class AdapterError(Exception):
    """An adapter that cannot be loaded: one line naming the file, field or weight."""


@dataclass
class LoRAAdapter:
    """A peft LoRA folder, read: per HF weight name its ``(A [r, in], B [out, r])``."""

    path: str
    scale: float
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(path: str) -> LoRAAdapter:
    """Read and check a peft LoRA folder (nothing of the model is touched)."""
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise AdapterError(f"lora_path {path!r} is not a folder this server can read")
    cfg_path, w_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise AdapterError(f"{cfg_path}: missing (a peft LoRA folder has {CONFIG_FILE} and {WEIGHTS_FILE})") from None
    except ValueError as e:
        raise AdapterError(f"{cfg_path}: not JSON ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{cfg_path}: peft_type must be LORA")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not (isinstance(r, int) and r >= 1) or not (isinstance(alpha, (int, float)) and alpha > 0):
        raise AdapterError(f"{cfg_path}: 'r' must be an integer >= 1 and 'lora_alpha' a number > 0, "
                           f"got {r!r} and {alpha!r}")
    if cfg.get("use_dora"):
        raise AdapterError(f"{cfg_path}: use_dora adapters cannot be merged here")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    try:
        tensors = load_file(w_path)
    except FileNotFoundError:
        raise AdapterError(f"{w_path}: missing") from None
    except Exception as e:  # safetensors' own error types differ between versions
        raise AdapterError(f"{w_path}: unreadable ({e})") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if not key.startswith(_PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
            raise AdapterError(f"{w_path}: unexpected tensor {key!r} (peft LoRA keys are "
                               f"'{_PREFIX}<module>.lora_A.weight' / '.lora_B.weight')")
        module, half = key[len(_PREFIX):].rsplit(".", 2)[:2]
        halves.setdefault(module, {})[half] = t
    if not halves:
        raise AdapterError(f"{w_path}: no adapter tensors")
    pairs = {}
    for module, ab in halves.items():
        a, b = ab.get("lora_A"), ab.get("lora_B")
        if a is None or b is None:
            raise AdapterError(f"{w_path}: {module} has lora_{'A' if a is None else 'B'} missing")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise AdapterError(f"{w_path}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, "
                               f"not [r, in] and [out, r] with r = {r}")
        pairs[f"{module}.weight"] = (a, b)
    return LoRAAdapter(path, float(scale), pairs)


class LoraMerger:
    """The adapters an engine has loaded and its copies of the base weights.

    Calls are serialised by the caller (``LoraRoutes``) and block: run them
    off the event loop."""

    def __init__(self, engine):
        self.engine = engine
        self.loaded: dict[str, str] = {}
        """Adapter name -> its folder, in load order."""
        self.current: str | None = None
        """The adapter merged into the served weights (None: the base)."""
        self.base: dict[str, torch.Tensor] = {}
        """Weight name -> W0, taken the first time an adapter touches it."""
        self.merged: set[str] = set()
        """Weights that differ from W0 now (the current adapter's)."""
        self._params_cache: dict[str, torch.Tensor] | None = None

    @property
    def _params(self) -> dict[str, torch.Tensor]:
        """The model's tensors by HF name, read at the first adapter (a server
        that never loads one never walks its model for them)."""
        if self._params_cache is None:
            self._params_cache = dict(self.engine.model.state_dict(keep_vars=True))
        return self._params_cache

    def load(self, name: str, path: str, version: str | None = None) -> None:
        """Merge the adapter at ``path`` as ``name``: all or nothing. On any
        error the served weights and version are those of before."""
        if name in self.loaded:
            raise AdapterError(f"adapter {name!r} is already loaded (from {self.loaded[name]})")
        adapter = read_adapter(path)
        for w, (a, b) in adapter.pairs.items():
            p = self._params.get(w)
            if p is None:
                raise AdapterError(f"{os.path.join(path, WEIGHTS_FILE)} targets {w[: -len('.weight')]}, "
                                   "which this model lacks")
            if p.dim() != 2 or (b.shape[0], a.shape[1]) != tuple(p.shape):
                raise AdapterError(f"{os.path.join(path, WEIGHTS_FILE)}: {w[: -len('.weight')]} gives B A of "
                                   f"{[b.shape[0], a.shape[1]]}, the model's weight is {list(p.shape)}")
        named = []
        for w, (a, b) in adapter.pairs.items():
            base = self._base(w)
            dev = base.device
            merged = torch.addmm(base.float(), b.to(dev, torch.float32), a.to(dev, torch.float32),
                                 alpha=adapter.scale)
            named.append((w, merged.to(base.dtype)))
        named += [(w, self.base[w].clone()) for w in sorted(self.merged - adapter.pairs.keys())]
        self.engine.load_weights(named, version)
        self.merged = set(adapter.pairs)
        self.loaded[name] = path
        self.current = name

    def unload(self, name: str) -> None:
        """Forget ``name``; unloading the merged adapter puts the base back."""
        if name not in self.loaded:
            raise KeyError(name)
        if name == self.current:
            self.engine.load_weights([(w, self.base[w].clone()) for w in sorted(self.merged)])
            self.merged, self.current = set(), None
        del self.loaded[name]

    def _base(self, w: str) -> torch.Tensor:
        if w not in self.base:
            with torch.no_grad():
                self.base[w] = self._params[w].detach().clone()
        return self.base[w]


class LoraRoutes:
    """SGLang's and vLLM's LoRA routes over one :class:`LoraMerger`.
    ``served``: the lists of model names the vLLM generation routes accept;
    each loaded adapter's name is added to them while it is loaded."""

    def __init__(self, engine, limits: BodyLimits, served: list[list[str]] = ()):
        self.merger = LoraMerger(engine)
        self.limits = limits
        self.served = list(served)
        self._lock = asyncio.Lock()

    def register(self, app: web.Application) -> None:
        r = app.router
        r.add_post(sglang_proto.LOAD_LORA_ADAPTER, shielded(self.sglang_load))
        r.add_post(sglang_proto.UNLOAD_LORA_ADAPTER, shielded(self.sglang_unload))
        r.add_post(sglang_proto.LOAD_LORA_ADAPTER_FROM_TENSORS, self.sglang_from_tensors)
        r.add_post(vllm_proto.LOAD_LORA_ADAPTER, shielded(self.vllm_load))
        r.add_post(vllm_proto.UNLOAD_LORA_ADAPTER, shielded(self.vllm_unload))

    # ---- the work, off the event loop, one at a time

    async def _run(self, fn, *args):
        async with self._lock:
            return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def _load(self, name: str, path: str, version: str | None) -> None:
        self.merger.load(name, path, version)
        for names in self.served:
            names.append(name)

    def _unload(self, name: str) -> None:
        self.merger.unload(name)
        for names in self.served:
            if name in names:
                names.remove(name)

    async def _load_body(self, request: web.Request) -> tuple[str, str, str | None]:
        body = await json_body(request, self.limits.control)
        return (get_field(body, "lora_name", "str", required=True), get_field(body, "lora_path", "str", required=True),
                get_field(body, "weight_version", "str", None))

    # ---- SGLang: {"success", "error_message", "loaded_adapters"}, 200 or 400

    def _sglang_reply(self, error: str | None) -> web.Response:
        return web.json_response({"success": error is None, "error_message": error,
                                  "loaded_adapters": dict(self.merger.loaded)}, status=200 if error is None else 400)

    async def sglang_load(self, request: web.Request) -> web.Response:
        name, path, version = await self._load_body(request)
        try:
            await self._run(self._load, name, path, version)
        except AdapterError as e:
            return self._sglang_reply(str(e))
        return self._sglang_reply(None)

    async def sglang_unload(self, request: web.Request) -> web.Response:
        name = get_field(await json_body(request, self.limits.control), "lora_name", "str", required=True)
        try:
            await self._run(self._unload, name)
        except KeyError:
            return self._sglang_reply(f"adapter {name!r} is not loaded")
        return self._sglang_reply(None)

    async def sglang_from_tensors(self, request: web.Request) -> web.Response:
        raise BadRequest(f"{sglang_proto.LOAD_LORA_ADAPTER_FROM_TENSORS}: the built-in server does not unpickle "
                         f"serialized_tensors; write a peft folder and use {sglang_proto.LOAD_LORA_ADAPTER}")

    # ---- vLLM: 200 with a line of text, else {"error": {...}}

    async def vllm_load(self, request: web.Request) -> web.Response:
        try:
            name, path, version = await self._load_body(request)
            await self._run(self._load, name, path, version)
        except (AdapterError, BadRequest) as e:
            return VLLMError(400, str(e), "lora_path").response()
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def vllm_unload(self, request: web.Request) -> web.Response:
        try:
            name = get_field(await json_body(request, self.limits.control), "lora_name", "str", required=True)
            await self._run(self._unload, name)
        except BadRequest as e:
            return VLLMError(400, str(e), "lora_name").response()
        except KeyError:
            return VLLMError(404, f"The lora adapter '{name}' cannot be found.", "lora_name").response()
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
