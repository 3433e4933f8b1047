"""Decode attention over a block table, as a Triton kernel (issue 38).

The paged batch's decode step used to gather every row's blocks into a
contiguous copy per layer and run SDPA on it: the KV bytes were read, written
and read again (10-12% of the HBM roofline on an H200). This kernel reads each row's
blocks where they lie, once, flash-decoding style:

- **One program per (row, KV head, split).** A program loads the row's query
  heads of its KV head (GQA: ``group`` query heads share the K/V tile it reads,
  so K and V are read once per KV head, not once per query head), walks its
  split of the context through the block table and keeps an online softmax
  in fp32.
- **Split-K.** At 64 rows x 8 KV heads a grid of one program per (row, head)
  is about four per SM and few in flight per SM; at long contexts the context
  is cut into splits so that there are several programs per SM. A second
  kernel merges the splits' partial results (their max, sum and unnormalised
  output). One split writes the output directly.
- **KV heads first.** The grid's first axis is the KV head: the programs
  that run together read neighbouring bytes of the same positions (a
  position's K holds every KV head side by side).
- **Shared prompts.** Samples of one prompt each hold a copy of its KV (the
  static cache copies it into every sibling's slot); ``shared`` points their
  reads of it at one sibling's copy, so L2 serves the other reads (bit-equal).
- **Graph-safe.** Positions are read from device memory and the grid depends
  only on (rows, positions the step spans), the shape of the step's CUDA
  graph; no host sync.

:func:`available` says whether it runs on a device (CUDA with triton, or a
CPU under ``TRITON_INTERPRET=1`` for tests); elsewhere the batches keep their
gather + SDPA path, as they do with ``TORCHTITAN_GRPO_PAGED_KERNEL=0`` in the
environment (an A/B switch for benchmarks and a way around a broken triton).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines and CI: the batches' SDPA path runs instead
    triton = None

BLOCK_N = 64
"""Positions per tile of the context loop (several table entries of 16)."""
MIN_SPLIT = 256
"""Fewest positions a split covers: below this the merge costs more than it gives."""
PROGRAMS_PER_SM = 8
"""Split until the grid has about this many programs per SM (if the context allows): a few
waves of small programs, so rows of unequal lengths even out. 8 with 2 warps a program, KV
heads first: 1.01 x the best of 224 tunings over 64 / 256 rows x 192-1,100 positions of
Qwen3-4B's attention on an H200, where 16 with 4 warps, row first, was 1.115 x (run 161)."""


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How a launch is cut. The defaults are what the engine runs; ``bench/paged_attention.py
    --sweep`` times others on a GPU (docs/PERFORMANCE.md has the figures they were picked on)."""

    tile: int = BLOCK_N
    """Positions a program loads per loop iteration (a power of two, >= 16)."""
    min_split: int = MIN_SPLIT
    """Fewest positions a split covers."""
    programs_per_sm: int = PROGRAMS_PER_SM
    """Split until the grid has about this many programs per SM."""
    num_warps: int = 2
    num_stages: int = 2
    head_first: bool = True
    """Programs of one row's KV heads next to each other in the launch order (the grid's first
    axis the KV head). A position's K (or V) holds every KV head's ``head_dim`` side by side,
    so programs running together then read neighbouring bytes of the same positions."""


DEFAULT = Tuning()


def available(device: torch.device) -> bool:
    """Whether :func:`paged_decode` runs for tensors on ``device``."""
    if triton is None or os.environ.get("TORCHTITAN_GRPO_PAGED_KERNEL") == "0":
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Where a Triton launch for ``t`` must run: ``t``'s GPU as the current device (triton launches
    on the current one: a batch on cuda:1 while cuda:0 is current), nothing else on a CPU."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: an H100's count, so tests exercise the same splits
    return torch.cuda.get_device_properties(device).multi_processor_count


def splits(rows: int, n_kv: int, width: int, sms: int, tuning: Tuning = DEFAULT) -> tuple[int, int]:
    """``(splits, positions per split)`` of a step of ``rows`` x ``n_kv`` heads
    over ``width`` positions: a function of the step's shape only (graphs)."""
    tiles = -(-width // tuning.tile)
    want = -(-tuning.programs_per_sm * sms // (rows * n_kv))
    n = max(1, min(want, width // tuning.min_split, tiles))
    per = -(-tiles // n) * tuning.tile
    return -(-width // per), per


if triton is not None:

    # Ints that change with the step's shape are not specialised on (fewer compiles).
    @triton.jit(do_not_specialize=["s_mb", "s_mh"])
    def _split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, src_ptr, shared_ptr, o_ptr, m_ptr, l_ptr,
                      s_qb, s_qh, s_kb, s_kp, s_kh, s_tb, s_ob, s_oh, s_os, s_mb, s_mh,
                      scale, split_len,
                      GROUP: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr, HD_PAD: tl.constexpr,
                      BS: tl.constexpr, TILE: tl.constexpr, DIRECT: tl.constexpr, F32_DOT: tl.constexpr,
                      HEAD_FIRST: tl.constexpr, SHARED: tl.constexpr):
        if HEAD_FIRST:
            kvh = tl.program_id(0)
            row = tl.program_id(1)
        else:
            row = tl.program_id(0)
            kvh = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(pos_ptr + row) + 1  # the new position is in the cache already
        if SHARED:  # positions below shared[row] are read from row src[row]'s blocks (same bytes)
            src = tl.load(src_ptr + row)
            shared = tl.load(shared_ptr + row)
        start = split * split_len
        end = tl.minimum(start + split_len, length)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, HD_PAD)
        gmask = g < GROUP
        # A mask along d only where head_dim is padded: a mask the compiler
        # cannot prove constant along d keeps it from vector loads.
        dmask = d < HD if HD != HD_PAD else tl.full([HD_PAD], 1, tl.int1)
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + row * s_qb + heads[:, None] * s_qh + d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)
        qk_scale = scale * 1.4426950408889634  # exp2 below: log2(e) folded into the scale (fp32 scores)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, HD_PAD], tl.float32)
        for n0 in range(start, end, TILE):
            n = n0 + tl.arange(0, TILE)
            valid = n < end
            blk = tl.load(table_ptr + row * s_tb + n // BS, mask=valid, other=0)
            if SHARED:
                theirs = valid & (n < shared)
                blk = tl.where(theirs, tl.load(table_ptr + src * s_tb + n // BS, mask=theirs, other=0), blk)
            off = blk.to(tl.int64) * s_kb + (n % BS) * s_kp + kvh * s_kh
            kv_mask = valid[:, None] & dmask[None, :] if HD != HD_PAD else valid[:, None]
            k = tl.load(k_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if F32_DOT:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if F32_DOT:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out_mask = gmask[:, None] & dmask[None, :]
        if DIRECT:  # one split: the whole context is here
            o = acc / l[:, None]
            tl.store(o_ptr + row * s_ob + heads[:, None] * s_oh + d[None, :], o.to(o_ptr.dtype.element_ty),
                     mask=out_mask)
        else:  # an empty split (past the row's length) leaves m = -inf, l = 0, acc = 0
            tl.store(o_ptr + row * s_ob + heads[:, None] * s_oh + split * s_os + d[None, :], acc, mask=out_mask)
            tl.store(m_ptr + row * s_mb + heads * s_mh + split, m, mask=gmask)
            tl.store(l_ptr + row * s_mb + heads * s_mh + split, l, mask=gmask)

    @triton.jit(do_not_specialize=["n_splits", "s_ab", "s_ah", "s_mb", "s_mh"])
    def _merge_kernel(acc_ptr, m_ptr, l_ptr, o_ptr, n_splits,
                      s_ab, s_ah, s_as, s_mb, s_mh, s_ob, s_oh,
                      HD: tl.constexpr, HD_PAD: tl.constexpr, S_PAD: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, HD_PAD)
        smask = s < n_splits
        m = tl.load(m_ptr + row * s_mb + head * s_mh + s, mask=smask, other=float("-inf"))
        l = tl.load(l_ptr + row * s_mb + head * s_mh + s, mask=smask, other=0.0)
        top = tl.max(m, 0)  # split 0 is never empty (a row has >= 1 position)
        w = tl.math.exp2(m - top)  # empty splits: exp2(-inf) = 0
        mask = smask[:, None] & (d < HD)[None, :]
        acc = tl.load(acc_ptr + row * s_ab + head * s_ah + s[:, None] * s_as + d[None, :], mask=mask, other=0.0)
        o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(o_ptr + row * s_ob + head * s_oh + d, o.to(o_ptr.dtype.element_ty), mask=d < HD)


def _f32_dot(dtype: torch.dtype) -> bool:
    # fp32 inputs: full-precision dots (no TF32). Under the interpreter too:
    # triton 3.5's interpreter multiplies bf16 tiles' raw bits in tl.dot.
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def paged_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, pos: torch.Tensor,
                 scale: float, width: int | None = None, tuning: Tuning = DEFAULT,
                 shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of one new position per row over its cached context.

    ``q`` ``[rows, n_heads, head_dim]`` (head ``h`` reads KV head ``h // group``,
    HF's GQA order); ``k``, ``v`` one layer's pool ``[blocks, block_size,
    n_kv, head_dim]``; ``table`` ``[rows, nb]`` the rows' block ids (any integer
    dtype, row stride free); ``pos`` ``[rows]`` each row's new position, already
    in the cache (the row attends over positions ``0..pos``, ``pos < width``);
    ``width`` the positions the step may reach (``nb x block_size`` unless
    given), which alone with ``rows`` fixes the grid. Returns ``[rows, n_heads,
    head_dim]`` in ``q``'s dtype. ``tuning``: how the launch is cut (same result).

    ``shared = (src, length)``, ``[rows]`` integers each: row ``r`` reads its
    positions below ``length[r]`` through row ``src[r]``'s table entries
    instead of its own. For samples of one prompt that each hold a copy of
    its KV: pointed at one sibling, their reads of the prompt land on the
    same bytes, which the GPU's L2 serves to all but the first (the programs
    of one step's rows run side by side). The caller keeps those positions
    equal in both rows, so the result is the same to the bit."""
    rows, n_heads, hd = q.shape
    _, bs, n_kv, _ = k.shape
    if n_heads % n_kv or k.shape != v.shape or k.stride() != v.stride():
        raise ValueError(f"paged_decode: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or table.stride(-1) != 1:
        raise ValueError("paged_decode: q, k/v and table need a contiguous last dim")
    width = table.shape[1] * bs if width is None else width
    with on_device(q):
        return _launch(q, k, v, table, pos, scale, width, tuning, shared)


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, pos: torch.Tensor,
            scale: float, width: int, tuning: Tuning,
            shared: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    rows, n_heads, hd = q.shape
    _, bs, n_kv, _ = k.shape
    group = n_heads // n_kv
    n_split, split_len = splits(rows, n_kv, width, _sm_count(q.device), tuning)
    out = torch.empty((rows, n_heads, hd), dtype=q.dtype, device=q.device)
    meta = dict(GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), HD=hd,
                HD_PAD=max(16, triton.next_power_of_2(hd)), BS=bs, TILE=tuning.tile, F32_DOT=_f32_dot(q.dtype),
                HEAD_FIRST=tuning.head_first, num_warps=tuning.num_warps, num_stages=tuning.num_stages,
                SHARED=shared is not None)
    src, length = shared if shared is not None else (pos, pos)  # not read without SHARED
    common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), table.stride(0))
    grid = (n_kv, rows) if tuning.head_first else (rows, n_kv)
    if n_split == 1:
        _split_kernel[(*grid, 1)](q, k, v, table, pos, src, length, out, out, out, *common,
                                   out.stride(0), out.stride(1), 0, 0, 0, scale, split_len, DIRECT=True, **meta)
        return out
    acc = torch.empty((rows, n_heads, n_split, hd), dtype=torch.float32, device=q.device)
    m = torch.empty((rows, n_heads, n_split), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    _split_kernel[(*grid, n_split)](q, k, v, table, pos, src, length, acc, m, l, *common,
                                     acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
                                     scale, split_len, DIRECT=False, **meta)
    _merge_kernel[(rows, n_heads)](acc, m, l, out, n_split, acc.stride(0), acc.stride(1), acc.stride(2),
                                    m.stride(0), m.stride(1), out.stride(0), out.stride(1),
                                    HD=hd, HD_PAD=meta["HD_PAD"], S_PAD=max(2, triton.next_power_of_2(n_split)),
                                    num_warps=4)
    return out
