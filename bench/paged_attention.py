"""One layer's decode attention over the paged KV cache: the triton kernel
(``torchtitan_grpo/server/engine/paged_attention.py``) against the gather + SDPA
path it replaces, in GB/s of K and V read and % of the HBM bandwidth.

Each row: ``rows`` sequences, every one at ``context`` positions, Qwen3-4B's
attention shape (32 query heads, 8 KV heads, head_dim 128, bf16), blocks of
16 positions scattered at random through the pool. Also printed: the largest
difference between the two outputs (bf16 rounding: ~1e-2 at most).

  python bench/paged_attention.py [--rows 1,8,64] [--context 1024,4096,16384]
  TRITON_INTERPRET=1 python bench/paged_attention.py --tiny   # CPU smoke run

``--sweep`` (issue 50) times the kernel's launch tunings (``paged_attention.Tuning``:
tile, warps, stages, launch order, split policy) at the engine's decode shapes
instead: ``--layout slot`` is the static cache (one block of the step's width
per row, the rows' positions contiguous), ``paged`` blocks of 16. ``--layers``
distinct caches are read in turn from one CUDA graph (as a step reads its
layers: no layer's KV is still in L2), device time, median of ``--reps``
replays. Prints each shape's default and best tunings and one table: every
tuning's time over the best at each shape, the default first, the tunings
best over all shapes (geometric mean) next.

  python bench/paged_attention.py --sweep --rows 64,256 --context 192,640,1100 [--layout slot,paged]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import itertools  # noqa: E402
import math  # noqa: E402

from torchtitan_grpo.server.engine.paged_attention import DEFAULT, Tuning, paged_decode, splits, _sm_count  # noqa: E402

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
    ap.add_argument("--sweep", action="store_true", help="time the launch tunings at the engine's shapes")
    ap.add_argument("--layout", default="slot,paged", help="--sweep: slot (static cache) and/or paged")
    ap.add_argument("--layers", type=int, default=8, help="--sweep: distinct caches read in turn")
    args = ap.parse_args()
    if args.sweep:
        sweep(args)
        return
    dev = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    heads, n_kv, hd = (8, 2, 32) if args.tiny else (32, 8, 128)
    if dev.type == "cuda":
        from bench.paged_speed import bandwidth

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

def tunings(tiny: bool) -> list[Tuning]:
    """The default first, then every combination the sweep tries."""
    grid = itertools.product((32, 64) if tiny else (32, 64, 128), (64, 256) if tiny else (64, 128, 256),
                             (16,) if tiny else (8, 16, 32),
                             ((4, 2),) if tiny else ((4, 2), (4, 3), (2, 2), (8, 2)), (False, True))
    out = [DEFAULT]
    for tile, min_split, pps, (warps, stages), head_first in grid:
        t = Tuning(tile=tile, min_split=max(min_split, tile), programs_per_sm=pps, num_warps=warps,
                   num_stages=stages, head_first=head_first)
        if t not in out:
            out.append(t)
    return out


def label(t: Tuning) -> str:
    return (f"tile {t.tile}, split >= {t.min_split}, {t.programs_per_sm}/SM, w{t.num_warps}/s{t.num_stages}"
            + (", heads first" if t.head_first else ""))


def _len_bucket(n: int) -> int:
    # The static batch's width for a longest row of n positions (server/engine/static_batch.py).
    step = 64 if n <= 512 else 256
    return -(-n // step) * step


def _caches(layout: str, rows: int, ctx: int, layers: int, heads: int, n_kv: int, hd: int, dev: torch.device,
            g: torch.Generator):
    """``layers`` distinct (k, v, table, width) at ``ctx`` positions a row, as the engine lays them out."""
    out = []
    for _ in range(layers):
        if layout == "slot":  # [slots, max_len, ...]: one block of the step's width per row
            width = _len_bucket(ctx)
            k = torch.randn((rows, width, n_kv, hd), dtype=torch.bfloat16, device=dev)
            table = torch.arange(rows, device=dev)[:, None]
        else:
            nb = -(-ctx // BS)
            width = nb * BS
            k = torch.randn((rows * nb + 1, BS, n_kv, hd), dtype=torch.bfloat16, device=dev)
            table = (torch.randperm(rows * nb, generator=g) + 1).view(rows, nb).to(dev)
        out.append((k, torch.randn_like(k), table, width))
    return out


def _per_call_us(calls, reps: int) -> float:
    """Median device microseconds of one of ``calls``, all replayed from one CUDA graph
    (``bench/decode_gemm.py``'s harness); wall clock of one pass over them on a CPU."""
    if not torch.cuda.is_available():
        for c in calls:
            c()
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) * 1e6 / len(calls)
    from bench.decode_gemm import graph_us

    return graph_us(lambda i: calls[i](), len(calls), reps)


def sweep(args: argparse.Namespace) -> None:
    dev = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    heads, n_kv, hd = (8, 2, 32) if args.tiny else (32, 8, 128)
    bw = float("nan")
    if dev.type == "cuda":
        from bench.paged_speed import bandwidth

        bw = bandwidth()
    cands = tunings(args.tiny)
    g = torch.Generator().manual_seed(0)
    shapes, times = [], []  # times[shape][tuning] in µs (inf: the tuning failed there)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, torch {torch.__version__}; "
          f"{heads} heads / {n_kv} KV heads x {hd}, bf16, {args.layers} layers a pass, {len(cands)} tunings\n")
    for layout in args.layout.split(","):
        for rows in [int(x) for x in args.rows.split(",")]:
            for ctx in [int(x) for x in args.context.split(",")]:
                caches = _caches(layout, rows, ctx, args.layers, heads, n_kv, hd, dev, g)
                q = torch.randn((rows, heads, hd), dtype=torch.bfloat16, device=dev)
                pos = torch.full((rows,), ctx - 1, device=dev)
                want = paged_decode(q, *caches[0][:2], caches[0][2], pos, hd**-0.5, caches[0][3]).float()
                row = []
                for t in cands:
                    try:
                        got = paged_decode(q, *caches[0][:2], caches[0][2], pos, hd**-0.5, caches[0][3], t).float()
                        if (got - want).abs().max().item() > 2e-2:
                            raise AssertionError(f"output differs by {(got - want).abs().max().item():.2e}")
                        calls = [lambda c=c, t=t: paged_decode(q, c[0], c[1], c[2], pos, hd**-0.5, c[3], t)
                                 for c in caches]
                        row.append(_per_call_us(calls, args.reps))
                    except Exception as e:  # noqa: BLE001 - a tuning this GPU cannot run: say so, go on
                        print(f"  ({layout} {rows}x{ctx} {label(t)}: {type(e).__name__}: {str(e)[:120]})",
                              file=sys.stderr)
                        row.append(math.inf)
                kv_bytes = 2 * rows * ctx * n_kv * hd * 2
                best = min(range(len(cands)), key=row.__getitem__)
                n_split = splits(rows, n_kv, caches[0][3], _sm_count(dev), cands[best])[0]
                def pct(us: float) -> str:
                    return f"{100 * kv_bytes / (us * 1e-6) / bw:.0f} % HBM"

                print(f"{layout} {rows} x {ctx}: default {row[0]:.1f} us ({pct(row[0])}); best {row[best]:.1f} us "
                      f"({pct(row[best])}, {n_split} splits): {label(cands[best])}", flush=True)
                shapes.append(f"{layout} {rows}x{ctx}")
                times.append(row)
                del caches
    rel = [[r[i] / min(r) for r in times] for i in range(len(cands))]
    gmean = [math.exp(sum(math.log(x) for x in r) / len(r)) for r in rel]
    order = [0] + sorted(range(1, len(cands)), key=gmean.__getitem__)[:12]
    print("\n| tuning | geo. mean | " + " | ".join(shapes) + " |")
    print("| --- | ---: |" + " ---: |" * len(shapes))
    for i in order:
        print(f"| {'default: ' if i == 0 else ''}{label(cands[i])} | {gmean[i]:.3f} | "
              + " | ".join(f"{x:.3f}" for x in rel[i]) + " |")
    print("\ntime over the best tuning at that shape; the default first, then the 12 best by geometric mean")


if __name__ == "__main__":
    main()
