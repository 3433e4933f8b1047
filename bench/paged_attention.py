"""One layer's decode attention over the paged KV cache: the triton kernel
(``torchtitan_grpo/server/engine/paged_attention.py``) against the gather + SDPA
path it replaces, in GB/s of K and V read and % of the HBM bandwidth.

Each row: ``rows`` sequences, every one at ``context`` positions, Qwen3-4B's
attention shape (32 query heads, 8 KV heads, head_dim 128, bf16), blocks of
16 positions scattered at random through the pool. Also printed: the largest
difference between the two outputs (bf16 rounding: ~1e-2 at most).

  python bench/paged_attention.py [--rows 1,8,64] [--context 1024,4096,16384]
  TRITON_INTERPRET=1 python bench/paged_attention.py --tiny   # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from torchtitan_grpo.server.engine.paged_attention import paged_decode, splits, _sm_count  # noqa: E402

BS = 16


def gather_sdpa(q, k, v, table, pos, scale):
    """What PagedBatch did before the kernel: the rows' blocks copied out, SDPA with a length mask."""
    b, nb = table.shape
    n_kv, hd = k.shape[2], k.shape[3]
    width = nb * BS
    keys, values = k[table].view(b, width, n_kv, hd), v[table].view(b, width, n_kv, hd)
    mask = (torch.arange(width, device=q.device)[None] <= pos[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(q.view(b, n_kv, -1, hd), keys.transpose(1, 2), values.transpose(1, 2),
                                       attn_mask=mask, scale=scale)
    return o.reshape(b, -1, hd)


def timed(fn, reps: int) -> float:
    """Seconds per call (CUDA events; wall clock on a CPU)."""
    fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--context", default="1024,4096,16384")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="small shapes (the CPU interpreter)")
    args = ap.parse_args()
    dev = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    heads, n_kv, hd = (8, 2, 32) if args.tiny else (32, 8, 128)
    if dev.type == "cuda":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from paged_speed import bandwidth

        bw, name = bandwidth(), torch.cuda.get_device_name()
    else:
        bw, name = float("nan"), "cpu"
    print(f"device {name}, HBM {bw / 1e12:.2f} TB/s, {heads} heads / {n_kv} KV heads x {hd}, bf16")
    print("| rows | context | splits | kernel us | kernel GB/s | % HBM | gather+SDPA us | GB/s | % HBM | max diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for rows in [int(x) for x in args.rows.split(",")]:
        for ctx in [int(x) for x in args.context.split(",")]:
            print("| " + " | ".join(str(c) for c in row(rows, ctx, heads, n_kv, hd, dev, g, bw, args.reps)) + " |",
                  flush=True)


def row(rows: int, ctx: int, heads: int, n_kv: int, hd: int, dev: torch.device, g: torch.Generator, bw: float,
        reps: int) -> list:
    """One table row: ``rows`` sequences at ``ctx`` positions (the pool is freed on return)."""
    nb = -(-ctx // BS)
    blocks = rows * nb + 1
    k = torch.randn((blocks, BS, n_kv, hd), dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    table = (torch.randperm(blocks - 1, generator=g) + 1).view(rows, nb).to(dev)
    pos = torch.full((rows,), ctx - 1, device=dev)
    q = torch.randn((rows, heads, hd), dtype=k.dtype, device=dev)
    scale = hd**-0.5
    kv_bytes = 2 * rows * ctx * n_kv * hd * k.element_size()
    t_kernel = timed(lambda: paged_decode(q, k, v, table, pos, scale), reps)
    t_ref = timed(lambda: gather_sdpa(q, k, v, table, pos, scale), reps)
    diff = (paged_decode(q, k, v, table, pos, scale).float() - gather_sdpa(q, k, v, table, pos, scale).float())
    cells = [rows, ctx, splits(rows, n_kv, nb * BS, _sm_count(dev))[0]]
    for t in (t_kernel, t_ref):
        cells += [f"{t * 1e6:.0f}", f"{kv_bytes / t / 1e9:.0f}", f"{100 * kv_bytes / t / bw:.0f}"]
    return cells + [f"{diff.abs().max().item():.1e}"]

if __name__ == "__main__":
    main()
