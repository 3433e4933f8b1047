"""What a decode step's GEMMs cost with each GEMM backend torch offers, at the
engine's own shapes (issue 50: at 64 sequences of the Qwen3-4B shape the GEMMs
are 2.56 ms of a 4.89 ms step, reading the weights at 65 % of HBM bandwidth).

    python bench/decode_gemm.py                           # 4b, 64 and 256 rows
    python bench/decode_gemm.py --shape 0.6b --rows 64

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
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

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
    ap.add_argument("--backends", nargs="+", default=["cublas", "cublaslt", "kn", "triton"])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("decode_gemm: needs a CUDA GPU (the timings are device time from a CUDA graph)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev = torch.device("cuda")
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
                try:
                    us = run_backend(b, x, weights, args.rounds)
                except Exception as e:  # a backend this build lacks: say so, keep the others
                    cells.append(f"failed: {type(e).__name__}")
                    step[b] = float("nan")
                    print(f"  ({b} on {name}: {str(e).splitlines()[0][:160]})", file=sys.stderr)
                    continue
                step[b] += us * count
                cells.append(f"{us:,.1f} ({mb / us:.2f})")
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
