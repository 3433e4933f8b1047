"""A decode step's q/k norm, rotary and KV-cache write, as one Triton kernel (issue 50).

Between the fused QKV projection and the attention kernel, the static and
paged batches' decode step ran about a dozen small kernels per layer: a copy
of q and of k (the projection's slices are not contiguous, the norm wants
them so), two RMSNorms (Qwen3's ``q_norm`` / ``k_norm``), a cat, a negation,
another cat, two multiplies and an add for the rotary, and two index_puts
writing K and V into the cache. On an H200 at the Qwen3-4B shape and 64 rows
each costs 1.5-4 µs of almost pure latency: ~30 µs a layer, 1 ms of a
6.6 ms step (docs/PERFORMANCE.md, run 134). This kernel does all of it in one
launch: one program per (row, head) over the projection's output row.

- q heads: norm (when the model has ``q_norm``), rotate, write into ``q_out``;
- k heads: norm (``k_norm``), rotate, write into the cache at the row's slot;
- v heads: copied into the cache at the same slot.

Numerics: the norm's statistics are fp32 and its output is rounded to the
model dtype, as the norm module's output is; the rotary then runs in fp32
and rounds once (the torch path rounds after each multiply and the add), so
q and k may differ from the unfused path by one bf16 rounding.

:func:`available` is :func:`paged_attention.available`'s rule (CUDA with
triton, or the interpreter on a CPU for tests), and
``TORCHTITAN_GRPO_FUSED_ROPE=0`` in the environment turns it off (the A/B
switch for benchmarks).
"""

from __future__ import annotations

import os

import torch

from torchtitan_grpo.server.engine import paged_attention

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines and CI: the batches' torch path runs instead
    triton = None


def available(device: torch.device) -> bool:
    """Whether :func:`rope_store` runs for tensors on ``device``."""
    return os.environ.get("TORCHTITAN_GRPO_FUSED_ROPE") != "0" and paged_attention.available(device)


if triton is not None:

    @triton.jit
    def _rope_store_kernel(qkv_ptr, s_qkv, q_ptr, s_qb, s_qh, k_ptr, v_ptr, s_ks, s_kh, dst_ptr, pos_ptr,
                           cos_ptr, sin_ptr, s_cos, qw_ptr, kw_ptr, eps,
                           NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                           HALF_PAD: tl.constexpr, NORM: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)  # q heads, then k heads, then v heads: the projection's column order
        i = tl.arange(0, HALF_PAD)
        m = i < HALF
        src = qkv_ptr + row * s_qkv + head * HD
        x1 = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + i, mask=m, other=0.0).to(tl.float32)
        dst = tl.load(dst_ptr + row).to(tl.int64)
        if head < NH + NKV:
            if NORM:
                r = tl.math.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / HD + eps)
                if head < NH:
                    w1 = tl.load(qw_ptr + i, mask=m, other=0.0).to(tl.float32)
                    w2 = tl.load(qw_ptr + HALF + i, mask=m, other=0.0).to(tl.float32)
                else:
                    w1 = tl.load(kw_ptr + i, mask=m, other=0.0).to(tl.float32)
                    w2 = tl.load(kw_ptr + HALF + i, mask=m, other=0.0).to(tl.float32)
                # Rounded to the model dtype: the norm module's output dtype.
                x1 = (x1 * r * w1).to(qkv_ptr.dtype.element_ty).to(tl.float32)
                x2 = (x2 * r * w2).to(qkv_ptr.dtype.element_ty).to(tl.float32)
            p = tl.load(pos_ptr + row).to(tl.int64)
            c1 = tl.load(cos_ptr + p * s_cos + i, mask=m, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + p * s_cos + HALF + i, mask=m, other=0.0).to(tl.float32)
            n1 = tl.load(sin_ptr + p * s_cos + i, mask=m, other=0.0).to(tl.float32)
            n2 = tl.load(sin_ptr + p * s_cos + HALF + i, mask=m, other=0.0).to(tl.float32)
            # HF's rotate_half: the two halves of the head are the pairs.
            y1 = (x1 * c1 - x2 * n1).to(qkv_ptr.dtype.element_ty)
            y2 = (x2 * c2 + x1 * n2).to(qkv_ptr.dtype.element_ty)
            if head < NH:
                tl.store(q_ptr + row * s_qb + head * s_qh + i, y1, mask=m)
                tl.store(q_ptr + row * s_qb + head * s_qh + HALF + i, y2, mask=m)
            else:
                tl.store(k_ptr + dst * s_ks + (head - NH) * s_kh + i, y1, mask=m)
                tl.store(k_ptr + dst * s_ks + (head - NH) * s_kh + HALF + i, y2, mask=m)
        else:
            out = v_ptr + dst * s_ks + (head - NH - NKV) * s_kh
            tl.store(out + i, x1.to(qkv_ptr.dtype.element_ty), mask=m)
            tl.store(out + HALF + i, x2.to(qkv_ptr.dtype.element_ty), mask=m)


def rope_store(qkv: torch.Tensor, n_heads: int, n_kv: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
               pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, dst: torch.Tensor,
               q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Norm and rotate a decode step's q and k, write k and v into the cache; return q.

    ``qkv`` ``[rows, (n_heads + 2 n_kv) x head_dim]`` the fused projection's
    output (row stride free); ``cos``, ``sin`` ``[positions, head_dim]`` the
    rotary tables, row ``pos[r]`` for row ``r``; ``k_cache``, ``v_cache`` one
    layer's cache, any layout whose view ``[-1, n_kv, head_dim]`` is a view
    (slots x positions, or blocks x block size), row ``r`` written at flat
    index ``dst[r]``; ``q_norm``, ``k_norm`` the norms' weights (both or
    neither). Returns q ``[rows, n_heads, head_dim]``."""
    rows = qkv.shape[0]
    if qkv.shape[1] != (n_heads + 2 * n_kv) * head_dim or qkv.stride(1) != 1 or head_dim % 2:
        raise ValueError(f"rope_store: qkv {tuple(qkv.shape)} for {n_heads} + 2 x {n_kv} heads of {head_dim}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("rope_store: q_norm and k_norm go together")
    if cos.stride(1) != 1 or cos.stride() != sin.stride():
        raise ValueError("rope_store: cos and sin need one layout with a contiguous last dim")
    kf, vf = k_cache.view(-1, n_kv, head_dim), v_cache.view(-1, n_kv, head_dim)
    if kf.stride() != vf.stride() or kf.stride(2) != 1 or kf.dtype != qkv.dtype or vf.dtype != qkv.dtype:
        raise ValueError("rope_store: K and V caches need qkv's dtype and one layout with a contiguous head dim")
    q = torch.empty((rows, n_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    norm = q_norm is not None
    half = head_dim // 2
    args = (qkv, qkv.stride(0), q, q.stride(0), q.stride(1), kf, vf, kf.stride(0), kf.stride(1), dst, pos,
            cos, sin, cos.stride(0), q_norm if norm else qkv, k_norm if norm else qkv, float(eps))
    meta = dict(NH=n_heads, NKV=n_kv, HD=head_dim, HALF=half, HALF_PAD=max(16, triton.next_power_of_2(half)),
                NORM=norm)
    with paged_attention.on_device(qkv):
        _rope_store_kernel[(rows, n_heads + 2 * n_kv)](*args, num_warps=1, **meta)
    return q
