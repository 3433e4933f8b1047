"""A KV batch with a preallocated cache and CUDA-graph decode steps.

The dynamic batch (``server/engine/batch.py``) runs the HF model's own forward on a
``DynamicCache``: every decode step is ~30 Python-level module calls per layer
and a few hundred kernel launches, so on a GPU a small model's step costs
tens of milliseconds of launch overhead for well under a millisecond of HBM
traffic. This batch removes that overhead without hand-written kernels:

- **Slots.** The KV cache is one tensor per layer, ``[slots, max_len, kv_heads,
  head_dim]``, allocated once. A sequence owns a slot from admission to its end;
  nothing is ever moved, concatenated or left-padded. Each slot's next position
  is its own (rows of one batch may sit at different lengths).
- **Decode over a slot prefix.** A decode step runs the first ``B`` slots, ``B``
  the smallest bucket that covers every live slot (free slots compute rows
  nobody reads), and attends over the first ``L`` cache positions, ``L`` the
  smallest bucket over the longest live row. So each ``(B, L)`` pair has fixed
  shapes and is captured once as a CUDA graph and replayed.
- **The model's own weights.** The step reads the HF model's embedding, norms,
  projections, MLPs and LM head; attention is written here (rotary on per-row
  positions, a cache write at per-row positions), because the HF attention
  assumes one cache position per batch. On a GPU with triton the decode step's
  attention is ``paged_attention.py``'s kernel (a slot cache is a pool of one
  block of ``max_len`` per slot: each row reads its own length), its q/k norm,
  rotary and cache write ``decode_rope.py``'s, and the residual adds, norms and
  SwiGLU ``fused_ops.py``'s; elsewhere SDPA with a per-row length mask and the
  torch ops.
  Weights are read from the model's parameters, so a weight update that
  copies into the parameters' storage is seen by every captured graph; an
  update that swaps storage must call :meth:`StaticBatch.weights_changed`.

Supported: the plain pre-norm decoder family (Llama, Qwen2, Qwen3, Mistral
without sliding windows; Qwen3-MoE, whose MoE MLPs run ``server/engine/static_moe.py``'s
graph-safe grouped experts and report their routes): ``supports(model)`` says so, else the engine keeps
the dynamic batch. On CPU the same code runs without graphs (tests compare
its logits with the HF forward).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchtitan_grpo.server.engine import decode_rope, fused_ops, moe_routes, paged_attention, shared_prompts
from torchtitan_grpo.server.engine.static_moe import is_moe, moe_forward
from torchtitan_grpo.server.engine.to_device import upload

logger = logging.getLogger(__name__)

_SUPPORTED_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe")
PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The prefill's attention backends, cuDNN's left out: torch 2.11 picks it for these shapes on an
H200 and builds a plan per new number of prompts, so a prefill of a size not met before took
74-119 ms against 23-36 ms with flash (run 155, ``bench/prefill_cost.py``), and a burst split
across two prefills met new sizes on every run."""

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def supports(model: Any) -> str | None:
    """None if ``model`` can run on a static batch, else why not (for the log)."""
    cfg = model.config
    if cfg.model_type not in _SUPPORTED_TYPES:
        return f"model_type {cfg.model_type!r} (static batch knows {', '.join(_SUPPORTED_TYPES)})"
    types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in types) or getattr(cfg, "sliding_window", None) and getattr(
        cfg, "use_sliding_window", cfg.model_type == "mistral"
    ):
        return "sliding-window attention"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "not a decoder with model.layers and model.rotary_emb"
    attn = inner.layers[0].self_attn
    if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
        return "attention without q/k/v/o projections"
    dense = ("gate_proj", "up_proj", "down_proj", "act_fn")
    if not all(is_moe(layer.mlp) or all(hasattr(layer.mlp, n) for n in dense) for layer in inner.layers):
        return "MLP neither gate/up/down projections nor a grouped-experts MoE block"
    return None


def _bucket(n: int, buckets: Sequence[int], cap: int) -> int:
    for b in buckets:
        if b >= n:
            return min(b, cap)
    return cap


def _len_bucket(n: int, cap: int) -> int:
    # Attention reads every position of the bucket for every live slot (at
    # 64 slots x 256 positions that is ~2 GB of KV per step for a
    # Qwen3-0.6B shape), so buckets stay close to the longest row: steps of
    # 64 up to 512, of 256 beyond (fewer graphs where a step is long anyway).
    step = 64 if n <= 512 else 256
    return min(-(-n // step) * step, cap)


def _norm(module: Any, x: torch.Tensor) -> torch.Tensor:
    # One fused kernel where the HF module spends about seven (cast, pow,
    # mean, add, rsqrt, mul, mul): per layer that is most of a decode step's
    # launches. Same math (fp32 statistics); the weight multiply is in fp32
    # before the cast instead of after it, a bf16 rounding difference.
    return F.rms_norm(x, (x.shape[-1],), module.weight, _eps(module))


def _eps(module: Any) -> float:
    return getattr(module, "variance_epsilon", None) or getattr(module, "eps", 1e-6)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # HF's rotate_half convention: the two halves of the head dim are the pair.
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def _fuse(linears: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) buffer holding ``linears``' rows back to back,
    each module's parameter re-pointed to a view of its rows: one GEMM where
    there were several, and a weight update that copies into a parameter
    writes the fused buffer the graphs read."""
    w = torch.cat([m.weight.data for m in linears])
    with_bias = all(m.bias is not None for m in linears)
    b = torch.cat([m.bias.data for m in linears]) if with_bias else None
    off = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = w[off : off + rows]
        if b is not None:
            m.bias.data = b[off : off + rows]
        off += rows
    return w, b


class StaticBatch:
    """The :class:`~torchtitan_grpo.server.engine.batch.KVBatch` of a preallocated
    slot cache; decode steps are CUDA graphs on a GPU (``graphs``)."""

    can_merge = True
    shares_prompts = True
    """Samples of one prompt may read its KV from one sibling's slot (each slot holds a copy)."""

    def __init__(self, model: Any, device: torch.device, slots: int, max_len: int, graphs: bool = True,
                 routes: bool = False):
        why = supports(model)
        if why is not None:
            raise ValueError(f"static KV batch: unsupported model: {why}")
        self.model = model
        self.device = device
        self.slots = slots
        self.max_len = max_len
        self.graphs = graphs and device.type == "cuda"
        self.kernel = paged_attention.available(device)
        """Decode attention by ``server/engine/paged_attention.py``'s kernel (else SDPA over the
        cache's slices): a slot cache is a pool of ``slots`` blocks of ``max_len`` positions."""
        self.fused_rope = decode_rope.available(device)
        """The decode step's q/k norm, rotary and cache write by ``server/engine/decode_rope.py``'s kernel."""
        self.fused_ops = fused_ops.available(device)
        """Residual add + norm and SwiGLU by ``server/engine/fused_ops.py``'s kernels."""
        self._silu = getattr(model.config, "hidden_act", "silu") == "silu"
        inner = model.model
        self._inner = inner
        self._layers = list(inner.layers)
        cfg = model.config
        attn = self._layers[0].self_attn
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(attn, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.scaling = float(attn.scaling)
        dtype = inner.embed_tokens.weight.dtype
        self.k, self.v = self._new_cache(dtype)
        with torch.no_grad():
            pos = torch.arange(max_len, device=device)[None]
            probe = torch.zeros((1, 1), dtype=dtype, device=device)
            cos, sin = inner.rotary_emb(probe, pos)
        self._cos, self._sin = cos[0].contiguous(), sin[0].contiguous()  # [max_len, head_dim]
        # Decode inputs live in fixed buffers (graph inputs are addresses).
        self._tokens = torch.zeros(slots, dtype=torch.long, device=device)
        self._pos = torch.zeros(slots, dtype=torch.long, device=device)
        self._len = [0] * slots  # host mirror of each slot's cached length
        self._free = list(range(slots))  # lowest slot first keeps the live prefix short
        # Slot i as the kernel's block table sees it (one block of max_len positions), and the flat
        # index of its position 0 in the cache's [-1, kv_heads, head_dim] view.
        self._slot_table = torch.arange(slots, device=device)[:, None]
        self._slot_base = self._slot_table[:, 0] * max_len
        self._slot_of: list[int] = []  # per row
        self.shared = (shared_prompts.SharedPrompts(slots, device)
                       if self.kernel and self.shares_prompts and shared_prompts.enabled() else None)
        """Samples of one prompt read its KV from one sibling's slot (``server/engine/shared_prompts.py``)."""
        self.rows: list[Any] = []
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._capture_stream = None
        self._warm: set[int] = set()  # slot buckets whose eager warm-up ran
        self.late_captures = 0
        """Graphs captured while generating (after :meth:`capture_all`): each
        one stalled the batch for a capture."""
        # Graph steps write their logits here (one buffer for every graph,
        # not one output per captured shape).
        vocab = model.get_output_embeddings().weight.shape[0]
        self._logits = torch.empty((slots, vocab), dtype=dtype, device=device) if self.graphs else None
        self._fused: list[tuple[torch.Tensor, torch.Tensor | None, Any, Any]] = []
        # MoE: each step's expert ids per MoE layer land in _sink (Python, at
        # trace/capture time) and, with routes on, in the fixed _route_buf a
        # graph writes: [slots, moe layers, top_k].
        self._moe = [is_moe(layer.mlp) for layer in self._layers]
        self._sink: list[torch.Tensor] | None = None
        n_moe = sum(self._moe)
        self._route_buf = torch.full((slots, n_moe, moe_routes.top_k(model)), -1, dtype=torch.int32,
                                     device=device) if routes and n_moe else None
        self._fuse_weights()
        self._param_ptrs = self._ptrs()

    def _new_cache(self, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer K and V caches (``server/engine/paged_batch.py`` allocates blocks instead)."""
        shape = (self.slots, self.max_len, self.n_kv, self.head_dim)
        new = lambda: [torch.zeros(shape, dtype=dtype, device=self.device) for _ in self._layers]  # noqa: E731
        return new(), new()

    def _fuse_weights(self) -> None:
        self._fused = []
        for layer in self._layers:
            a, m = layer.self_attn, layer.mlp
            wqkv, bqkv = _fuse([a.q_proj, a.k_proj, a.v_proj])
            if any(p.bias is not None for p in (a.q_proj, a.k_proj, a.v_proj)) and bqkv is None:
                raise ValueError("static KV batch: q/k/v projections with and without bias")
            wgu, bgu = (None, None) if is_moe(m) else _fuse([m.gate_proj, m.up_proj])  # MoE: grouped already
            self._fused.append((wqkv, bqkv, wgu, bgu))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    # ---- KVBatch --------------------------------------------------------- #

    def room(self) -> int:
        return len(self._free)

    def clear(self) -> None:
        self.rows, self._slot_of = [], []
        self._free = list(range(self.slots))
        self._len = [0] * self.slots
        self._pos.zero_()
        if self.shared is not None:
            self.shared.clear()

    def keep(self, idx: list[int]) -> None:
        kept = set(idx)
        freed = [slot for i, slot in enumerate(self._slot_of) if i not in kept]
        for slot in freed:
            self._len[slot] = 0
            self._free.append(slot)
        if freed:
            # A free slot inside a step's bucket is computed too (its row unread): at position 0, its
            # own. Left where its row ended, a row that filled the cache (and the step run ahead of
            # its end) would sit at max_len: past the rotary table and, for the fused cache write,
            # at position 0 of the next slot (run 135's device-side assert).
            self._pos[upload(freed, self.device)] = 0
            if self.shared is not None:
                self.shared.left(freed, [self._slot_of[i] for i in idx])
        self._free.sort()
        self.rows = [self.rows[i] for i in idx]
        self._slot_of = [self._slot_of[i] for i in idx]

    def prefill(self, seqs: list[Any]) -> torch.Tensor:
        """Prefill the new sequences (one row per distinct context: samples of
        one request with no output yet share it, their slots get a copy of its
        KV) and return their last-position logits in ``seqs`` order."""
        if len(seqs) > len(self._free):
            raise RuntimeError(f"static KV batch: {len(seqs)} sequences for {len(self._free)} free slots")
        ctxs, row_of = self._contexts(seqs)
        slots = [self._free.pop(0) for _ in seqs]
        owner = [slots[row_of.index(r)] for r in range(len(ctxs))]  # per context: the slot its prefill writes
        logits = self._prefill_with_routes(seqs, ctxs, row_of, torch.tensor(owner, device=self.device))
        # Siblings share the owner's KV: copy it into their own slots.
        src = [owner[r] for r in row_of]
        copies = [(d, s) for d, s in zip(slots, src) if d != s]
        if copies:
            dst_t = torch.tensor([d for d, _ in copies], device=self.device)
            src_t = torch.tensor([s for _, s in copies], device=self.device)
            width = max(len(ctxs[r]) for r in row_of)
            for cache in self.k + self.v:
                cache[dst_t, :width] = cache[src_t, :width]
        if self.shared is not None:
            self.shared.prefilled(slots, src, [len(ctxs[r]) for r in row_of])
        for slot, r in zip(slots, row_of):
            self._len[slot] = len(ctxs[r])
        pos = torch.tensor([len(ctxs[r]) for r in row_of], device=self.device)
        self._pos[torch.tensor(slots, device=self.device)] = pos
        self.rows.extend(seqs)
        self._slot_of.extend(slots)
        return logits[torch.tensor(row_of, device=self.device)]

    def decode(self, last: torch.Tensor) -> torch.Tensor:
        """Feed one token per row, return logits ``[len(rows), vocab]``."""
        n_rows = len(self._slot_of)
        # Rows in slots 0..n-1, in order (the usual case: lowest free slot
        # first): plain slices, no index tensor to upload, no gather.
        dense = self._slot_of[-1] == n_rows - 1 and self._slot_of == list(range(n_rows))
        slots = slice(0, n_rows) if dense else upload(self._slot_of, self.device)
        self._tokens[slots] = last
        live = n_rows if dense else max(self._slot_of) + 1
        longest = max(self._len[s] for s in self._slot_of) + 1
        if longest > self.max_len:
            raise RuntimeError(f"static KV batch: a row reached max_len {self.max_len}")
        b = _bucket(live, _BATCH_BUCKETS, self.slots)
        n = _len_bucket(longest, self.max_len)
        out = self._replay(b, n) if self.graphs else self._step(b, n)
        if self._route_buf is not None:  # copied out: the next step overwrites the buffer
            moe_routes.extend(self.rows, self._route_buf[slots].clone())
        for s in self._slot_of:
            self._len[s] += 1
        self._pos[slots] += 1
        return out[slots]

    # ---- weights --------------------------------------------------------- #

    def _ptrs(self) -> list[int]:
        return [p.data_ptr() for p in self.model.parameters()]

    def weights_changed(self) -> None:
        """Call after a weight update: graphs captured on parameter storage
        that has since been replaced (a ``.data`` swap) are dropped and
        recaptured on next use; copies into the same storage keep them."""
        if self._ptrs() != self._param_ptrs:
            self._fuse_weights()  # the swapped-in tensors are copied into new fused buffers
            self._param_ptrs = self._ptrs()
            self._graphs.clear()

    # ---- the forward ----------------------------------------------------- #

    def _attn_qkv(self, li: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        a = self._layers[li].self_attn
        wqkv, bqkv = self._fused[li][:2]
        nq, nkv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        out = F.linear(x, wqkv, bqkv)
        qk = out[..., : nq + nkv].unflatten(-1, (self.n_heads + self.n_kv, self.head_dim))
        v = out[..., nq + nkv :].unflatten(-1, (self.n_kv, self.head_dim))
        if hasattr(a, "q_norm"):
            qk = torch.cat((_norm(a.q_norm, qk[..., : self.n_heads, :]), _norm(a.k_norm, qk[..., self.n_heads :, :])), -2)
        # q and k rotate in one pass (half the launches of two).
        qk = _rotate(qk, cos.unsqueeze(-2), sin.unsqueeze(-2))
        return qk[..., : self.n_heads, :], qk[..., self.n_heads :, :], v

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, norm: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h + delta, norm(h + delta))``: the residual stream and the next block's input (``delta``
        None: ``h`` as it is), one kernel with the fused ops."""
        if delta is None:
            return h, _norm(norm, h)
        return fused_ops.add_rms_norm(h, delta, norm.weight, _eps(norm), self.fused_ops)

    def _mlp(self, li: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``li``'s MLP (or MoE block) of its normed input ``x``: what it adds to the residual."""
        layer = self._layers[li]
        if self._moe[li]:
            out, idx = moe_forward(layer.mlp, x)
            if self._sink is not None:
                self._sink.append(idx)
            return out
        wgu, bgu = self._fused[li][2:]
        gate_up = F.linear(x, wgu, bgu)
        if self._silu:
            inner = fused_ops.silu_mul(gate_up, self.fused_ops)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            inner = layer.mlp.act_fn(gate) * up
        return layer.mlp.down_proj(inner)

    def _contexts(self, seqs: list[Any]) -> tuple[list[list[int]], list[int]]:
        """``(contexts, row_of)``: one context per distinct prompt (samples of one
        request with no output yet share their request's; those that share one
        are marked ``cached_tokens``) and each sequence's context index."""
        groups: dict[tuple, int] = {}
        ctxs: list[list[int]] = []
        row_of: list[int] = []
        for s in seqs:
            key = (id(s.req),) if not s.output_ids else (id(s.req), s.index)
            if key not in groups:
                ctx = s.context()
                if len(ctx) >= self.max_len:
                    raise RuntimeError(f"context of {len(ctx)} tokens does not fit max_len {self.max_len}")
                groups[key] = len(ctxs)
                ctxs.append(ctx)
            else:
                s.cached_tokens = len(s.req.prompt_ids)
            row_of.append(groups[key])
        return ctxs, row_of

    def _prefill_with_routes(self, seqs: list[Any], ctxs: list[list[int]], row_of: list[int],
                             where: Any) -> torch.Tensor:
        """:meth:`_prefill`, and with routed experts on, each sequence's prompt routes."""
        self._sink = [] if self._route_buf is not None else None
        logits = self._prefill(ctxs, where)
        if self._sink is not None:
            width = max(len(c) for c in ctxs)
            routes = torch.stack(self._sink, dim=1).view(len(ctxs), width, *self._route_buf.shape[1:])
            for s, r in zip(seqs, row_of):
                moe_routes.start(s, routes[r, : len(ctxs[r])])
            self._sink = None
        return logits

    def _store_prefill_kv(self, li: int, k: torch.Tensor, v: torch.Tensor, where: torch.Tensor) -> None:
        """Write layer ``li``'s prefill K and V ``[contexts, width, kv_heads, head_dim]``:
        context ``i`` into slot ``where[i]``."""
        width = k.shape[1]
        self.k[li][where, :width] = k
        self.v[li][where, :width] = v

    def _prefill(self, ctxs: list[list[int]], where: Any) -> torch.Tensor:
        """Right-padded, causal: a real token never sees a pad (pads come after it).
        ``where``: where the contexts' K and V go (:meth:`_store_prefill_kv`)."""
        n = len(ctxs)
        width = max(len(c) for c in ctxs)
        ids = torch.zeros((n, width), dtype=torch.long)
        for i, c in enumerate(ctxs):
            ids[i, : len(c)] = torch.tensor(c)
        ids = ids.to(self.device)
        cos, sin = self._cos[:width][None], self._sin[:width][None]
        h, delta = self._inner.embed_tokens(ids), None
        with sdpa_kernel(PREFILL_SDPA):  # once per prefill: it sets process-wide flags
            for li, layer in enumerate(self._layers):
                h, x = self._add_norm(h, delta, layer.input_layernorm)
                q, k, v = self._attn_qkv(li, x, cos, sin)
                self._store_prefill_kv(li, k, v, where)
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                    is_causal=True, scale=self.scaling, enable_gqa=self.n_kv != self.n_heads,
                )
                h, x = self._add_norm(h, layer.self_attn.o_proj(o.transpose(1, 2).reshape(n, width, -1)),
                                      layer.post_attention_layernorm)
                delta = self._mlp(li, x)
        rows = torch.arange(n, device=self.device), torch.tensor([len(c) - 1 for c in ctxs], device=self.device)
        h = _norm(self._inner.norm, h[rows] + delta[rows])  # the last positions only
        return self.model.lm_head(h)

    def _step(self, b: int, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step of slots ``[0, b)`` over cache positions ``[0, n)``
        (logits into ``out`` if given)."""
        ids, pos = self._tokens[:b], self._pos[:b]
        where, width = self._decode_where(b, n, pos)
        cos, sin = (None, None) if self.fused_rope else (self._cos[pos], self._sin[pos])
        mask = None if self.kernel else (torch.arange(width, device=self.device)[None] <= pos[:, None])[:, None, None, :]
        h, delta = self._inner.embed_tokens(ids), None
        self._sink = [] if self._route_buf is not None else None
        for li, layer in enumerate(self._layers):
            h, x = self._add_norm(h, delta, layer.input_layernorm)
            if self.fused_rope:
                q = self._rope_store(li, x, where)
            else:
                q, k, v = self._attn_qkv(li, x, cos, sin)
                self._store_kv(li, k, v, where)
            o = self._attend(li, q, b, width, where, mask)
            h, x = self._add_norm(h, layer.self_attn.o_proj(o.reshape(b, -1)), layer.post_attention_layernorm)
            delta = self._mlp(li, x)
        if self._sink is not None:  # inside the graph: a copy into the fixed buffer
            self._route_buf[:b].copy_(torch.stack(self._sink, dim=1))
            self._sink = None
        h = self._add_norm(h, delta, self._inner.norm)[1]
        head = self.model.lm_head
        if out is None or head.bias is not None:
            logits = head(h)
            return logits if out is None else out.copy_(logits)
        return torch.mm(h, head.weight.t(), out=out)

    def _rope_store(self, li: int, x: torch.Tensor, where: Any) -> torch.Tensor:
        """Layer ``li``'s fused QKV projection of ``x``, then ``server/engine/decode_rope.py``'s
        kernel: q and k normed and rotated, k and v written into the cache; returns q."""
        a = self._layers[li].self_attn
        wqkv, bqkv = self._fused[li][:2]
        dst, _, pos = where
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        return decode_rope.rope_store(F.linear(x, wqkv, bqkv), self.n_heads, self.n_kv, self.head_dim, self._cos,
                                      self._sin, pos, self.k[li], self.v[li], dst,
                                      None if qn is None else qn.weight, None if kn is None else kn.weight,
                                      0.0 if qn is None else _eps(qn))

    def _store_kv(self, li: int, k: torch.Tensor, v: torch.Tensor, where: Any) -> None:
        """Write a decode step's K and V ``[b, kv_heads, head_dim]`` of layer ``li``: row ``r`` at
        flat index ``dst[r]`` of the cache's ``[-1, kv_heads, head_dim]`` view."""
        dst = where[0]
        self.k[li].view(-1, self.n_kv, self.head_dim)[dst] = k
        self.v[li].view(-1, self.n_kv, self.head_dim)[dst] = v

    def _attend(self, li: int, q: torch.Tensor, b: int, width: int, where: Any,
                mask: torch.Tensor | None) -> torch.Tensor:
        """A decode step's attention in layer ``li``, the step's K/V already in the cache: ``q``
        ``[b, heads, head_dim]`` over each row's positions ``0..pos`` (``width``: the step's span)."""
        _, table, pos = where
        if self.kernel:
            return paged_attention.paged_decode(q, self.k[li], self.v[li], table, pos, self.scaling, width,
                                                shared=self._shared_args(b))
        keys, values = self._cached_kv(li, b, width, where)
        # GQA without copying K/V per query head: the heads of one KV head
        # are its query rows (HF's repeat_kv order: head h reads kv h // group).
        return F.scaled_dot_product_attention(
            q.view(b, self.n_kv, self.n_heads // self.n_kv, self.head_dim),
            keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask, scale=self.scaling,
        )

    def _shared_args(self, b: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kernel's ``shared`` for a step over slots ``[0, b)`` (None: each reads its own)."""
        return None if self.shared is None else self.shared.args(b)

    def _decode_where(self, b: int, n: int, pos: torch.Tensor) -> tuple[Any, int]:
        """``((flat cache index of each row's new position, block table, pos), positions
        the step attends over)`` for a step of ``b`` rows over ``n`` cache positions:
        row ``i`` is slot ``i``, at ``pos[i]``."""
        return (self._slot_base[:b] + pos, self._slot_table[:b], pos), n

    def _cached_kv(self, li: int, b: int, width: int, where: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' keys and values of layer ``li``, ``[b, width, kv_heads, head_dim]`` (SDPA's path)."""
        return self.k[li][:b, :width], self.v[li][:b, :width]

    def shapes(self) -> list[tuple[int, int]]:
        """Every (slots, positions) pair a decode step can run, largest first."""
        slot_buckets = sorted({_bucket(i, _BATCH_BUCKETS, self.slots) for i in range(1, self.slots + 1)})
        len_buckets = sorted({_len_bucket(i, self.max_len) for i in range(1, self.max_len + 1)})
        return [(b, n) for b in reversed(slot_buckets) for n in reversed(len_buckets)]

    def prepare(self) -> None:
        """Log the layout and capture every decode graph (:meth:`capture_all`)."""
        logger.info("static KV cache: %d slots x %d positions (%.2f GiB), CUDA graphs %s", self.slots,
                    self.max_len, self.nbytes / 2**30, "on" if self.graphs else "off")
        if self.graphs:
            secs = self.capture_all()
            logger.info("captured %d decode graphs in %.1f s", len(self._graphs), secs)

    def capture_all(self) -> float:
        """Capture the decode graph of every shape now (an engine calls this
        before it serves, as SGLang and vLLM capture at start): a capture
        costs two eager steps, tens of milliseconds that would otherwise
        stall a live batch the first time a shape comes up, and which shapes
        come up depends on when requests arrive. Largest first, so the
        smaller graphs' temporaries reuse the pool's memory. Returns seconds."""
        if not self.graphs:
            return 0.0
        t0 = time.perf_counter()
        for b, n in self.shapes():
            if (b, n) not in self._graphs:
                self._graphs[(b, n)] = self._capture(b, n)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _replay(self, b: int, n: int) -> torch.Tensor:
        entry = self._graphs.get((b, n))
        if entry is None:
            t0 = time.perf_counter()
            entry = self._capture(b, n)
            self._graphs[(b, n)] = entry
            self.late_captures += 1
            logger.info("decode graph for %d slots x %d positions captured while generating (%.0f ms)",
                        b, n, 1e3 * (time.perf_counter() - t0))
        graph, out = entry
        graph.replay()
        return out

    def _capture(self, b: int, n: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        if self.kernel:
            # Compile (JIT) the attention kernel's variant of this shape (one split or
            # several) outside the capture: the warm-up step below runs once per row count.
            pos = torch.zeros_like(self._pos[:b])
            (_, table, _), width = self._decode_where(b, n, pos)
            q = torch.zeros((b, self.n_heads + self.n_kv, self.head_dim), dtype=self.k[0].dtype,
                            device=self.device)[:, : self.n_heads]
            paged_attention.paged_decode(q, self.k[0], self.v[0], table, pos, self.scaling, width,
                                         shared=self._shared_args(b))
        # Warm up on a side stream (lazy inits, cuBLAS workspaces) once per
        # slot count, then capture. The step writes the cache at the slots'
        # current positions: harmless, the replay that follows writes the
        # same values there (and a free slot's cache is rewritten before it
        # is read).
        if b not in self._warm:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._step(b, n)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self._warm.add(b)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        # Our own capture stream, on the batch's device, under that device:
        # torch.cuda.graph's default stream is one per process, made on
        # whichever device was current at its first capture. A server on
        # cuda:1 (cuda:0 current) failed to start on a 2-GPU host, and a
        # second engine on another GPU captured on the first one's stream.
        with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=self._pool, stream=self._capture_stream):
            out = self._step(b, n, self._logits[:b])
        return graph, out
