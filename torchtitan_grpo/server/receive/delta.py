"""The built-in server's end of a delta push (``weight_sync.delta = true``).

``POST /update_weights_delta`` (a built-in extension; what SGLang and vLLM
offer instead: docs/PROTOCOL_NOTES.md "Delta push") takes one version as a body of ``weight_sync.delta``
(:func:`~torchtitan_grpo.weight_sync.delta.encode_body`): per tensor either
its changed elements against the version this server serves
(``base_version``) or the whole tensor. Each changed tensor is applied to a
copy of the served one and checked against the trainer's CRC-32; then every
tensor of the version goes in with one :meth:`Engine.load_weights` (under
``Engine.exclusive``: all or nothing, the version set with the weights, so no
forward pass sees a torn version). Tensors the body does not name did not
change.

Replies (SGLang's control shape):

* 200 ``{"success": true, "message", "apply_s", "tensors"}``;
* 409 ``{"success": false, "full_push_needed": true, "message"}`` when this
  server does not serve ``base_version`` or an applied tensor fails its
  CRC-32: the sender then sends the version whole;
* 400 with one line naming what is wrong for a malformed body, an unknown
  tensor or a shape mismatch.

The served weights and version are unchanged by any refusal. Versions are
applied one at a time (a lock); mixing this route with another weight-update
route on one replica at the same time is not supported (the other one could
change a tensor between its read here and the load).
"""

from __future__ import annotations

import asyncio
import time

import torch
from aiohttp import web

from torchtitan_grpo.server.engine.expert_views import expert_views
from torchtitan_grpo.server.engine.requests import WeightUpdateError
from torchtitan_grpo.protocol.builtin import DELTA_ROUTE  # the wire format both ends share
from torchtitan_grpo.weight_sync import delta

__all__ = ["DELTA_ROUTE", "DeltaRoutes"]


class NeedsFull(Exception):
    """The delta cannot be applied to what this server serves: send the version whole."""


class DeltaRoutes:
    """``DELTA_ROUTE`` over one engine."""

    def __init__(self, engine):
        self.engine = engine
        self._lock = asyncio.Lock()
        self._tensors: dict[str, torch.Tensor] | None = None

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The model's tensors by HF name, read at the first update (not when the app is built)."""
        if self._tensors is None:
            self._tensors = {**self.engine.model.state_dict(keep_vars=True), **expert_views(self.engine.model)}
        return self._tensors

    @property
    def max_body(self) -> int:
        """A version is at most every tensor whole in 8-byte elements (a delta is never larger)."""
        return sum(p.numel() for p in self.params.values()) * 8 + (64 << 20)

    def register(self, app: web.Application) -> None:
        app.router.add_post(DELTA_ROUTE, self.update)

    async def _read(self, request: web.Request) -> bytearray:
        """The body, up to ``max_body`` bytes (read as a stream: aiohttp's own
        limit is sized for JSON control bodies)."""
        if (request.content_length or 0) > self.max_body:
            raise delta.DeltaError(f"body of {request.content_length} bytes is larger than any version of "
                                   f"this model ({self.max_body})")
        body = bytearray()
        async for chunk in request.content.iter_any():
            body += chunk
            if len(body) > self.max_body:
                raise delta.DeltaError(f"body is larger than any version of this model ({self.max_body} bytes)")
        return body

    def _apply(self, body: bytearray) -> tuple[str, int, float]:
        """Decode, apply, check and load one version; (version, tensors, seconds)."""
        t0 = time.perf_counter()
        header, tensors = delta.decode_body(body)
        base = header.get("base_version")
        if base is not None and base != self.engine.weight_version:  # None: every tensor whole
            raise NeedsFull(f"the delta is against version {base!r}, this server serves "
                            f"{self.engine.weight_version!r}")
        named = []
        for d in tensors:
            p = self.params.get(d.name)
            if p is None:
                raise delta.DeltaError(f"unknown parameter {d.name!r}: the model has no tensor of that name")
            if tuple(p.shape) != d.shape:
                raise delta.DeltaError(f"shape mismatch for {d.name!r}: received {list(d.shape)}, "
                                       f"model has {list(p.shape)}")
            with torch.no_grad():
                try:
                    named.append((d.name, delta.apply(p, d)))
                except delta.DeltaMismatch as e:
                    raise NeedsFull(str(e)) from None
        self.engine.load_weights(named, header["version"])
        return header["version"], len(named), time.perf_counter() - t0

    async def update(self, request: web.Request) -> web.Response:
        try:
            body = await self._read(request)
            async with self._lock:
                version, n, seconds = await asyncio.to_thread(self._apply, body)
        except NeedsFull as e:
            return web.json_response({"success": False, "full_push_needed": True,
                                      "message": f"{DELTA_ROUTE}: {e}; send the version whole"}, status=409)
        except (delta.DeltaError, WeightUpdateError) as e:
            return web.json_response({"success": False, "message": f"{DELTA_ROUTE}: {e}"}, status=400)
        return web.json_response({"success": True, "message": f"version {version}: {n} tensor(s) loaded",
                                  "apply_s": seconds, "tensors": n})
