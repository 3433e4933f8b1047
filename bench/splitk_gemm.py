"""``x @ w.T`` for a few rows of activations, as a split-K Triton kernel (issue 50).

At 64 decode rows of the Qwen3-4B shape cuBLAS reads the decode GEMMs'
weights at ~61 % of HBM bandwidth, the attention output (K 4096 -> N 2560)
and the down projection (K 9728 -> N 2560) the slowest (docs/PERFORMANCE.md,
"The 4B decode GEMMs"). A decode GEMM is a weight read with a little math on
it: with N = 2560 cut into 64-column tiles there are 40 tiles for 132 SMs, so
one program per tile leaves most of the GPU idle. This kernel also cuts K:

- **One program per (column tile, K split).** A program holds every row
  (``M`` <= 256, padded to a power of two by masking), ``block_n`` columns and
  one contiguous range of K, and walks it in ``block_k`` steps with
  ``tl.dot`` (fp32 accumulation). The weight is read where it lies, ``[N, K]``
  as ``nn.Linear`` stores it, each byte once.
- **Deterministic split-K.** One split stores the result directly; several
  store fp32 partials to a workspace ``[splits, M, N]`` that a second kernel
  sums in split order (no atomics: the same input gives the same bits).
- **Graph-safe.** The grid and the workspace depend on the shapes and the
  :class:`GemmConfig` only; no host sync.

Measured and not taken (run 161, H200, ``python bench/decode_gemm.py --backends
cublas splitk``): the best config per GEMM made a 4B decode step's GEMMs 1.02 x
cuBLAS's at 64 rows (the down projection 2.71 against 2.65 TB/s, the attention
output 2.03 against 2.17) and 0.71 x at 256 rows. So it lives in bench/, beside
the sweep that measured it, not in the engine. :func:`available` says whether
it runs on a device (CUDA with triton, or a CPU under ``TRITON_INTERPRET=1``
for tests); ``TORCHTITAN_GRPO_SKINNY_GEMM=0`` turns it off.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from torchtitan_grpo.server.engine import paged_attention

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines and CI: nothing here runs, callers keep F.linear
    triton = None

MAX_ROWS = 256
"""Most rows :func:`linear` takes: every program holds all rows, so prefill-sized M belongs to cuBLAS."""


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of :func:`linear` (block sizes powers of two, >= 16 for ``tl.dot``)."""

    block_n: int
    """Output columns (weight rows) per program."""
    block_k: int
    """Reduction step: K elements of each weight row loaded per loop iteration."""
    split_k: int
    """K ranges the reduction is cut into (a program each per column tile); fewer run where K has
    fewer ``block_k`` steps than this, so that no split is empty."""
    num_warps: int
    """Warps per program."""
    num_stages: int
    """Software-pipelining depth of the K loop (loads in flight; shared memory grows with it)."""

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemmConfig.{name} = {v}: a power of two >= 16")
        if self.split_k < 1 or self.num_stages < 1 or self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"GemmConfig: {self}")


def available(device: torch.device) -> bool:
    """Whether :func:`linear` runs for tensors on ``device``: where the engine's Triton kernels do
    (``paged_attention.available``), unless ``TORCHTITAN_GRPO_SKINNY_GEMM=0``."""
    return os.environ.get("TORCHTITAN_GRPO_SKINNY_GEMM") != "0" and paged_attention.available(device)


_sm_count = paged_attention._sm_count


@functools.lru_cache(maxsize=None)
def default_config(m: int, n: int, k: int, sm_count: int) -> GemmConfig:
    """A placeholder until bench/decode_gemm.py's sweep has measured configs on a GPU: block_n
    64, block_k 128, 4 warps, 4 stages (2 past 128 rows: four copies of a 256-row x tile and a
    weight tile are 320 KB of shared memory, more than an H200 has), and as many K splits as
    give the grid 2-4 programs per SM (a few in flight per SM to hide the weight loads'
    latency), but no more than K has ``block_k`` steps."""
    block_n, block_k = 64, 128
    tiles = -(-n // block_n)
    split = max(1, min(-(-2 * sm_count // tiles), -(-k // block_k)))
    return GemmConfig(block_n, block_k, split, num_warps=4, num_stages=4 if m <= 128 else 2)


def splits(k: int, cfg: GemmConfig) -> tuple[int, int]:
    """``(splits, K per split)``: each split a whole number of ``block_k`` steps, none empty."""
    steps = -(-k // cfg.block_k)
    per = -(-steps // cfg.split_k) * cfg.block_k
    return -(-k // per), per


if triton is not None:

    # split_steps changes with the config's split_k: not specialised on, so a sweep over
    # split_k reuses one compile. It counts BLOCK_K steps, not elements, so that the compiler
    # sees each split start aligned (aligned loads: vectorised, and pipelined by num_stages).
    @triton.jit(do_not_specialize=["split_steps"])
    def _gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, split_steps,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, F32_DOT: tl.constexpr):
        split = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        # Padded rows and columns past N load a real row again instead of masking: masks on
        # the loads would keep them from vector loads; the store drops the extra results.
        x_rows = x_ptr + tl.minimum(rm, M - 1)[:, None] * K
        w_rows = w_ptr + (rn % N).to(tl.int64)[:, None] * K  # an LM head's N x K may pass 2**31
        start = split * split_steps * BLOCK_K
        end = tl.minimum(start + split_steps * BLOCK_K, K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(start, end, BLOCK_K):
            k = k0 + rk
            if EVEN_K:  # no split ends inside a step: no mask along K either
                x = tl.load(x_rows + k[None, :])
                w = tl.load(w_rows + k[None, :])
            else:
                x = tl.load(x_rows + k[None, :], mask=(k < end)[None, :], other=0.0)
                w = tl.load(w_rows + k[None, :], mask=(k < end)[None, :], other=0.0)
            if F32_DOT:
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        # An empty split cannot happen (splits()), but one would store zeros, still a right partial.
        out = out_ptr + split.to(tl.int64) * M * N
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        tl.store(out + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["n_splits"])
    def _sum_kernel(ws_ptr, out_ptr, MN, n_splits, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < MN
        acc = tl.zeros([BLOCK], tl.float32)
        ws = ws_ptr + i  # stepped by MN per split: no split x MN product to overflow int32
        for _ in range(0, n_splits):  # in split order: the same bits every call
            acc += tl.load(ws, mask=mask, other=0.0)
            ws += MN
        tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=mask)


SUM_BLOCK = 1024
"""Outputs per program of the split-summing kernel."""


def _f32_dot(dtype: torch.dtype) -> bool:
    # fp32 inputs: full-precision dots (no TF32). Under the interpreter too: its tl.dot
    # on bf16 tiles is wrong (paged_attention._f32_dot).
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def linear(x: torch.Tensor, w: torch.Tensor, cfg: GemmConfig | None = None) -> torch.Tensor:
    """``x @ w.T``: ``x`` ``[M, K]`` (M <= :data:`MAX_ROWS`) and ``w`` ``[N, K]`` (an
    ``nn.Linear`` weight as stored), both contiguous, of one float dtype; returns ``[M, N]`` in
    that dtype, accumulated in fp32. ``cfg`` defaults to :func:`default_config`'s."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.dtype != w.dtype or x.device != w.device:
        raise ValueError(f"skinny_gemm.linear: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}")
    if not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError("skinny_gemm.linear: x and w must be contiguous (w as nn.Linear stores it, [N, K])")
    m, k = x.shape
    n = w.shape[0]
    if not 1 <= m <= MAX_ROWS or k == 0:
        raise ValueError(f"skinny_gemm.linear: {m} rows x {k}: 1..{MAX_ROWS} rows and K > 0")
    if triton is None:
        raise RuntimeError("skinny_gemm.linear needs triton (see available())")
    cfg = cfg or default_config(m, n, k, _sm_count(x.device))
    with paged_attention.on_device(x):
        return _launch(x, w, cfg)


def _launch(x: torch.Tensor, w: torch.Tensor, cfg: GemmConfig) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    n_split, split_len = splits(k, cfg)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    # One split writes the output itself; more write fp32 partials for _sum_kernel.
    dst = out if n_split == 1 else torch.empty((n_split, m, n), dtype=torch.float32, device=x.device)
    _gemm_kernel[(triton.cdiv(n, cfg.block_n), n_split)](
        x, w, dst, m, n, k, split_len // cfg.block_k, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0, F32_DOT=_f32_dot(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if n_split > 1:
        _sum_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](dst, out, m * n, n_split, BLOCK=SUM_BLOCK, num_warps=4)
    return out
