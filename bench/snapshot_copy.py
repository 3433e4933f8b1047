"""What the trainer's step pays for an async push: the staging copy.

    python bench/snapshot_copy.py          # cuda:0, qwen3 0.6B (fp32, and fp32 cast to bf16) and 8B (bf16)
    python bench/snapshot_copy.py --cpu    # a tiny set on CPU (tests, CI)

``Pusher._stage`` copies every tensor into the staging buffers: small tensors
with one ``torch._foreach_copy_`` per bucket, tensors of ``large`` bytes or
more with a copy each (``PushConfig.large_tensor_bytes``). Rows, measured in the
same run on the same tensors:

* ``per-tensor loop``: the copy before this benchmark existed (one Python-level
  slice + ``copy_`` per tensor, ``buckets.pack`` or its cast variant);
* ``large = X``: ``Pusher._stage`` with that threshold; ``0`` copies every
  tensor on its own, ``inf`` puts every one in the foreach copy.

``host ms``: until ``_stage`` returns (what the trainer's thread waits);
``device ms``: CUDA events around it (the copy's time on the trainer's
stream, which the next step's kernels queue behind). Median of ``--reps``
after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from torchtitan_grpo.weight_sync import buckets as bk  # noqa: E402
from torchtitan_grpo.weight_sync.pusher import PushConfig, Pusher  # noqa: E402

THRESHOLDS = {"0": 0, "16 MiB": 16 << 20, "64 MiB": 64 << 20, "inf": 1 << 62}


def old_loop(plan, bufs, tensors, cast) -> None:
    """The staging copy as Pusher.push did it up to e9a4d35."""
    for bucket, buf in zip(plan, bufs):
        if cast is None:
            bk.pack([tensors[s.name] for s in bucket], out=buf)
        else:
            pos = 0
            for spec in bucket:
                buf[pos : pos + spec.nbytes].view(spec.dtype).view(spec.shape).copy_(tensors[spec.name])
                pos += spec.nbytes


def timed(fn, dev: torch.device, reps: int) -> tuple[float, float]:
    host, device = [], []
    for _ in range(reps + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        if dev.type == "cuda":
            b.record()
            torch.cuda.synchronize(dev)
            device.append(a.elapsed_time(b) / 1e3)
        else:
            device.append(host[-1])
    return statistics.median(host[1:]) * 1e3, statistics.median(device[1:]) * 1e3


def measure(name: str, specs: list[bk.TensorSpec], cast: torch.dtype | None, dev: torch.device,
            reps: int, bucket_mb: int) -> list[list[str]]:
    g = torch.Generator(device=dev).manual_seed(0)
    tensors = {s.name: torch.randn(s.shape, dtype=s.dtype, device=dev, generator=g) for s in specs}
    pushed = [bk.TensorSpec(s.name, cast or s.dtype, s.shape) for s in specs]
    plan = bk.plan_buckets(pushed, bucket_mb << 20)
    gb = sum(s.nbytes for s in specs) / 1e9
    label = f"{name} {bk.dtype_name(specs[0].dtype)}" + (f"->{bk.dtype_name(cast)}" if cast else "")
    rows = []
    bufs = [torch.empty(bk.packed_nbytes(b), dtype=torch.uint8, device=dev) for b in plan]
    h, d = timed(lambda: old_loop(plan, bufs, tensors, cast), dev, reps)
    rows.append([label, str(len(specs)), f"{gb:.2f}", "per-tensor loop", f"{h:.2f}", f"{d:.2f}"])
    expected = [b.clone() for b in bufs]
    del bufs
    for tname, large in THRESHOLDS.items():
        p = Pusher(None, [], PushConfig(backend="nccl" if dev.type == "cuda" else "gloo", dtype=cast,
                                        bucket_bytes=bucket_mb << 20, large_tensor_bytes=large), dev)
        p._plan = plan
        staged = p._free_buffer()
        h, d = timed(lambda: p._stage(staged, tensors), dev, reps)
        same = all(torch.equal(a, b) for a, b in zip(staged.buffers, expected))
        rows.append([label, str(len(specs)), f"{gb:.2f}", f"large = {tname}" + ("" if same else " MISMATCH"),
                     f"{h:.2f}", f"{d:.2f}"])
        del staged, p
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="a tiny set on CPU (tests, CI)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=1024, help="weight_sync.bucket_size_mb")
    args = ap.parse_args()
    from weight_push import qwen3_hf_specs

    dev = torch.device("cpu" if args.cpu else "cuda:0")
    if args.cpu:
        torch.set_num_threads(1)
        sets = [("debugmodel", torch.float32, None), ("debugmodel", torch.float32, torch.bfloat16)]
    else:
        sets = [("0.6B", torch.float32, None), ("0.6B", torch.float32, torch.bfloat16), ("8B", torch.bfloat16, None)]
    out = []
    for flavor, dtype, cast in sets:
        specs = [bk.TensorSpec(s.name, dtype, s.shape) for s in qwen3_hf_specs(flavor)]
        rows = measure(flavor, specs, cast, dev, args.reps, args.bucket_mb)
        for row in rows:
            print("row: | " + " | ".join(row) + " |", flush=True)
        out += rows
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    where = "cpu" if args.cpu else f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}"
    print(f"# snapshot copy into {args.bucket_mb} MiB buckets on {where}; median of {args.reps} after 1 warm-up")
    print("| set | tensors | GB | copy | host ms | device ms |")
    print("| --- | ---: | ---: | --- | ---: | ---: |")
    for row in out:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
