"""Transport "delta" (``weight_sync.delta = true``; built-in servers only):
each replica gets only the elements that changed since the version it holds.

Per replica, per version (the Pusher's ``Replica.version`` is the version it
holds):

    [pause] -> POST /update_weights_delta (one binary body, weight_sync.delta) -> [continue]

The trainer keeps host copies of the staged versions it may need as a base
(``keep_bases``: the newest and the one before, so a replica one version
behind gets a delta). A replica whose version has no copy here (the
initial weights it loaded from disk, a restart, more than ``keep_bases - 1``
versions behind, a failed transfer) gets the version whole over the same
route, as does one that answers 409 (it does not serve the base, or an
applied tensor failed its CRC-32). Each (base, version) body is encoded
once, by the first sender that needs it, off the event loop, and shared by
every replica at that base.

The bytes travel in the HTTP body: a delta is small, but a whole version
goes at HTTP speed, not a weight group's (a fallback's cost; the first push
of a run is always one). ``history`` keeps one record per transfer (changed
elements, bytes, encode and apply seconds) for the bench and the tests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
import torch

from torchtitan_grpo.protocol.builtin import DELTA_ROUTE
from torchtitan_grpo.weight_sync import buckets as bk
from torchtitan_grpo.weight_sync import delta
from torchtitan_grpo.weight_sync.control import PushError, read_reply
from torchtitan_grpo.weight_sync.push_config import PushConfig
from torchtitan_grpo.weight_sync.sglang_push import tag_version
from torchtitan_grpo.weight_sync.staging import Staged
from torchtitan_grpo.weight_sync.transport import Replica, Transport

__all__ = ["DeltaPush", "validate_delta"]

logger = logging.getLogger(__name__)


def validate_delta(cfg, check) -> None:
    """Start-up checks of ``weight_sync.delta``; ``check(ok, key, msg, value)`` raises ConfigError."""
    w, i = cfg.weight_sync, cfg.inference
    if not w.delta:
        return
    check(i.backend == "builtin", "weight_sync.delta", f'needs inference.backend = "builtin" (got {i.backend!r}): '
          "SGLang's weight routes take whole tensors, and vLLM's sparse_nccl backend is not spoken by this push "
          '(docs/PROTOCOL_NOTES.md "Delta push")', w.delta)
    check(getattr(w, "fanout", "per_replica") == "per_replica", "weight_sync.delta",
          'goes to each replica on its own: not with weight_sync.fanout = "broadcast"', w.delta)
    lora = getattr(cfg, "lora", None)
    check(not (lora is not None and lora.enable and w.lora_push == "adapter"), "weight_sync.delta",
          'has nothing to add to weight_sync.lora_push = "adapter" (the adapter is the change): use one', w.delta)


class DeltaPush(Transport):
    """Changed elements (or whole tensors) over the built-in server's ``DELTA_ROUTE``."""

    keep_bases: int = 2
    """Versions kept as bases: each costs one host copy of the pushed weights."""
    max_density: float | None = None
    """A tensor with more than this fraction changed goes whole (None: where
    the delta would not be smaller, ``delta.density_limit``)."""

    def __init__(self, cfg: PushConfig, device: torch.device):
        super().__init__(cfg, device)
        self._lock = asyncio.Lock()  # one encoder at a time: bases and bodies are shared
        self._bases: dict[int, tuple[list[list[bk.TensorSpec]], list[torch.Tensor]]] = {}
        """version -> (its plan, host copies of its staged buckets)."""
        self._bodies: dict[tuple[int | None, int], tuple[bytes, dict]] = {}
        """(base version or None, version) -> (body, its stats), for the newest version only."""
        self.history: list[dict] = []

    @property
    def reads_host_memory(self) -> bool:
        return True  # encoded and sent from host memory

    async def connect(self, r: Replica) -> None:
        if not (await self.probe_builtin(r)).builtin:
            raise PushError(f"weight_sync.delta: {r.url} is not the built-in server, whose route the delta "
                            "push uses: set weight_sync.delta = false")
        r.builtin = True

    async def tag(self, replicas: list[Replica], version: int) -> None:
        await tag_version(self, replicas, version)

    def metrics(self) -> dict[str, float]:
        """The newest transfer's changed-element and byte shares (of the whole
        version), for the step's metrics; {} before the first."""
        if not self.history:
            return {}
        last = self.history[-1]
        return {"push/delta_changed_frac": last["changed"] / max(last["elements"], 1),
                "push/delta_bytes_frac": last["bytes"] / max(last["full_bytes"], 1)}

    async def send(self, r: Replica, staged: Staged) -> None:
        base = r.version if r.version in self._bases else None
        pausing = self.cfg.pause_mode != "none"
        if pausing:
            await self.post(r, "/pause_generation", {"mode": self.cfg.pause_mode}, 30)
        try:
            body, stats = await self._body(base, staged)
            t0 = time.perf_counter()
            status, reply = await self._post_body(r, body)
            if status == 409 and base is not None:  # the replica does not hold the base: whole
                logger.warning("delta push to %s: %s", r.url, reply.get("message"))
                body, stats = await self._body(None, staged)
                t0 = time.perf_counter()
                status, reply = await self._post_body(r, body)
            read_reply(r.url + DELTA_ROUTE, status, json.dumps(reply))  # raises on a refusal, with its line
            self.history.append(stats | {"url": r.url, "post_s": time.perf_counter() - t0,
                                         "apply_s": float(reply.get("apply_s", 0.0))})
        finally:
            if pausing:
                await self.unpause(r, "/continue_generation", {})

    async def _post_body(self, r: Replica, body: bytes) -> tuple[int, dict]:
        async with self.session.post(r.url + DELTA_ROUTE, data=body,
                                     headers={"Content-Type": "application/octet-stream"},
                                     timeout=aiohttp.ClientTimeout(total=self.cfg.deadline_s)) as resp:
            try:
                reply = await resp.json(content_type=None)
            except ValueError:
                reply = {"message": (await resp.text())[:300]}
            return resp.status, reply if isinstance(reply, dict) else {}

    async def _body(self, base: int | None, staged: Staged) -> tuple[bytes, dict]:
        """The body of ``staged`` against ``base`` (None: whole), encoded once."""
        async with self._lock:
            key = (base, staged.version)
            if key not in self._bodies:
                self._bodies[key] = await asyncio.get_running_loop().run_in_executor(
                    None, self._encode, base, staged)
                for k in [k for k in self._bodies if k[1] < staged.version]:
                    del self._bodies[k]
            return self._bodies[key]

    def _encode(self, base: int | None, staged: Staged) -> tuple[bytes, dict]:
        """A thread: keep ``staged`` as a base, and encode it against ``base``."""
        staged.await_written()
        for done in staged.ready or []:  # from a GPU: the copies to pinned memory
            done.synchronize()
        v = staged.version
        if v not in self._bases:
            self._bases[v] = (staged.plan, [b.clone() for b in staged.buffers])
            for old in sorted(self._bases)[:-self.keep_bases]:
                del self._bases[old]
        t0 = time.perf_counter()
        old_plan, old_bufs = self._bases.get(base, (None, None)) if base is not None else (None, None)
        if old_plan is not None and old_plan != staged.plan:
            old_bufs = None  # another layout (other tensors): nothing to diff against
        out, changed, elements = [], 0, 0
        for k, (bucket, buf) in enumerate(zip(staged.plan, staged.buffers)):
            olds = bk.unpack(old_bufs[k], bucket) if old_bufs is not None else [None] * len(bucket)
            for spec, old, new in zip(bucket, olds, bk.unpack(buf, bucket)):
                d = delta.encode(spec.name, old, new, self.max_density)
                elements += new.numel()
                if d is not None:
                    out.append(d)
                    changed += new.numel() if d.changed < 0 else d.changed
        body = delta.encode_body(str(v), None if old_bufs is None else str(base), out)
        full = sum(s.nbytes for bucket in staged.plan for s in bucket)
        return body, {"version": v, "base": base if old_bufs is not None else None,
                      "changed": changed, "elements": elements, "tensors_sent": len(out),
                      "whole_tensors": sum(d.full for d in out), "bytes": len(body), "full_bytes": full,
                      "encode_s": time.perf_counter() - t0}
