"""The decode step's fused q/k norm + rotary + KV-cache write (issue 50):
the same q and cache contents as the static batch's torch path.

The kernel runs on CUDA with triton; on a CPU with triton installed,
``TRITON_INTERPRET=1`` runs it in the interpreter:

  TRITON_INTERPRET=1 python -m pytest -q tests/test_decode_rope.py

Elsewhere (CI) only the argument checks run; the batches' torch path is
tests/test_static_batch.py's and tests/test_paged_batch.py's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan_grpo.server.engine import decode_rope
from torchtitan_grpo.server.engine.decode_rope import rope_store
from torchtitan_grpo.server.engine.static_batch import _rotate

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
needs_kernel = pytest.mark.skipif(
    not decode_rope.available(DEVICE),
    reason="needs CUDA with triton, or triton and TRITON_INTERPRET=1 on a CPU")

CASES = {  # rows, q heads, kv heads, head_dim, q/k norms, cache layout
    "qwen3-gqa-slots": (5, 8, 2, 128, True, "slots"),
    "qwen3-gqa-blocks": (7, 4, 2, 64, True, "blocks"),
    "llama-mha-no-norm": (3, 3, 3, 32, False, "slots"),
    "head-dim-not-power-of-two": (4, 6, 2, 48, True, "blocks"),
}


def _case(rows, nh, nkv, hd, norm, layout, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    width = (nh + 2 * nkv) * hd
    # The projection's output as a slice of a wider buffer: a row stride that is not its width.
    qkv = torch.randn((rows, width + 8), generator=g).to(dtype)[:, :width]
    max_len = 40
    cache_shape = (rows + 2, max_len, nkv, hd) if layout == "slots" else (3 * rows, 16, nkv, hd)
    k = torch.randn(cache_shape, generator=g).to(dtype)
    v = torch.randn(cache_shape, generator=g).to(dtype)
    pos = torch.randint(0, max_len, (rows,), generator=g)
    flat = k.view(-1, nkv, hd).shape[0]
    dst = torch.randperm(flat, generator=g)[:rows]
    theta = pos.new_tensor(range(max_len)).float()[:, None] / 10000 ** (torch.arange(hd // 2).float() / (hd // 2))
    ang = torch.cat([theta, theta], -1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    qw = (1 + 0.1 * torch.randn(hd, generator=g)).to(dtype) if norm else None
    kw = (1 + 0.1 * torch.randn(hd, generator=g)).to(dtype) if norm else None
    move = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return [move(t) for t in (qkv, k, v, pos, dst, cos, sin, qw, kw)]


def _torch_path(qkv, nh, nkv, hd, cos, sin, pos, k, v, dst, qw, kw, eps):
    """The static batch's unfused step: split, norm, rotate, index_put."""
    q = qkv[:, : nh * hd].unflatten(-1, (nh, hd))
    kk = qkv[:, nh * hd : (nh + nkv) * hd].unflatten(-1, (nkv, hd))
    vv = qkv[:, (nh + nkv) * hd :].unflatten(-1, (nkv, hd))
    if qw is not None:
        q, kk = F.rms_norm(q, (hd,), qw, eps), F.rms_norm(kk, (hd,), kw, eps)
    c, s = cos[pos].unsqueeze(-2), sin[pos].unsqueeze(-2)
    q, kk = _rotate(q.float(), c.float(), s.float()), _rotate(kk.float(), c.float(), s.float())
    k, v = k.clone(), v.clone()
    k.view(-1, nkv, hd)[dst] = kk.to(k.dtype)
    v.view(-1, nkv, hd)[dst] = vv
    return q.to(qkv.dtype), k, v


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_kernel_equals_the_torch_path(case, dtype):
    rows, nh, nkv, hd, norm, layout = CASES[case]
    qkv, k, v, pos, dst, cos, sin, qw, kw = _case(rows, nh, nkv, hd, norm, layout, dtype, seed=len(case))
    want_q, want_k, want_v = _torch_path(qkv, nh, nkv, hd, cos, sin, pos, k, v, dst, qw, kw, 1e-6)
    k_before = k.clone()
    q = rope_store(qkv, nh, nkv, hd, cos, sin, pos, k, v, dst, qw, kw, 1e-6)
    assert q.shape == (rows, nh, hd) and q.dtype == dtype
    # fp32: the same math; bf16: the kernel rounds once where the torch path rounds the norm's output
    # (as the kernel does) and then rotates in fp32 here too, so one bf16 step apart at most.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(q.float().cpu(), want_q.float().cpu(), **tol)
    torch.testing.assert_close(k.float().cpu(), want_k.float().cpu(), **tol)
    torch.testing.assert_close(v.cpu(), want_v.cpu(), atol=0, rtol=0)  # V is copied as is
    # Nothing but the rows' own positions was written.
    untouched = torch.ones(k.view(-1, nkv, hd).shape[0], dtype=torch.bool)
    untouched[dst.cpu()] = False
    assert torch.equal(k.view(-1, nkv, hd)[untouched.to(DEVICE)], k_before.view(-1, nkv, hd)[untouched.to(DEVICE)])


def test_bad_arguments_name_what_is_wrong():
    qkv = torch.zeros((2, (4 + 2 * 2) * 8))
    cache = torch.zeros((2, 10, 2, 8))
    cos = torch.zeros((10, 8))
    pos = dst = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="qkv"):
        rope_store(qkv, 4, 1, 8, cos, cos, pos, cache, cache, dst, None, None, 1e-6)
    with pytest.raises(ValueError, match="q_norm and k_norm"):
        rope_store(qkv, 4, 2, 8, cos, cos, pos, cache, cache, dst, torch.ones(8), None, 1e-6)
    with pytest.raises(ValueError, match="dtype"):
        rope_store(qkv, 4, 2, 8, cos, cos, pos, cache.bfloat16(), cache.bfloat16(), dst, None, None, 1e-6)
