"""Routed-experts bookkeeping of the built-in engine (MoE router replay).

With ``--enable-return-routed-experts`` a KV batch reports, for every input
position it runs, the expert ids each MoE layer's router picked; this module
keeps them per sequence and hands a finished sample its
``[len(prompt) + len(output) - 1, num_moe_layers, top_k]`` array (what
``Sample.routed_experts`` and both engines' wire formats carry, see
``protocol/route_codec.py``).

- A prefill gives a sequence one chunk covering its whole context (a
  sequence re-prefilled after ``pause(retract)`` starts over: the chunk
  replaces what it had, as its KV cache was replaced).
- Each decode step appends one row per batch row. Under the overlapped
  schedule a row that already ended is fed once more: that extra row is
  past the end and cut off when the sample is assembled.
- Chunks stay on the device until the sample finishes (one copy then, not a
  host sync per step).

How a batch captures the ids: the static batch computes them itself
(``server/engine/static_moe.py``); the dynamic batch runs HF's MoE blocks, and
:class:`GateHooks` reads their routers' outputs.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch

from torchtitan_grpo.protocol.route_codec import REQUEST_FIELD
from torchtitan_grpo.server.engine.static_moe import is_moe

ROUTES_FLAG = "--enable-return-routed-experts"


def moe_layers(model: Any) -> list[int]:
    """Indices of the decoder layers whose MLP is a routed MoE block ([] for a dense model)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) or []
    return [i for i, layer in enumerate(layers) if is_moe(getattr(layer, "mlp", None))]


def top_k(model: Any) -> int:
    return int(model.config.num_experts_per_tok)


def refusal(enabled: bool, model: Any, field: str) -> str | None:
    """Why a request that asks for routes (``field``) cannot have them, or None."""
    if not enabled:
        return f"field {field!r}: routed experts need a server started with {ROUTES_FLAG}"
    if not moe_layers(model):
        return f"field {field!r}: the served model has no MoE layers, so it has no routed experts"
    return None


def vllm_wanted(enabled: bool, model: Any, asked: bool) -> tuple[bool, str | None]:
    """vLLM's rule: a server that captures routes returns them on every
    completion; ``return_routed_experts`` (SGLang's request flag, which vLLM
    ignores) makes a request that cannot have them a 400 instead of a reply
    without them. (wanted, why refused)."""
    why = refusal(enabled, model, REQUEST_FIELD)
    return why is None, why if asked else None


def start(seq: Any, routes: torch.Tensor) -> None:
    """A prefill ran ``seq``'s context: ``routes [len(context), layers, k]``."""
    seq.route_chunks = [routes]


def extend(rows: list, step: torch.Tensor) -> None:
    """A decode step fed one token per row: ``step [len(rows), layers, k]``."""
    for i, s in enumerate(rows):
        if getattr(s, "route_chunks", None) is not None:
            s.route_chunks.append(step[i : i + 1])


def assemble(seq: Any) -> np.ndarray | None:
    """The finished sample's int16 routes ``[len(prompt) + len(output) - 1, layers, k]``
    (rows the engine never ran, as for a sample aborted before its prefill, are -1);
    None when routes were not captured."""
    chunks = getattr(seq, "route_chunks", None)
    if chunks is None:
        return None
    rows = max(len(seq.req.prompt_ids) + len(seq.output_ids) - 1, 0)
    if not chunks:
        return None
    have = torch.cat(chunks)[:rows].to("cpu", torch.int16).numpy()
    if have.shape[0] == rows:
        return have
    out = np.full((rows, *have.shape[1:]), -1, dtype=np.int16)
    out[: have.shape[0]] = have
    return out


class GateHooks:
    """Forward hooks on the routers of an HF model's MoE blocks that record
    the picked expert ids while :meth:`capture` is open on the calling thread
    (a prompt-logprobs forward on another thread is not recorded)."""

    def __init__(self, model: Any):
        self.layers = moe_layers(model)
        self._owner: int | None = None
        self._ids: list[torch.Tensor | None] = [None] * len(self.layers)
        for j, li in enumerate(self.layers):
            model.model.layers[li].mlp.gate.register_forward_hook(self._hook(j))

    def _hook(self, j: int):
        def record(_module: Any, _args: Any, out: Any) -> None:
            if self._owner == threading.get_ident():
                self._ids[j] = out[-1]  # HF routers return (logits, weights, expert ids)
        return record

    @contextmanager
    def capture(self, batch: int, width: int) -> Iterator[list[torch.Tensor]]:
        """Within the block, run one forward over ``[batch, width]`` tokens;
        afterwards the list holds ``[batch, width, layers, k]`` expert ids."""
        self._ids = [None] * len(self.layers)
        self._owner = threading.get_ident()
        out: list[torch.Tensor] = []
        try:
            yield out
        finally:
            self._owner = None
        if any(t is None for t in self._ids):
            raise RuntimeError("routed experts: a MoE layer's router did not run in this forward")
        out.append(torch.stack([t.reshape(batch, width, -1) for t in self._ids], dim=2))
