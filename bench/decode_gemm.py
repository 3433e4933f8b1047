"""What a decode step's GEMMs cost with each GEMM backend torch offers, at the
engine's own shapes (issue 50: at 64 sequences of the Qwen3-4B shape the GEMMs
are 2.56 ms of a 4.89 ms step, reading the weights at 65 % of HBM bandwidth).

    python bench/decode_gemm.py                           # 4b, 64 and 256 rows
    python bench/decode_gemm.py --shape 0.6b --rows 64
    python bench/decode_gemm.py --backends cublas splitk  # the split-K kernel's sweep beside cuBLAS

The engine's decode GEMMs (``server/engine/static_batch.py``): the fused QKV
projection, the attention output, the fused gate/up projection and the down
projection of every layer, and the LM head. Each is timed with ``rows``
activations against as many distinct weight tensors as the model has layers
(so no weight is read from L2, as in a real step), the calls replayed from one
CUDA graph (device time, no launch cost), median of ``--rounds`` replays.

Backends, each a way the engine could run the same ``F.linear``:
``cublas`` (torch's default, what the engine uses), ``cublaslt``
(``torch.backends.cuda.preferred_blas_library``), ``kn`` (cuBLAS with the
weight stored transposed, ``x @ w_t``: the other memory order), ``triton``
(inductor's max-autotune Triton GEMM templates, compiled per shape; the
autotuning takes a minute or so). Prints one markdown table: microseconds per
GEMM, TB/s of weight bytes read, and the sum over a step against cuBLAS's.

``splitk`` (not in the default list) is ``bench/splitk_gemm.py``'s
split-K Triton kernel, swept per GEMM and row count: block_n 32/64/128 x
block_k 64/128/256 x (warps, stages) 4/3, 4/5, 8/4, each with the split_k
values that give the grid about 1, 2, 4 and 8 programs per SM (none where
split_k x block_k > K; values that cut K the same way once). Tile configs that
need more shared memory than the GPU has (triton allocates num_stages copies
of both tiles) are left out with one stderr line a row count, one that fails
to compile or launch with one line. The cell is the fastest config's time and
the config (``123.4 (3.10) n64 k128 s8 w4/3``: block_n, block_k, split_k,
warps/stages); its output is checked against ``F.linear`` once (the max
difference on stderr, the cell failed beyond twice one bf16 step at the largest
output). split_k does not recompile (a runtime argument): one compile per tile
config, row power of two and output kind (one split writes bf16, several fp32
partials): 58 for the 4b shape at 64 and 256 rows, and 441 timed graphs,
about 2-3 minutes on an H200 if a compile takes 1-2 s. ``--quick`` sweeps one
tile config and two split_k values (a smoke run of the backend; it still needs
a GPU).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import splitk_gemm  # noqa: E402
from bench.splitk_gemm import GemmConfig  # noqa: E402

HBM_TBS = 4.8  # H200
SHAPES = {  # hidden, intermediate, q heads, kv heads, head dim, layers, vocab
    "0.6b": (1024, 3072, 16, 8, 128, 28, 151936),
    "4b": (2560, 9728, 32, 8, 128, 36, 151936),
}


def gemms(shape: str) -> list[tuple[str, int, int, int]]:
    """(name, in features, out features, how many per step)."""
    h, inter, nq, nkv, hd, layers, vocab = SHAPES[shape]
    return [("qkv", h, (nq + 2 * nkv) * hd, layers), ("o", nq * hd, h, layers),
            ("gate_up", h, 2 * inter, layers), ("down", inter, h, layers), ("lm_head", h, vocab, 1)]


def graph_us(call: Callable[[int], torch.Tensor], n: int, rounds: int) -> float:
    """Median microseconds of one call, ``n`` distinct calls replayed from a graph."""
    for k in range(n):  # warm-up outside the graph (kernel selection, compilation)
        call(k)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for k in range(n):
            call(k)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for k in range(n):
            call(k)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(times)


SPLITK_SWEEP = {  # block_n, block_k, (num_warps, num_stages), programs per SM the split_k values aim at
    "full": ((32, 64, 128), (64, 128, 256), ((4, 3), (4, 5), (8, 4)), (1, 2, 4, 8)),
    "quick": ((64,), (128,), ((4, 3),), (2, 8)),
}


def config_label(cfg: GemmConfig) -> str:
    return f"n{cfg.block_n} k{cfg.block_k} s{cfg.split_k} w{cfg.num_warps}/{cfg.num_stages}"


def tile_smem(rows: int, block_n: int, block_k: int, stages: int) -> int:
    """Shared memory of one program in bytes: triton 3.9's K-loop pipeline keeps ``stages``
    bf16 copies of the x and the weight tile, and nothing else (its sm_90 output, read for
    every tile config of the sweep)."""
    return stages * (max(16, 1 << (rows - 1).bit_length()) + block_n) * block_k * 2


def splitk_configs(rows: int, n: int, k: int, sms: int, smem: int, sweep: str) -> list[GemmConfig]:
    """The sweep's configs for one GEMM, tile configs that cannot fit in ``smem`` left out."""
    out = []
    bns, bks, ws, per_sm = SPLITK_SWEEP[sweep]
    for bn, bk, (warps, stages) in itertools.product(bns, bks, ws):
        if tile_smem(rows, bn, bk, stages) > smem:
            continue
        seen = set()
        for t in per_sm:
            s = max(1, round(t * sms / -(-n // bn)))
            cfg = GemmConfig(bn, bk, s, warps, stages)
            cut = splitk_gemm.splits(k, cfg)[0]  # split_k values past K's steps cut it the same way
            if s * bk <= k and cut not in seen:
                seen.add(cut)
                out.append(cfg)
    return out


class SplitK:
    """The ``splitk`` backend: the sweep, with what it learned across GEMMs of one run."""

    def __init__(self, dev: torch.device, sweep: str):
        props = torch.cuda.get_device_properties(dev)
        self.sms = props.multi_processor_count
        self.smem = getattr(props, "shared_memory_per_block_optin", 227 * 1024)  # H100/H200's
        self.sweep = sweep
        self.failed: set[tuple[int, int, int, int, int]] = set()  # (rows, bn, bk, warps, stages)
        self.told: set[int] = set()  # row counts whose left-out tile configs were said

    def run(self, name: str, x: torch.Tensor, weights: list[torch.Tensor], rounds: int) -> tuple[float, str]:
        if not splitk_gemm.available(x.device):
            raise RuntimeError("splitk_gemm is off here (no triton, or TORCHTITAN_GRPO_SKINNY_GEMM=0)")
        rows, k = x.shape
        n = weights[0].shape[0]
        if rows not in self.told:
            self.told.add(rows)
            bns, bks, ws, _ = SPLITK_SWEEP[self.sweep]
            big = [f"n{bn} k{bk} w{w}/{s}" for bn, bk, (w, s) in itertools.product(bns, bks, ws)
                   if tile_smem(rows, bn, bk, s) > self.smem]
            if big:
                print(f"  (splitk at {rows} rows: {len(big)} tile configs need more than the GPU's "
                      f"{self.smem // 1024} KB of shared memory, left out: {', '.join(big)})", file=sys.stderr)
        start = time.perf_counter()
        best: tuple[float, GemmConfig] | None = None
        timed = 0
        for cfg in splitk_configs(rows, n, k, self.sms, self.smem, self.sweep):
            tile = (rows, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)
            if tile in self.failed:
                continue
            try:
                us = graph_us(lambda i: splitk_gemm.linear(x, weights[i], cfg), len(weights), rounds)
            except Exception as e:  # out of shared memory or registers, a compile error: the others still run
                self.failed.add(tile)
                print(f"  (splitk on {name} at {rows} rows: {config_label(cfg)} skipped: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:160] if str(e) else ''})", file=sys.stderr)
                continue
            timed += 1
            if best is None or us < best[0]:
                best = (us, cfg)
        if best is None:
            raise RuntimeError("no config ran")
        us, cfg = best
        ref = F.linear(x, weights[0]).float()
        diff = (splitk_gemm.linear(x, weights[0], cfg).float() - ref).abs().max().item()
        tol = 2 * 2**-7 * ref.abs().max().item()  # two bf16 steps at the largest output: two roundings
        print(f"  (splitk on {name} at {rows} rows: {timed} configs in {time.perf_counter() - start:.1f} s; "
              f"best {config_label(cfg)}, max |diff| {diff:.3g} against F.linear, tolerance {tol:.3g})",
              file=sys.stderr)
        if not diff <= tol:
            raise RuntimeError(f"{config_label(cfg)} differs from F.linear by {diff:.3g}")
        return us, config_label(cfg)


def run_backend(backend: str, x: torch.Tensor, weights: list[torch.Tensor], rounds: int) -> float:
    if backend == "kn":
        wts = [w.t().contiguous() for w in weights]
        return graph_us(lambda k: torch.mm(x, wts[k]), len(wts), rounds)
    if backend == "triton":
        import torch._inductor.config as icfg

        icfg.max_autotune_gemm_backends = "TRITON"
        # A fresh compile per shape: past dynamo's recompile limit (8) one function falls back to
        # eager, i.e. to cuBLAS (run 146's last two shapes at 256 rows).
        torch.compiler.reset()
        f = torch.compile(lambda a, w: F.linear(a, w), mode="max-autotune-no-cudagraphs", dynamic=False)
        return graph_us(lambda k: f(x, weights[k]), len(weights), rounds)
    torch.backends.cuda.preferred_blas_library("cublaslt" if backend == "cublaslt" else "cublas")
    try:
        return graph_us(lambda k: F.linear(x, weights[k]), len(weights), rounds)
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="4b")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--backends", nargs="+", default=["cublas", "cublaslt", "kn", "triton"],
                    choices=["cublas", "cublaslt", "kn", "triton", "splitk"])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="splitk: one tile config and two split_k values")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("decode_gemm: needs a CUDA GPU (the timings are device time from a CUDA graph)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev = torch.device("cuda")
    splitk = SplitK(dev, "quick" if args.quick else "full") if "splitk" in args.backends else None
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}; Qwen3-{args.shape} decode GEMMs, bf16, weights distinct per layer; "
          f"us per GEMM (TB/s of weight bytes)\n")
    print("| rows | gemm | in x out | MB | " + " | ".join(args.backends) + " |")
    print("| --- | --- | --- | ---: |" + " ---: |" * len(args.backends))
    for rows in args.rows:
        step = {b: 0.0 for b in args.backends}
        step_mb = 0.0
        for name, k_in, n_out, count in gemms(args.shape):
            weights = [torch.randn(n_out, k_in, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(count)]
            x = torch.randn(rows, k_in, device=dev, dtype=torch.bfloat16)
            mb = n_out * k_in * 2 / 1e6
            cells = []
            for b in args.backends:
                note = ""
                try:
                    if b == "splitk":
                        us, note = splitk.run(name, x, weights, args.rounds)
                    else:
                        us = run_backend(b, x, weights, args.rounds)
                except Exception as e:  # a backend this build lacks: say so, keep the others
                    cells.append(f"failed: {type(e).__name__}")
                    step[b] = float("nan")
                    print(f"  ({b} on {name}: {str(e).splitlines()[0][:160]})", file=sys.stderr)
                    continue
                step[b] += us * count
                cells.append(f"{us:,.1f} ({mb / us:.2f})" + (f" {note}" if note else ""))
            step_mb += mb * count
            print(f"| {rows} | {name} | {k_in} x {n_out} | {mb:,.1f} | " + " | ".join(cells) + " |", flush=True)
            del weights
            torch.cuda.empty_cache()
        base = step[args.backends[0]]
        cells = [f"{v / 1e3:.3f} ms ({step_mb / v:.2f} TB/s, {base / v:.2f} x)" for v in step.values()]
        print(f"| {rows} | **a step** | | {step_mb:,.0f} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nroofline: {HBM_TBS} TB/s; x = the first backend's step time over this one's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
