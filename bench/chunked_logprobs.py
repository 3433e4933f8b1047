"""Peak memory and time of the trainer's per-token log-probs: full logits vs chunks.

    python bench/chunked_logprobs.py                    # CPU: T=4096, V=32768, dim 512, float32
    python bench/chunked_logprobs.py --device cuda --tokens 16384 --vocab 151936 --dim 4096 --dtype bfloat16

One forward + backward of ``sum(logprobs * g)`` plus the entropy metric, from
``[tokens, dim]`` hidden states and a ``[V, dim]`` output weight, per row:

* ``full``: what the trainer did before ``grpo.logprob_chunk_tokens``: logits
  ``h @ W^T``, upcast to float32, ``loss.token_logprobs`` and
  ``loss.entropy_from_logits`` (the baseline, measured in the same run);
* ``chunk N``: :func:`torchtitan_grpo.train.token_logprobs.chunked_logprobs`;
* ``cce`` (``--cce``): cut-cross-entropy's Triton kernel, per-token loss,
  exact backward (``filter_eps=None``), no entropy: for comparison only.

``peak MiB`` is memory above what the inputs already hold: on CUDA
``max_memory_allocated``, on CPU the process's peak RSS (VmHWM, reset through
``/proc/self/clear_refs``; each row runs in a fresh process so allocator
caches do not carry over). ``ms`` is the median of ``--reps`` after a warm-up
(CPU: one run, no warm-up). ``max |dlp|``: largest difference from the
``full`` row's log-probs; ``dgrad rel``: largest difference from its weight
gradient over that gradient's largest entry.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss_peak_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rss_now_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _step(mode: int, h, w, targets, g, temperature: float):
    from torchtitan_grpo.train import loss as grpo_losses
    from torchtitan_grpo.train.token_logprobs import chunked_logprobs

    h.grad = w.grad = None
    if mode == 0:
        logits = (h @ w.t()).float()
        lp = grpo_losses.token_logprobs(logits, targets, temperature)
        grpo_losses.entropy_from_logits(logits.detach(), torch.ones_like(lp), temperature)
        del logits
    elif mode > 0:
        lp, ent = chunked_logprobs(h, w, targets, temperature, mode, with_entropy=True)
    else:  # cut-cross-entropy's per-token loss (exact backward: filter_eps=None); no entropy
        from cut_cross_entropy import linear_cross_entropy

        scale = 1.0 / temperature if temperature > 0 else 1.0
        lp = -linear_cross_entropy(h * scale, w, targets, reduction="none", filter_eps=None).float()
    (lp * g).sum().backward()
    return lp.detach()


def run_one(args, mode: int) -> dict:
    """One row, in this process."""
    torch.manual_seed(0)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    h = torch.randn(1, args.tokens, args.dim, device=dev, dtype=dtype).requires_grad_()
    w = (torch.randn(args.vocab, args.dim, device=dev, dtype=dtype) / args.dim**0.5).requires_grad_()
    targets = torch.randint(0, args.vocab, (1, args.tokens), device=dev)
    g = torch.randn(1, args.tokens, device=dev)
    reps = args.reps if dev.type == "cuda" else 1
    times = []
    if dev.type == "cuda":
        _step(mode, h, w, targets, g, args.temperature)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
        base = _rss_now_mib()
    for _ in range(reps):
        t0 = time.perf_counter()
        lp = _step(mode, h, w, targets, g, args.temperature)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    if dev.type == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = _rss_peak_mib() - base
    torch.save({"lp": lp.float().cpu(), "gw": w.grad.float().cpu()}, args.out)
    return {"mode": mode, "peak_mib": peak, "ms": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--chunks", default="1024,4096")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cce", action="store_true", help="add a cut-cross-entropy row (CUDA, needs the package)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args, args.one)))
        return
    modes = [0, *(int(c) for c in args.chunks.split(","))] + ([-1] if args.cce else [])
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:  # a fresh process per row: peak memory of that row only
            path = f"{tmp}/{mode}.pt"
            cmd = [sys.executable, __file__, *sys.argv[1:], "--one", str(mode), "--out", path]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            results.append(torch.load(path))
    print(f"device {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}), "
          f"tokens {args.tokens}, vocab {args.vocab}, dim {args.dim}, {args.dtype}, T={args.temperature}")
    print(f"{'path':>12} {'peak MiB':>10} {'ms':>10} {'max |dlp|':>10} {'dgrad rel':>12}")
    for r, res in zip(rows, results):
        dlp = float((res["lp"] - results[0]["lp"]).abs().max())
        dgw = float((res["gw"] - results[0]["gw"]).abs().max() / results[0]["gw"].abs().max())
        name = {0: "full", -1: "cce"}.get(r["mode"], f"chunk {r['mode']}")
        print(f"{name:>12} {r['peak_mib']:>10.0f} {r['ms']:>10.1f} {dlp:>10.2e} {dgw:>12.2e}")


if __name__ == "__main__":
    main()
