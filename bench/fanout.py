"""Per version: the trainer's own send time and the time until the last
replica serves, per fan-out (``weight_sync.fanout``), for 1..N replicas.

    python bench/fanout.py [--sets 4B,8B] [--replicas 1,2,3] [--reps 3] [--bucket-mb 1024]
    python bench/fanout.py --cpu        # gloo, a tiny set, 1-2 replicas (what the tests run)

The trainer is this process (cuda:0, or CPU with ``--cpu``); replica k is a
process of its own (cuda:k) serving the built-in server's real weight routes
over a stand-in model (``weight_push_parts.TensorEngine``: real HF names and
shapes of TorchTitan's qwen3 flavor, bf16, the same checks and installs).
Both fan-outs run in the same run over the same replica processes:

* ``per_replica``: a weight group per replica, the trainer sends every byte
  once per replica (concurrently, one thread and stream each);
* ``broadcast``: one group over the trainer and all replicas, each bucket
  sent once (``weight_sync/fanout.py``).

Per version (``Pusher.push(wait=True)``, sync mode): ``trainer s``, from the
trainer's first broadcast call of the version to the return of its last
(the last waits for completion on the host), ``last serves s``, the push's
wall time (every replica has loaded the version), and ``trainer GB``, the
bytes the trainer's broadcasts carried (counted, not estimated). The first
version of each configuration is a warm-up (communicators form); the median
of ``--reps`` after it is printed.
"""

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torchtitan_grpo  # noqa: E402,F401  (triton shim before torchtitan)
from torchtitan_grpo.aio import LoopThread  # noqa: E402
from torchtitan_grpo.weight_sync import group as group_mod  # noqa: E402
from torchtitan_grpo.weight_sync.pusher import Pusher, PushConfig  # noqa: E402

FANOUTS = ("per_replica", "broadcast")


# ------------------------------------------------------------------- replicas


def _replica_main(flavor: str, device: str) -> None:
    """A replica process: zeros of the set's shapes behind the real routes; prints its URL."""
    import asyncio

    from weight_push import qwen3_hf_specs
    from bench.weight_push_parts import TensorEngine, serve_routes

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    params = {s.name: torch.zeros(s.shape, dtype=s.dtype, device=dev) for s in qwen3_hf_specs(flavor)}
    loop = asyncio.new_event_loop()
    engine = TensorEngine(params, dev)
    engine.model.state_dict = lambda keep_vars=False: dict(params)  # what the LoRA routes read at start-up
    engine.model.named_modules = lambda: iter(())
    runner, port = loop.run_until_complete(serve_routes(engine, dev))
    print(f"ready http://127.0.0.1:{port}", flush=True)
    try:
        loop.run_forever()
    finally:
        loop.run_until_complete(runner.cleanup())


def start_replicas(flavor: str, devices: list[str]) -> list[tuple[subprocess.Popen, str]]:
    out = []
    # the repo first, then whatever the caller had (the device scripts' wheels)
    path = os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    for d in devices:
        p = subprocess.Popen([sys.executable, __file__, "--replica", d, "--sets", flavor],
                             stdout=subprocess.PIPE, env=env, text=True)
        line = p.stdout.readline()
        if not line.startswith("ready "):
            p.kill()
            raise RuntimeError(f"replica on {d} did not start: {line!r}")
        out.append((p, line.split()[1]))
    return out


def clear_groups(urls: list[str]) -> None:
    """Destroy the weight groups an earlier pusher left on the replicas (a new
    one joins under the same names)."""
    import requests

    for u in urls:
        for name in ["weight_update_group"] + [f"grpo_fanout_{g}" for g in range(1, 9)]:
            try:
                requests.post(u + "/destroy_weights_update_group", json={"group_name": name}, timeout=60)
            except requests.RequestException:
                pass


# ------------------------------------------------------------- the trainer's side


class SendClock:
    """The trainer's broadcasts (rank 0): first call's start, last return, bytes."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()
        for attr in ("broadcast", "post_broadcast"):
            orig = getattr(group_mod.WeightGroup, attr)

            def timed(group, tensor, *a, _orig=orig, **k):
                t0 = time.perf_counter()
                out = _orig(group, tensor, *a, **k)
                if group.rank == 0:
                    with self.lock:
                        self.first = min(self.first, t0)
                        self.last = max(self.last, time.perf_counter())
                        self.bytes += tensor.numel() * tensor.element_size()
                return out

            setattr(group_mod.WeightGroup, attr, timed)

    def reset(self) -> None:
        self.first, self.last, self.bytes = float("inf"), 0.0, 0


def measure(flavor: str, fanout: str, urls: list[str], device: torch.device, backend: str, bucket_mb: int,
            reps: int, clock: SendClock) -> dict:
    from weight_push import qwen3_hf_specs

    import requests

    specs = qwen3_hf_specs(flavor)
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {s.name: torch.randn(s.shape, generator=g, device=device).to(torch.bfloat16) for s in specs}
    clear_groups(urls)
    loop = LoopThread()
    cfg = PushConfig(mode="sync", backend=backend, bucket_bytes=bucket_mb << 20, num_staging_buffers=1,
                     deadline_s=300, init_timeout_s=120, fanout=fanout)
    pusher = Pusher(loop, urls, cfg, device)
    trainer, serves, sent = [], [], []
    try:
        pusher.connect(initial_version=0)
        for v in range(1, reps + 2):
            clock.reset()
            t0 = time.perf_counter()
            pusher.push(tensors, version=v)
            wall = time.perf_counter() - t0
            if v > 1:  # the first forms the communicators
                trainer.append(clock.last - clock.first)
                serves.append(wall)
                sent.append(clock.bytes)
        versions = {requests.get(u + "/model_info", timeout=30).json()["weight_version"] for u in urls}
        check = "ok" if versions == {str(reps + 1)} else f"served {sorted(versions)}"
    finally:
        pusher.close()
        loop.close()
        del tensors
    return {"set": flavor, "fanout": fanout, "replicas": len(urls), "GB": statistics.median(sent) / 1e9,
            "trainer_s": statistics.median(trainer), "serves_s": statistics.median(serves), "check": check}


def print_table(rows: list[dict], devices: str, reps: int) -> None:
    print(f"\nfan-out per version ({devices}; median of {reps} after a warm-up)")
    print("| set | fanout | replicas | trainer GB | trainer s | last serves s | trainer / 1 replica "
          "| last serves / 1 replica | check |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = {(r["set"], r["fanout"]): r for r in rows if r["replicas"] == 1}
    for r in rows:
        b = base.get((r["set"], r["fanout"]))
        rt = f"{r['trainer_s'] / b['trainer_s']:.2f}" if b and b["trainer_s"] > 0 else "-"
        rs = f"{r['serves_s'] / b['serves_s']:.2f}" if b and b["serves_s"] > 0 else "-"
        print(f"| {r['set']} | {r['fanout']} | {r['replicas']} | {r['GB']:.3f} | {r['trainer_s']:.4f} "
              f"| {r['serves_s']:.4f} | {rt} | {rs} | {r['check']} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU, a tiny set, 1-2 replicas (tests)")
    ap.add_argument("--sets", default=None, help="qwen3 flavors (GPU: 4B,8B; --cpu: debugmodel)")
    ap.add_argument("--replicas", default=None, help="replica counts (GPU: 1,2,3; --cpu: 1,2)")
    ap.add_argument("--bucket-mb", type=int, default=None, help="bucket size in MiB (GPU: 1024; --cpu: 1)")
    ap.add_argument("--reps", type=int, default=3, help="timed versions per configuration (after one warm-up)")
    ap.add_argument("--replica", default=None, help=argparse.SUPPRESS)  # a replica process on this device
    args = ap.parse_args(argv)
    if args.replica:
        return _replica_main(args.sets, args.replica)
    sets = (args.sets or ("debugmodel" if args.cpu else "4B,8B")).split(",")
    counts = [int(x) for x in (args.replicas or ("1,2" if args.cpu else "1,2,3")).split(",")]
    bucket_mb = args.bucket_mb or (1 if args.cpu else 1024)
    if args.cpu:
        device, backend, devs = torch.device("cpu"), "gloo", ["cpu"] * max(counts)
        devices = f"cpu -> cpu x {max(counts)} processes, gloo, torch {torch.__version__}"
    else:
        if torch.cuda.device_count() < 1 + max(counts):
            sys.exit(f"needs {1 + max(counts)} GPUs (found {torch.cuda.device_count()}); use --cpu")
        device, backend, devs = torch.device("cuda", 0), "nccl", [f"cuda:{k}" for k in range(1, 1 + max(counts))]
        torch.cuda.set_device(device)
        devices = (f"{torch.cuda.get_device_name(0)}: trainer cuda:0 -> replicas cuda:1..{max(counts)}, nccl, "
                   f"torch {torch.__version__}")
    clock = SendClock()
    rows = []
    for flavor in sets:
        replicas = start_replicas(flavor, devs)
        try:
            urls = [u for _, u in replicas]
            for fanout in FANOUTS:
                for n in counts:
                    rows.append(measure(flavor, fanout, urls[:n], device, backend, bucket_mb, args.reps, clock))
                    print(rows[-1], flush=True)
        finally:
            for p, _ in replicas:
                p.terminate()
                p.wait(timeout=60)
    print_table(rows, devices, args.reps)
    bad = [f"{r['set']}/{r['fanout']}/{r['replicas']}: {r['check']}" for r in rows if r["check"] != "ok"]
    if bad:
        sys.exit(f"replicas did not serve the last version: {bad}")


if __name__ == "__main__":
    main()
