"""Weight-push bandwidth against the raw broadcast bandwidth, measured in one run.

    python bench/weight_push.py [--sets 0.6B,4B,8B] [--bucket-mb 256,1024] [--reps 3]
    python bench/weight_push.py --cpu        # gloo, a tiny set (what the tests run)

Two processes: rank 0 on cuda:0 is the trainer side, rank 1 on cuda:1 is one
inference replica (with ``--cpu`` both run on CPU and talk gloo). A weight set
is random bf16 tensors with the HF names and shapes of a TorchTitan qwen3
flavor (the model is built on the meta device and its state-dict adapter
names the tensors, so tied embeddings and every norm are included). For each
set the same bytes go over four paths:

* ``raw``: one flat buffer of the set's size, ``torch.distributed.broadcast``
  on a process group of its own (the baseline: what the fabric gives).
* ``bucketed``: the pusher's data path without the HTTP control plane.
  Rank 0 broadcasts the staging buffers (one per bucket, planned by
  ``buckets.plan_buckets``) with ``WeightGroup.broadcast`` on a side stream,
  as each replica's sender does; rank 1 runs the built-in server's
  ``receive_weights`` for each bucket (flattened: one uint8 broadcast, views
  sliced out) and copies the tensors into its parameters, as
  ``Engine.load_weights`` does.
* ``push``: the whole path a trainer uses, ``Pusher.push(wait=True)``:
  snapshot into staging buffers, then begin / update x buckets / end over
  HTTP and the same broadcasts, to the built-in server's real SGLang routes
  (``SGLangRoutes``) served by rank 1. Only the model behind those routes is
  a stand-in (a dict of parameters of the real names, shapes and dtype, with
  ``Engine.load_weights``' checks and copies): an 8B HF checkpoint would have
  to be written to disk and loaded first, which costs more than the whole
  benchmark. Generation is idle during the push.
* ``snapshot``: the device copy of the weights into the staging buffers
  (``buckets.pack``, as ``Pusher.push`` does): the only cost of an async push
  on the trainer's critical path.

Timing: ``raw``, ``bucketed`` and ``snapshot`` start both ranks from a
barrier and take, per repetition, the slower rank's time to its own
completion (device synchronised); the first repetition is a warm-up and the
median of the others is reported. ``push`` is the wall time of
``push(wait=True)`` on rank 0 (it returns once the replica has loaded the
version), median after one warm-up push. GiB/s = set bytes / time. After
``bucketed`` and ``push`` the replica's parameters are compared with the
trainer's (integer checksums of three tensors and the served version): the
``check`` column says ``ok`` only if the bytes arrived.

Prints one markdown table; rows are printed as they complete (``row:``) so a
run cut short still leaves its numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchtitan_grpo  # noqa: E402,F401  (triton shim before torchtitan)
from torchtitan_grpo.aio import LoopThread  # noqa: E402
from torchtitan_grpo.inference.launcher import free_port  # noqa: E402
from torchtitan_grpo.weight_sync import buckets as bk  # noqa: E402

GPU_SETS = "0.6B,4B,8B"
CPU_SETS = "debugmodel"
GPU_BUCKETS_MB = "256,1024"
CPU_BUCKETS_MB = "4,16"


# ------------------------------------------------------------------ weight sets


def qwen3_hf_specs(flavor: str) -> list[bk.TensorSpec]:
    """HF names and shapes (bf16) of TorchTitan's qwen3 ``flavor``.

    ``flavor`` may end in ``/L<n>`` to keep only ``n`` layers (smaller sets
    of the same shapes).
    """
    from torchtitan.models.qwen3 import qwen3_args
    from torchtitan.protocols.train_spec import get_train_spec

    name, _, layers = flavor.partition("/L")
    args = qwen3_args[name]
    if layers:
        args = dataclasses.replace(args, n_layers=int(layers))
    spec = get_train_spec("qwen3")
    with torch.device("meta"):
        model = spec.model_cls(args)
    adapter = spec.state_dict_adapter(args, None)
    hf = adapter.to_hf(dict(model.state_dict()))
    return [bk.TensorSpec(k, torch.bfloat16, tuple(v.shape)) for k, v in hf.items()]


def checksum(tensors: dict[str, torch.Tensor], names: list[str]) -> list[int]:
    """Exact integer checksums of a few bf16 tensors (no large temporaries)."""
    return [int(tensors[n].view(torch.int16).sum(dtype=torch.int64)) for n in names]


# -------------------------------------------------------------- the replica stand-in


class TensorEngine:
    """What the built-in server's weight-update routes need of an ``Engine``:
    named parameters (real names, shapes, dtype), the same all-or-nothing
    checks and copies as ``Engine.load_weights``, and a served version."""

    def __init__(self, params: dict[str, torch.Tensor], device: torch.device):
        self.device = device
        self._tensors = params
        self.weight_version = "default"
        self.paused = None
        self.alive = True

    def load_weights(self, named, weight_version: str | None = None) -> None:
        from torchtitan_grpo.inference.engine import WeightUpdateError

        for name, t in named:
            target = self._tensors.get(name)
            if target is None or tuple(target.shape) != tuple(t.shape):
                raise WeightUpdateError(f"tensor {name!r} does not fit the model")
        with torch.no_grad():
            for name, t in named:
                self._tensors[name].copy_(t)
        if weight_version is not None:
            self.weight_version = weight_version

    def set_weight_version(self, version: str) -> None:
        self.weight_version = version

    def abort_all(self, message: str = "") -> int:
        return 0

    def num_live_requests(self) -> int:
        return 0


async def _serve_routes(engine: TensorEngine, device: torch.device):
    """The built-in server's SGLang routes over ``engine`` on a free port."""
    from aiohttp import web

    from torchtitan_grpo.inference.server import SGLangRoutes, ServerConfig

    app = web.Application(client_max_size=512 * 1024 * 1024)
    routes = SGLangRoutes(engine, ServerConfig(model="bench-stand-in", device=str(device), port=0,
                                               weight_group_timeout_s=120))
    routes.register(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, routes, runner.addresses[0][1]


# ----------------------------------------------------------------- measurement


class Ranks:
    """Rank-local state and the lock-step helpers of the two processes."""

    def __init__(self, rank: int, device: torch.device, ctrl):
        self.rank, self.device, self.ctrl = rank, device, ctrl

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def share(self, obj=None, src: int = 0):
        """Rank ``src``'s ``obj`` on both ranks (control plane, gloo)."""
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.ctrl)
        return box[0]

    def timed(self, fn, reps: int) -> float:
        """Median over ``reps`` (after one warm-up) of the slower rank's time
        from a common barrier to its own completion of ``fn``."""
        times = []
        for _ in range(reps + 1):
            self.sync()
            dist.barrier(group=self.ctrl)
            t0 = time.perf_counter()
            fn()
            self.sync()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=self.ctrl)
            times.append(float(dt))
        return statistics.median(times[1:])


def _measure_set(r: Ranks, flavor: str, bucket_mbs: list[int], reps: int, backend: str, raw_group,
                 loop: LoopThread | None) -> list[dict]:
    from torchtitan_grpo.inference.engine import receive_weights
    from torchtitan_grpo.weight_sync.group import init_weight_group

    specs = qwen3_hf_specs(flavor)
    nbytes = sum(s.nbytes for s in specs)
    dev = r.device
    names = [specs[0].name, specs[len(specs) // 2].name, specs[-1].name]
    torch.manual_seed(0)
    if r.rank == 0:
        tensors = {s.name: torch.randn(s.shape, dtype=s.dtype, device=dev) for s in specs}
    else:
        tensors = {s.name: torch.zeros(s.shape, dtype=s.dtype, device=dev) for s in specs}
    expected = r.share(checksum(tensors, names) if r.rank == 0 else None)

    # raw: one flat buffer, one broadcast
    flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    t_raw = r.timed(lambda: dist.broadcast(flat, 0, group=raw_group), reps)
    del flat

    rows = []
    for k, mb in enumerate(bucket_mbs):
        plan = bk.plan_buckets(specs, mb << 20)
        row = {"set": flavor, "GB": nbytes / 1e9, "tensors": len(specs), "bucket_mb": mb, "buckets": len(plan),
               "raw": nbytes / t_raw / 2**30}

        # bucketed: staging buffers -> WeightGroup broadcasts -> receive_weights + load copy
        port = r.share(free_port() if r.rank == 0 else None)
        group = init_weight_group("127.0.0.1", port, r.rank, 2, backend=backend, group_name=f"bench{k}",
                                  timeout_s=120, device=dev if backend == "nccl" else None)
        if r.rank == 0:
            staging = [torch.empty(bk.packed_nbytes(b), dtype=torch.uint8, device=dev) for b in plan]
            stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None

            def snapshot():
                for b, buf in zip(plan, staging):
                    bk.pack([tensors[s.name] for s in b], out=buf)

            def send():
                for buf in staging:
                    group.broadcast(buf, src=0, stream=stream)

            t_snap = r.timed(snapshot, reps)
            t_bucketed = r.timed(send, reps)
            del staging
        else:
            def receive():
                with torch.no_grad():
                    for b in plan:
                        for name, t in receive_weights(group, b, flattened=True):
                            tensors[name].copy_(t)

            t_snap = r.timed(lambda: None, reps)
            t_bucketed = r.timed(receive, reps)
        group.close()
        ok_bucketed = r.rank == 0 or checksum(tensors, names) == expected
        if r.rank == 1:
            for t in tensors.values():
                t.zero_()
        row |= {"bucketed": nbytes / t_bucketed / 2**30, "snapshot_ms": t_snap * 1e3}

        # push: Pusher (trainer side) -> HTTP + broadcasts -> the server's SGLang routes
        push_times: list[float] = []
        if r.rank == 0:
            from torchtitan_grpo.weight_sync.pusher import Pusher, PushConfig

            url = r.share(None, src=1)
            pusher = Pusher(loop, [url], PushConfig(mode="sync", backend=backend, bucket_bytes=mb << 20,
                                                    num_staging_buffers=1, deadline_s=300, init_timeout_s=120),
                            device=dev)
            try:
                pusher.connect(initial_version=0)
                for v in range(1, reps + 2):
                    t0 = time.perf_counter()
                    pusher.push(tensors, version=v, wait=True)
                    push_times.append(time.perf_counter() - t0)
            finally:
                pusher.close()
                del pusher
                gc.collect()  # its staging buffers (cyclic references through its tasks)
            dist.barrier(group=r.ctrl)
            ok_push = True  # judged by the replica
        else:
            holder = LoopThread("bench-replica")
            engine = TensorEngine(tensors, dev)
            runner, routes, http_port = holder.run(_serve_routes(engine, dev))
            r.share(f"http://127.0.0.1:{http_port}", src=1)
            dist.barrier(group=r.ctrl)  # rank 0 pushes meanwhile
            r.sync()
            ok_push = checksum(tensors, names) == expected and engine.weight_version == str(reps + 1)
            routes.close()
            holder.run(runner.cleanup())
            holder.close()
            for t in tensors.values():
                t.zero_()
        ok_bucketed, ok_push = _all_ok(r, ok_bucketed), _all_ok(r, ok_push)
        ok = ok_bucketed and ok_push
        if r.rank == 0:
            t_push = statistics.median(push_times[1:])
            row |= {"push": nbytes / t_push / 2**30, "check": "ok" if ok else "MISMATCH"}
            row["ratio"] = row["push"] / row["raw"]
            print("row: " + _format_row(row), flush=True)
        rows.append(row)
    del tensors
    gc.collect()  # the last pusher's staging buffers
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _all_ok(r: Ranks, ok: bool) -> bool:
    t = torch.tensor([1 if ok else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=r.ctrl)
    return bool(t.item())


# ----------------------------------------------------------------------- output


HEADER = ("| set | GB | tensors | bucket MB | buckets | raw GiB/s | bucketed GiB/s | push GiB/s | push / raw "
          "| snapshot ms | check |")


def _format_row(row: dict) -> str:
    return (f"| {row['set']} | {row['GB']:.2f} | {row['tensors']} | {row['bucket_mb']} | {row['buckets']} "
            f"| {row['raw']:.1f} | {row['bucketed']:.1f} | {row['push']:.1f} | {row['ratio']:.2f} "
            f"| {row['snapshot_ms']:.1f} | {row['check']} |")


def print_table(rows: list[dict], backend: str, devices: str, reps: int) -> None:
    print(f"# weight push: {backend}, {devices}; bf16 qwen3 weight sets (HF names/shapes from TorchTitan's "
          f"flavors); median of {reps} after 1 warm-up; GB = 1e9 bytes, GiB/s = 2^30 bytes/s")
    print("# raw = one flat broadcast (baseline); bucketed = WeightGroup broadcasts of the staging buckets + "
          "receive_weights + load copy; push = Pusher.push(wait=True) over HTTP to the server's routes "
          "(snapshot included); snapshot = staging copy alone")
    print(HEADER)
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        print(_format_row(row))


# ------------------------------------------------------------------------- main


def _worker(rank: int, args: argparse.Namespace) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    backend = "gloo" if args.cpu else "nccl"
    if args.cpu:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    from datetime import timedelta

    dist.init_process_group(backend, rank=rank, world_size=2, timeout=timedelta(seconds=300),
                            device_id=device if device.type == "cuda" else None)
    ctrl = dist.new_group(backend="gloo")
    raw_group = dist.new_group([0, 1])  # a communicator of its own, like a weight-sync group
    loop = LoopThread() if rank == 0 else None
    r = Ranks(rank, device, ctrl)
    rows = []
    try:
        for flavor in args.sets:
            rows += _measure_set(r, flavor, args.bucket_mb, args.reps, backend, raw_group, loop)
        if rank == 0:
            if args.cpu:
                devices = f"cpu -> cpu (2 processes), torch {torch.__version__}"
            else:
                v = torch.cuda.nccl.version()
                v = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
                devices = f"{torch.cuda.get_device_name(0)}: cuda:0 -> cuda:1, torch {torch.__version__}, NCCL {v}"
            print_table(rows, backend, devices, args.reps)
            bad = [f"{row['set']}/{row['bucket_mb']}MiB" for row in rows if row["check"] != "ok"]
            if bad:
                raise RuntimeError(f"the replica did not end up with the trainer's bytes for {bad}")
        dist.barrier(group=ctrl)  # leave together: a peer gone early can abort this rank at exit
    finally:
        if loop is not None:
            loop.close()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU with a tiny weight set (tests, CI)")
    ap.add_argument("--sets", default=None, help=f"qwen3 flavors, comma-separated (GPU: {GPU_SETS}; "
                                                 f"--cpu: {CPU_SETS}); FLAVOR/L<n> keeps n layers")
    ap.add_argument("--bucket-mb", default=None, help=f"bucket sizes in MiB (GPU: {GPU_BUCKETS_MB}; "
                                                      f"--cpu: {CPU_BUCKETS_MB})")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per path (after one warm-up)")
    args = ap.parse_args(argv)
    args.sets = (args.sets or (CPU_SETS if args.cpu else GPU_SETS)).split(",")
    args.bucket_mb = [int(x) for x in (args.bucket_mb or (CPU_BUCKETS_MB if args.cpu else GPU_BUCKETS_MB)).split(",")]
    if not args.cpu and torch.cuda.device_count() < 2:
        sys.exit(f"needs 2 GPUs (found {torch.cuda.device_count()}); use --cpu for the gloo version")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    torch.multiprocessing.spawn(_worker, args=(args,), nprocs=2, join=True)


if __name__ == "__main__":
    main()
