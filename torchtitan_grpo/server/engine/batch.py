"""The KV batch: the running sequences' KV cache and the forward passes on it.

The engine decides *what* runs (which sequences join, when finished ones
leave, what each row samples); a :class:`KVBatch` decides *how* the model is
run on them and where their keys and values live. Keeping that behind a small
interface lets another cache layout (a preallocated static cache with
CUDA-graph decode steps, ``server/engine/static_batch.py``) replace the one here without
the engine changing. A batch takes the model and the device; it never imports
``server/engine/engine.py``, and the engine keeps everything that is not KV state (the
sampled tokens not yet fed, the queue, the locks).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, Protocol

import torch

from torchtitan_grpo.server.engine import kv_pool, moe_routes, paged_batch, static_batch
from torchtitan_grpo.server.engine.to_device import upload  # noqa: F401  (server/engine/engine.py and server/engine/sampling.py take it from here)

logger = logging.getLogger(__name__)


class KVBatch(Protocol):
    """What the engine needs of a batch of sequences sharing forward passes.

    Called on the engine's worker thread only. Sequences are the engine's
    ``_Sequence`` records: a batch reads their ``req`` (identity and
    ``prompt_ids``), ``index``, ``output_ids`` and ``context()``, and sets
    ``cached_tokens`` on a sample that shares another's prefill.
    """

    rows: list
    """The live sequences, in logits-row order."""
    can_merge: bool
    """New sequences may join a non-empty batch (else only an empty one)."""

    def room(self) -> int:
        """How many more sequences fit now."""
        ...

    def prefill(self, seqs: list) -> torch.Tensor:
        """Forward the new sequences' contexts (samples of one request with no
        output yet share one prefill row), append them to ``rows``, and
        return their last-position logits ``[len(seqs), vocab]`` in ``seqs``
        order."""
        ...

    def decode(self, last: torch.Tensor) -> torch.Tensor:
        """Feed ``last`` (``[len(rows)]`` token ids, one per row) and return
        the logits ``[len(rows), vocab]`` of the position it fills."""
        ...

    def keep(self, idx: list[int]) -> None:
        """Keep only these rows, in this order; drop the rest, free their KV."""
        ...

    def clear(self) -> None:
        """Drop every row (the batch is empty and reusable afterwards)."""
        ...

    def weights_changed(self) -> None:
        """The engine installed a weight version (between forward passes)."""
        ...


KV_CACHES = ("auto", "static", "paged", "dynamic")
DEFAULT_STATIC_LEN = 2048
"""Positions per slot of the static cache when ``max_model_len`` is not set
(and the model's own context is longer): the cache is allocated up front,
slots x positions, so the default stays modest."""


def make_batch(model: Any, cfg: Any, device: torch.device, pad_token_id: int) -> KVBatch:
    """The batch an engine configured by ``cfg`` (an ``EngineConfig``) runs on:
    ``kv_cache`` "static" (preallocated slots, CUDA-graph decode on a GPU),
    "paged" (the same on a block pool sized by a memory budget, ``server/engine/paged_batch.py``),
    "dynamic" (the HF forward on a growing cache) or "auto" (static on a GPU
    for the model families it supports, else dynamic)."""
    if cfg.kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHES)}, got {cfg.kv_cache!r}")
    kind = cfg.kv_cache
    unsupported = static_batch.supports(model)
    if kind == "auto":
        kind = auto_kind(model, cfg, device, unsupported)
    if kind == "dynamic":
        return DynamicBatch(model, device, cfg.max_batch_size, pad_token_id, routes=cfg.return_routed_experts)
    if unsupported is not None:
        raise ValueError(f"kv_cache {kind}: {unsupported}; use kv_cache dynamic")
    if kind == "paged":
        return paged_batch.make_paged(model, cfg, device)
    max_len = static_len(model, cfg)
    if max_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_len}")
    return static_batch.StaticBatch(model, device, cfg.max_batch_size, max_len, graphs=cfg.cuda_graphs,
                                    routes=cfg.return_routed_experts)


def static_len(model: Any, cfg: Any) -> int:
    """Positions per slot of the static cache: ``max_model_len``, else the
    model's context up to :data:`DEFAULT_STATIC_LEN`."""
    own = int(getattr(model.config, "max_position_embeddings", None) or DEFAULT_STATIC_LEN)
    return cfg.max_model_len or min(own, DEFAULT_STATIC_LEN)


def auto_kind(model: Any, cfg: Any, device: torch.device, unsupported: str | None) -> str:
    """What ``kv_cache = "auto"`` means for this model, config and device.

    Dynamic on a CPU or for a model the slot caches do not support. On a GPU
    static while its slots fit the KV budget, the paged pool's own budget
    (``kv_cache_memory_gb`` or a fraction of the free memory): static is a
    little faster at short lengths (no block tables, measured in
    docs/PERFORMANCE.md) but reserves every slot's whole length up front, so
    at long ``max_model_len`` it could not start at all (64 x 16k positions
    of a 4B shape are 154 GB) where the paged pool, admitting by free blocks,
    serves. A memory budget given in GiB asks for the pool outright."""
    if device.type != "cuda" or unsupported is not None:
        return "dynamic"
    if cfg.kv_cache_memory_gb > 0:
        return "paged"
    dtype = model.model.embed_tokens.weight.dtype
    positions = static_len(model, cfg)
    need = cfg.max_batch_size * positions * kv_pool.bytes_per_token(model, dtype)
    budget = kv_pool.budget_bytes(device, 0.0, cfg.kv_cache_memory_fraction)
    if budget is not None and need > budget:
        logger.info("kv_cache auto: paged (a static cache of %d x %d positions needs %.1f GiB, the budget is "
                    "%.1f GiB)", cfg.max_batch_size, positions, need / 2**30, budget / 2**30)
        return "paged"
    return "static"


class DynamicBatch:
    """A :class:`KVBatch` on the HF model's own forward and an HF
    ``DynamicCache``, left-padded: every row's cache ends at the same column,
    so one decode step appends one column for all rows. Rows of different
    lengths are told apart by the attention mask and their own positions.
    Joining a running batch left-pads the shorter side's KV; leaving drops
    rows, then the columns that are now padding for every remaining row."""

    def __init__(self, model: Any, device: torch.device, max_batch_size: int, pad_token_id: int,
                 routes: bool = False):
        self.model = model
        # Routed experts (router replay): hooks on the MoE routers, None when off.
        self._gates = moe_routes.GateHooks(model) if routes else None
        self.device = device
        self.max_batch_size = max_batch_size
        self.pad_token_id = pad_token_id
        self.can_merge = self._layers_mergeable()
        self.rows: list = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # [B, T] 1 = real token in cache
        self._next_pos: torch.Tensor | None = None  # [B] position of the next fed token

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _layers_mergeable(self) -> bool:
        """Joining a running batch edits the KV tensors of plain full-attention
        layers; anything else (sliding windows, linear attention) only admits
        new sequences into an empty batch."""
        from transformers.cache_utils import DynamicLayer

        cache = self._new_cache()
        layers = getattr(cache, "layers", None)
        return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)

    # ---- KVBatch --------------------------------------------------------- #

    def room(self) -> int:
        return self.max_batch_size - len(self.rows)

    def prefill(self, seqs: list) -> torch.Tensor:
        # Samples of one request that have no output yet share one prefill row.
        groups: dict[tuple, int] = {}
        uniq: list[list[int]] = []
        row_of: list[int] = []
        for s in seqs:
            key = (id(s.req),) if not s.output_ids else (id(s.req), s.index)
            if key not in groups:
                groups[key] = len(uniq)
                uniq.append(s.context())
            else:
                s.cached_tokens = len(s.req.prompt_ids)
            row_of.append(groups[key])
        lens = torch.tensor([len(c) for c in uniq])
        width = int(lens.max())
        ids = torch.full((len(uniq), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(uniq), width), dtype=torch.long)
        for i, c in enumerate(uniq):
            ids[i, width - len(c) :] = torch.tensor(c)
            mask[i, width - len(c) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = self._new_cache()
        with self._capture(len(uniq), width) as routes:
            out = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=pos.to(self.device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        if routes:
            for s, r in zip(seqs, row_of):
                moe_routes.start(s, routes[0][r, width - len(uniq[r]) :])  # left-padded: the real positions
        cache = out.past_key_values
        idx = torch.tensor(row_of)
        if len(uniq) != len(seqs) or not torch.equal(idx, torch.arange(len(seqs))):
            cache.batch_select_indices(idx.to(self.device))
        logits = out.logits[:, -1, :][idx.to(self.device)]
        self._merge(seqs, cache, mask[idx].to(self.device), lens[idx].to(self.device))
        return logits

    def decode(self, last: torch.Tensor) -> torch.Tensor:
        ones = torch.ones((len(self.rows), 1), dtype=self._mask.dtype, device=self.device)
        self._mask = torch.cat([self._mask, ones], dim=1)
        with self._capture(len(self.rows), 1) as routes:
            out = self.model(
                input_ids=last[:, None],
                attention_mask=self._mask,
                position_ids=self._next_pos[:, None],
                past_key_values=self._cache,
                use_cache=True,
            )
        if routes:
            moe_routes.extend(self.rows, routes[0][:, 0])
        self._cache = out.past_key_values
        self._next_pos = self._next_pos + 1
        return out.logits[:, -1, :]

    def keep(self, idx: list[int]) -> None:
        if not idx:
            self.clear()
            return
        sel = torch.tensor(idx, device=self.device)
        self._cache.batch_select_indices(sel)
        self.rows = [self.rows[i] for i in idx]
        self._mask, self._next_pos = self._mask[sel], self._next_pos[sel]
        # Columns that are padding for every remaining row are dead weight.
        first = int(self._mask.any(dim=0).nonzero()[0])
        if first > 0 and self.can_merge:
            for layer in self._cache.layers:
                layer.keys = layer.keys[..., first:, :]
                layer.values = layer.values[..., first:, :]
            self._mask = self._mask[:, first:]

    def weights_changed(self) -> None:
        """Nothing to do: every forward pass reads the parameters afresh."""

    def clear(self) -> None:
        self.rows, self._cache, self._mask, self._next_pos = [], None, None, None

    def _capture(self, batch: int, width: int):
        """The routers' picks of one forward (an empty list when routes are off)."""
        return self._gates.capture(batch, width) if self._gates is not None else nullcontext([])

    # ---- joining --------------------------------------------------------- #

    def _merge(self, seqs: list, cache: Any, mask: torch.Tensor, next_pos: torch.Tensor) -> None:
        """Append new rows to the running batch, left-padding the shorter KV side."""
        if not self.rows:
            self.rows, self._cache, self._mask, self._next_pos = list(seqs), cache, mask, next_pos
            return
        t_old, t_new = self._mask.shape[1], mask.shape[1]
        width = max(t_old, t_new)
        for old_layer, new_layer in zip(self._cache.layers, cache.layers):
            old_layer.keys = torch.cat([_left_pad(old_layer.keys, width, -2), _left_pad(new_layer.keys, width, -2)])
            old_layer.values = torch.cat(
                [_left_pad(old_layer.values, width, -2), _left_pad(new_layer.values, width, -2)]
            )
        self._mask = torch.cat([_left_pad(self._mask, width, -1), _left_pad(mask, width, -1)])
        self._next_pos = torch.cat([self._next_pos, next_pos])
        self.rows.extend(seqs)


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Zero-pad ``t`` on the left along ``dim`` up to ``width``."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
