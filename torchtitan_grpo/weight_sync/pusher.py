"""Pushing HF-named weights with a version number to every replica.

The trainer sees one interface, ``push(tensors, version) -> metrics``, called
after each optimizer step, and ``close()``. ``SyncPusher`` here pushes and
returns when every healthy replica has the new version (the on-policy
baseline); the async sidecar implements the same interface.

Per replica: its own weight group (own TCPStore port, own communicator), so a
replica that fails does not touch the others. The SGLang order for one
version is begin -> (update request in flight while the trainer broadcasts)
x buckets -> end; no broadcast starts before ``begin`` has been confirmed, and
an update request is always posted *before* its broadcast so the server has a
receive waiting.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp
import torch

from torchtitan_grpo.aio import LoopThread
from torchtitan_grpo.inference import sglang
from torchtitan_grpo.inference.launcher import free_port
from torchtitan_grpo.weight_sync import buckets as bk
from torchtitan_grpo.weight_sync.group import WeightGroup, init_weight_group

logger = logging.getLogger(__name__)

GROUP_NAME = "weight_update_group"


class WeightPusher(Protocol):
    def push(self, tensors: dict[str, torch.Tensor], version: int) -> dict[str, float]: ...

    def close(self) -> None: ...


class NoPush:
    """``weight_sync.mode = "off"``: replicas keep their initial weights."""

    def push(self, tensors, version):
        return {}

    def close(self) -> None:
        pass


class PushError(RuntimeError):
    pass


@dataclass
class _Link:
    url: str
    group: WeightGroup | None = None
    sessionful: bool = True  # False: pre-0.5.23 SGLang without begin/end_weight_update
    version: int = -1
    errors: list[str] = field(default_factory=list)


async def _post(session: aiohttp.ClientSession, url: str, body: dict, timeout_s: float) -> dict:
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        text = await r.text()
        try:
            data = await r.json(content_type=None) if text else {}
        except ValueError:
            data = {"message": text[:300]}
        if r.status == 404:
            raise FileNotFoundError(url)
        if r.status != 200 or (isinstance(data, dict) and data.get("success") is False):
            raise PushError(f"POST {url} -> HTTP {r.status}: {data.get('message', text[:300]) if isinstance(data, dict) else text[:300]}")
        return data if isinstance(data, dict) else {}


class SyncPusher:
    """Push to every replica and wait. Only rank 0 creates one; other ranks
    take part only in gathering the full tensors (``trainer.hf_weights``)."""

    def __init__(self, loop: LoopThread, urls: list[str], *, backend: str = "gloo",
                 master_address: str = "127.0.0.1", bucket_bytes: int = 256 << 20,
                 init_timeout_s: float = 120.0, push_timeout_s: float = 300.0,
                 device: torch.device | None = None):
        self.loop = loop
        self.links = [_Link(u.rstrip("/")) for u in urls]
        self.backend = backend
        self.master_address = master_address
        self.bucket_bytes = bucket_bytes
        self.init_timeout_s = init_timeout_s
        self.push_timeout_s = push_timeout_s
        self.device = device or torch.device("cpu")
        self._session: aiohttp.ClientSession | None = None
        self._plan: list[list[bk.TensorSpec]] | None = None

    # -- set-up

    def connect(self, initial_version: int = 0) -> None:
        """Join one weight group per replica and tag the weights they loaded
        from disk with ``initial_version``."""
        self.loop.run(self._connect_all(initial_version))

    async def _connect_all(self, initial_version: int) -> None:
        self._session = aiohttp.ClientSession()
        await asyncio.gather(*(self._connect(link) for link in self.links))
        await asyncio.gather(*(
            _post(self._session, link.url + "/update_weight_version",
                  {"new_version": str(initial_version), "abort_all_requests": False}, 30)
            for link in self.links))
        for link in self.links:
            link.version = initial_version

    async def _connect(self, link: _Link) -> None:
        port = free_port(self.master_address)
        body = sglang.init_group_request(self.master_address, port, 1, 2, GROUP_NAME, self.backend)
        # The server joins only while its HTTP call is in flight, and our join
        # blocks until it has: run both at once.
        http = asyncio.create_task(_post(self._session, link.url + "/init_weights_update_group", body,
                                         self.init_timeout_s))
        join = asyncio.get_running_loop().run_in_executor(
            None, lambda: init_weight_group(self.master_address, port, 0, 2, backend=self.backend,
                                            group_name=GROUP_NAME, timeout_s=self.init_timeout_s,
                                            device=self.device))
        try:
            link.group, _ = await asyncio.gather(join, http)
        except Exception as e:
            http.cancel()
            raise PushError(f"replica {link.url} could not join its weight group: {e}") from e

    # -- one version

    def push(self, tensors: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        names = list(tensors)
        specs = [bk.TensorSpec(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in names]
        if self._plan is None or [s.name for b in self._plan for s in b] and \
                sorted(s.name for b in self._plan for s in b) != sorted(names):
            self._plan = bk.plan_buckets(specs, self.bucket_bytes)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        results = self.loop.run(self._push_all(tensors, version))
        failed = [f"{u}: {e}" for u, e in results if e]
        if failed:
            raise PushError(f"weight push of version {version} failed: " + "; ".join(failed))
        dt = time.perf_counter() - t0
        return {"push/bytes": float(nbytes), "time/push_s": dt,
                "push/GBps": nbytes / dt / 1e9 if dt > 0 else 0.0}

    async def _push_all(self, tensors, version):
        async def one(link):
            try:
                await self._push_one(link, tensors, version)
                return link.url, None
            except Exception as e:  # report per replica; the caller decides
                return link.url, f"{type(e).__name__}: {e}"
        return await asyncio.gather(*(one(link) for link in self.links))

    async def _push_one(self, link: _Link, tensors: dict[str, torch.Tensor], version: int) -> None:
        s = self._session
        if link.sessionful:
            try:
                await _post(s, link.url + "/begin_weight_update", {"selector": "all"}, 30)
            except FileNotFoundError:
                link.sessionful = False  # older SGLang: updates need no session
        loop = asyncio.get_running_loop()
        for k, bucket in enumerate(self._plan):
            last = k == len(self._plan) - 1
            body = sglang.update_request(
                [b.name for b in bucket], [bk.dtype_name(b.dtype) for b in bucket],
                [list(b.shape) for b in bucket], GROUP_NAME, flattened=True,
                flush_cache=last, weight_version=str(version) if last else None)
            flat = bk.pack([tensors[b.name] for b in bucket])
            if flat.device != self.device:
                flat = flat.to(self.device)
            http = asyncio.create_task(_post(s, link.url + "/update_weights_from_distributed", body,
                                             self.push_timeout_s))
            send = loop.run_in_executor(None, link.group.broadcast, flat)
            done, _ = await asyncio.wait({http, send}, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    # The server rejected the update (so it posts no receive):
                    # our broadcast can never complete; drop the group.
                    link.group.close()
                    http.cancel()
                    raise t.exception()
            await asyncio.gather(http, send)
        if link.sessionful:
            await _post(s, link.url + "/end_weight_update", {}, 30)
        link.version = version

    def close(self) -> None:
        async def _close():
            if self._session:
                await self._session.close()
        try:
            self.loop.run(_close(), timeout=10)
        except Exception:
            pass
        for link in self.links:
            if link.group is not None:
                link.group.close()
