"""The residual add + RMSNorm and the SwiGLU product as one Triton kernel each (issue 50).

In a decode step at 64 rows every elementwise op is a kernel of ~1.5-4 µs
that is almost all launch latency plus a gap in the graph: a Qwen3-4B layer
spent ~10 µs on two residual adds, two norms, a SiLU and a multiply around
its GEMMs (docs/PERFORMANCE.md, run 134). Fused:

- :func:`add_rms_norm`: ``h + delta`` rounded to the model dtype (as torch's
  add rounds it), returned as the new residual stream, and its RMSNorm (fp32
  statistics, weight applied in fp32, one rounding: ``F.rms_norm``'s math);
- :func:`silu_mul`: ``silu(gate) * up`` from the fused gate/up projection's
  output, in fp32 with one rounding (the torch path rounds after the SiLU).

Each has the torch expression it replaces as the fallback, so callers need
not branch: on a CPU without the interpreter (tests, CI) the fallback runs.
``TORCHTITAN_GRPO_FUSED_OPS=0`` turns the kernels off (the A/B switch).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from torchtitan_grpo.server.engine import paged_attention

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines and CI: the torch expressions run instead
    triton = None

SILU_BLOCK = 1024
"""Columns per program of :func:`silu_mul` (an intermediate size is a few thousand)."""


def available(device: torch.device) -> bool:
    """Whether the kernels run for tensors on ``device`` (else the torch fallbacks)."""
    return os.environ.get("TORCHTITAN_GRPO_FUSED_OPS") != "0" and paged_attention.available(device)


if triton is not None:

    @triton.jit
    def _add_norm_kernel(h_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, s_h, s_d, eps, N: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        m = c < N
        h = tl.load(h_ptr + row * s_h + c, mask=m, other=0.0).to(tl.float32)
        d = tl.load(d_ptr + row * s_d + c, mask=m, other=0.0).to(tl.float32)
        s = (h + d).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * N + c, s, mask=m)
        x = s.to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, 0) / N + eps)
        w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + c, (x * r * w).to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, s_gu, I: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < I
        g = tl.load(gu_ptr + row * s_gu + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * s_gu + I + c, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * I + c, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last]`` without a copy where its layout allows (row stride free)."""
    return x.reshape(-1, x.shape[-1])


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + delta, rms_norm(h + delta) * weight)``, both in ``h``'s dtype and shape."""
    if not fused:
        s = h + delta
        return s, F.rms_norm(s, (s.shape[-1],), weight, eps)
    n = h.shape[-1]
    h2, d2 = _rows(h), _rows(delta)
    if h2.stride(-1) != 1 or d2.stride(-1) != 1 or delta.shape != h.shape:
        raise ValueError(f"add_rms_norm: h {tuple(h.shape)} and delta {tuple(delta.shape)} with contiguous rows")
    s, out = torch.empty_like(h2), torch.empty_like(h2)
    with paged_attention.on_device(h):
        _add_norm_kernel[(h2.shape[0],)](h2, d2, weight, s, out, h2.stride(0), d2.stride(0), float(eps), N=n,
                                         BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8)
    return s.view(h.shape), out.view(h.shape)


def silu_mul(gate_up: torch.Tensor, fused: bool) -> torch.Tensor:
    """``silu(gate) * up`` of the fused projection's output ``[..., 2 x I]`` (gate first): ``[..., I]``."""
    if not fused:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    gu = _rows(gate_up)
    i = gu.shape[-1] // 2
    if gu.stride(-1) != 1 or gu.shape[-1] % 2:
        raise ValueError(f"silu_mul: gate_up {tuple(gate_up.shape)} with contiguous rows of even width")
    out = torch.empty((gu.shape[0], i), dtype=gu.dtype, device=gu.device)
    with paged_attention.on_device(gu):
        _silu_mul_kernel[(gu.shape[0], triton.cdiv(i, SILU_BLOCK))](gu, out, gu.stride(0), I=i, BLOCK=SILU_BLOCK,
                                                                    num_warps=4)
    return out.view(*gate_up.shape[:-1], i)

