"""The decode step's fused residual add + RMSNorm and SwiGLU product (issue 50):
the kernels give the torch expressions they replace.

The kernels run on CUDA with triton; on a CPU with triton installed,
``TRITON_INTERPRET=1`` runs them in the interpreter:

  TRITON_INTERPRET=1 python -m pytest -q tests/test_fused_ops.py

Elsewhere (CI) the fallbacks run, which are the static batch's own torch
path (tests/test_static_batch.py compares its logits with the HF forward).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan_grpo.server.engine import fused_ops

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
needs_kernel = pytest.mark.skipif(
    not fused_ops.available(DEVICE),
    reason="needs CUDA with triton, or triton and TRITON_INTERPRET=1 on a CPU")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _tol(dtype):
    # bf16: the kernels round once where torch rounds after each op (SiLU), or sum in another order.
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)


@needs_kernel
@DTYPES
@pytest.mark.parametrize("shape", [(5, 48), (2, 3, 2560), (1, 100)], ids=["rows", "prefill-3d", "odd-width"])
def test_add_rms_norm_equals_torch(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    h = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    d = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(DEVICE)
    s, out = fused_ops.add_rms_norm(h, d, w, 1e-6, fused=True)
    want_s, want = fused_ops.add_rms_norm(h, d, w, 1e-6, fused=False)
    assert s.shape == out.shape == h.shape and s.dtype == out.dtype == dtype
    # The sum rounds once either way: equal in fp32; in bf16 within one step (triton's interpreter
    # converts to bf16 by its own rounding, not round-to-nearest-even).
    torch.testing.assert_close(s, want_s, atol=0, rtol=0 if dtype == torch.float32 else 2**-7)
    torch.testing.assert_close(out.float(), want.float(), **_tol(dtype))


@needs_kernel
@DTYPES
@pytest.mark.parametrize("shape", [(4, 2 * 9728), (2, 3, 2 * 100)], ids=["4b-intermediate", "prefill-3d-odd"])
def test_silu_mul_equals_torch(shape, dtype):
    g = torch.Generator().manual_seed(shape[-1])
    wide = torch.randn((*shape[:-1], shape[-1] + 6), generator=g).to(dtype).to(DEVICE)
    gate_up = wide[..., : shape[-1]]  # a row stride wider than the row, as a slice would have
    out = fused_ops.silu_mul(gate_up, fused=True)
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(out.float(), (F.silu(gate) * up), **_tol(dtype))
    assert out.shape == (*shape[:-1], shape[-1] // 2)


def test_fallbacks_are_the_torch_expressions():
    h, d, w = torch.randn(3, 8), torch.randn(3, 8), torch.rand(8)
    s, out = fused_ops.add_rms_norm(h, d, w, 1e-5, fused=False)
    assert torch.equal(s, h + d) and torch.equal(out, F.rms_norm(h + d, (8,), w, 1e-5))
    gu = torch.randn(3, 10)
    assert torch.equal(fused_ops.silu_mul(gu, fused=False), F.silu(gu[:, :5]) * gu[:, 5:])
