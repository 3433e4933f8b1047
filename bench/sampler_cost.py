"""What the sampler's inverse-CDF draw costs per decode step, in one run: the
one-level draw it made before (a cumsum over [rows, vocab] and a searchsorted)
against ``sampling._inverse_cdf`` (block masses, then a scan over the blocks
and one over the chosen block), from the same fp32 probabilities and uniforms.

    python bench/sampler_cost.py                 # CPU, and the GPU when there is one
    python bench/sampler_cost.py --rows 64 256 --vocab 151936 --reps 50

Each row of the table is the median over ``--rounds`` rounds of the mean of
``--reps`` calls, the two draws alternating round by round so drift of the
machine hits both alike. On CPU: wall time. On CUDA, two figures: ``eager``
(a synchronised loop of plain calls: the host's launches included, as the
engine pays them) and ``graph`` (the same calls replayed from a CUDA graph:
device time only, the figure to hold against a profile's kernel times).
``old≠fp64`` and ``new≠fp64`` count the rows whose token differs from the
draw on a float64 cumsum (fp32 rounding near a boundary: a few per thousand
rows at this vocabulary; CPU's cumsum accumulates in float64, CUDA's in fp32
over the whole row). Prints one markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan_grpo.server.engine.sampling import _inverse_cdf  # noqa: E402

Draw = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def full_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The draw before ``_inverse_cdf``: one cumsum over the whole vocabulary."""
    cdf = probs.cumsum(dim=-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def per_call_us(draw: Draw, probs: torch.Tensor, u: torch.Tensor, reps: int, graph: bool) -> float:
    """Mean microseconds of one call over ``reps`` calls."""
    cuda = probs.device.type == "cuda"
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                draw(probs, u)
        run = g.replay
    else:
        def run() -> None:
            for _ in range(reps):
                draw(probs, u)
    run()  # warm-up (allocator, kernel loading)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="CPU only, even with a GPU")
    args = ap.parse_args()

    devices = [torch.device("cpu")]
    if torch.cuda.is_available() and not args.cpu:
        devices.append(torch.device("cuda"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
          + (f", {torch.cuda.get_device_name()}" if len(devices) > 1 else ""))
    print()
    print("| device | timing | rows | vocab | full cumsum µs | two-level µs | speed-up | old≠fp64 | new≠fp64 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for dev in devices:
        modes = ["wall"] if dev.type == "cpu" else ["eager", "graph"]
        for rows in args.rows:
            g = torch.Generator().manual_seed(rows)
            probs = torch.softmax(torch.randn(rows, args.vocab, generator=g) * 2, dim=-1).to(dev)
            u = torch.rand(rows, generator=g).to(dev)
            exact = full_cdf(probs.double(), u.double())
            off = {name: int((draw(probs, u) != exact).sum()) for name, draw in (("old", full_cdf), ("new", _inverse_cdf))}
            for mode in modes:
                times: dict[str, list[float]] = {"old": [], "new": []}
                for _ in range(args.rounds):
                    for name, draw in (("old", full_cdf), ("new", _inverse_cdf)):
                        times[name].append(per_call_us(draw, probs, u, args.reps, mode == "graph"))
                old, new = statistics.median(times["old"]), statistics.median(times["new"])
                print(f"| {dev.type} | {mode} | {rows} | {args.vocab} | {old:.1f} | {new:.1f} | {old / new:.1f}x | {off['old']} | {off['new']} |")


if __name__ == "__main__":
    main()
