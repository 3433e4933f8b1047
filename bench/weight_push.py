"""Weight-push bandwidth against the raw broadcast bandwidth, measured in one run.

    python bench/weight_push.py [--sets 0.6B,4B,8B] [--bucket-mb 256,1024] [--reps 3]
                                [--protocols sglang,vllm[,sglang-seq,sglang-noack,vllm-seq,vllm-noack]] [--disk-sets 0.6B,4B]
    python bench/weight_push.py --cpu        # gloo, a tiny set (what the tests run)

Two processes: rank 0 on cuda:0 is the trainer side, rank 1 on cuda:1 is one
inference replica (with ``--cpu`` both run on CPU and talk gloo). A weight set
is random bf16 tensors with the HF names and shapes of a TorchTitan qwen3
flavor (the model is built on the meta device and its state-dict adapter
names the tensors, so tied embeddings and every norm are included). For each
set the same bytes go over these paths:

* ``raw``: one flat buffer of the set's size, ``torch.distributed.broadcast``
  on a process group of its own (the baseline: what the fabric gives).
* ``bucketed``: the pusher's data path without the HTTP control plane.
  Rank 0 broadcasts the staging buffers (one per bucket, planned by
  ``buckets.plan_buckets``) with ``WeightGroup.broadcast`` on a side stream,
  as each replica's sender does; rank 1 runs the built-in server's
  ``receive_weights`` for each bucket (flattened: one uint8 broadcast, views
  sliced out) and installs them as ``Engine.load_weights`` does
  (``install_weights``: a fresh buffer becomes the parameter's storage).
* ``push``, per path: the whole path a trainer uses, ``Pusher.push(wait=True)``
  to the built-in server's real app (``server.build_app``: its SGLang and
  vLLM routes) served by rank 1:

  - ``sglang``: snapshot into flattened buckets, then begin / one
    ``/update_weights_from_distributed?ack=posted`` per bucket / end over
    HTTP while the same broadcasts run, each bucket sent once its update is
    answered (its receive posted), queued behind the one in flight;
  - ``vllm``: start / one ``/update_weights?ack=posted`` while every packed
    chunk (of 'bucket MiB') is broadcast / pause / finish / resume, all
    pipelined; the update is answered once its receives are posted, so the
    pause and the finish are handled while the bytes arrive. The server
    receives each chunk into a buffer of its own and keeps its tensors as
    views of it (those at unaligned offsets are copied out on a side stream);
  - ``disk`` (the sets of ``--disk-sets``, once per set): safetensors of the
    version written to a local folder, ``/update_weights_from_disk``;
  - ``sglang-noack``, ``vllm-noack`` (only when named): the same without
    ``ack_posted``: each update answered after its bytes (SGLang: bucket k
    sent after the reply to k-1, the default until run 48; vLLM: the
    finish handled after the update's reply, the default until run 55).
  - ``sglang-seq``, ``vllm-seq`` (only when named in ``--protocols``): the
    same with ``PushConfig.pipelined`` off, each request sent after the
    reply it must follow, as a real SGLang or vLLM gets them (the built-in
    server otherwise takes a transfer's requests pipelined on one connection).

  Only the model behind the routes is a stand-in (a dict of parameters of
  the real names, shapes and dtype, with ``Engine.load_weights``' checks and
  ``install_weights``): an 8B HF checkpoint would have to be written to disk
  and loaded first, which costs more than the whole benchmark. Generation is
  idle during the push.
* ``snapshot``: the device copy of the weights into the staging buffers
  (``StagingBuffers.stage``, what ``Pusher.push`` runs): the only cost of an async
  push on the trainer's critical path.

Timing: ``raw``, ``bucketed`` and ``snapshot`` start both ranks from a
barrier and take, per repetition, the slower rank's time to its own
completion (device synchronised); the first repetition is a warm-up and the
median of the others is reported. ``push`` is the wall time of
``push(wait=True)`` on rank 0 (it returns once the replica serves the
version); ``xfer`` is the same less the trainer's host stall (the push's own
``time/push_stall_s``). On GPUs the stall is only the launch of the
snapshot's copies; the copies themselves run on the device ahead of the
broadcasts, bucket by bucket, and what of them the first broadcast waits for
is inside both ``push`` and ``xfer``. A push that waits hands the version to
the senders before the snapshot, so their HTTP up to the first receive runs
during that stall: ``xfer`` is then the time from the trainer's return to the
replica serving the version, and ``push`` the stricter number (in async mode
the HTTP starts after the stall). ``async`` measures that mode: as many
versions again through ``push(wait=False)``, each timed from the trainer's
return to the replica serving it (``wait_for``), one at a time, so no
version is skipped. Medians after one warm-up push. GiB/s = set
bytes / time. After ``bucketed`` and each push the replica's parameters are
compared with the trainer's (an integer checksum of every tensor and the
served version): the ``check`` column says ``ok`` only if every path
delivered.

Prints one markdown table; rows are printed as they complete (``row:``) so a
run cut short still leaves its numbers.

``--trace`` also prints, for the last version of each push, a timeline of
both processes (``time.perf_counter``, one clock on one host): every HTTP
request of the pusher, every broadcast call of its sender, and on the replica
every route's handling, receive and install, in ms from the start of
``push``. It is where the push loses time against ``raw``. The wrappers are
installed by the bench only; the product code has no tracing in it.

The replica stand-in (``TensorEngine`` behind the server's routes) and the
trace live in bench/weight_push_parts.py; this file measures and prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchtitan_grpo  # noqa: E402,F401  (triton shim before torchtitan)
from torchtitan_grpo.aio import LoopThread  # noqa: E402
from torchtitan_grpo.server.engine.weights import install_weights  # noqa: E402
from torchtitan_grpo.net import free_port  # noqa: E402
from torchtitan_grpo.weight_sync import buckets as bk  # noqa: E402

from bench import weight_push_parts as parts  # noqa: E402  (the replica stand-in, --trace)

GPU_SETS = "0.6B,4B,8B"
CPU_SETS = "debugmodel"
GPU_BUCKETS_MB = "256,1024"
GPU_DISK_SETS = "0.6B,4B"  # 16 GB x 4 versions of 8B through a disk would outlast a device call
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
    """Exact integer checksums of bf16 tensors (no large temporaries)."""
    return [int(tensors[n].view(torch.int16).sum(dtype=torch.int64)) for n in names]


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
                 loop: LoopThread | None, protocols: list[str], disk_sets: list[str],
                 staging: str = "device") -> list[dict]:
    from torchtitan_grpo.server.engine.weights import receive_weights
    from torchtitan_grpo.weight_sync.group import init_weight_group, master_store
    from torchtitan_grpo.weight_sync.pusher import PushConfig

    specs = qwen3_hf_specs(flavor)
    nbytes = sum(s.nbytes for s in specs)
    dev = r.device
    names = [s.name for s in specs]  # every tensor is checked after each path
    torch.manual_seed(0)
    if r.rank == 0:
        tensors = {s.name: torch.randn(s.shape, dtype=s.dtype, device=dev) for s in specs}
    else:
        tensors = {s.name: torch.zeros(s.shape, dtype=s.dtype, device=dev) for s in specs}
    expected = r.share(checksum(tensors, names) if r.rank == 0 else None)

    # raw: one flat buffer, one broadcast
    flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    t_raw = r.timed(lambda: dist.broadcast(flat, 0, group=raw_group), reps)
    flat = None  # not del: the lambda above holds it (pyflakes)

    rows = []
    for k, mb in enumerate(bucket_mbs):
        plan = bk.plan_buckets(specs, mb << 20)
        row = {"set": flavor, "GB": nbytes / 1e9, "tensors": len(specs), "bucket_mb": mb, "buckets": len(plan),
               "raw": nbytes / t_raw / 2**30}

        # bucketed: staging buffers -> WeightGroup broadcasts -> receive_weights + load copy
        store = master_store("127.0.0.1", 2, 120) if r.rank == 0 else None
        port = r.share(store.port if r.rank == 0 else None)
        group = init_weight_group("127.0.0.1", port, r.rank, 2, backend=backend, group_name=f"bench{k}",
                                  timeout_s=120, device=dev if backend == "nccl" else None, store=store)
        if r.rank == 0:
            from torchtitan_grpo.weight_sync.pusher import Pusher
            from torchtitan_grpo.weight_sync.upload import Uploader

            # The Pusher's own staging copy, on a Pusher that never connects.
            stager = Pusher(loop, [], PushConfig(backend=backend, bucket_bytes=mb << 20, staging=staging),
                            device=dev)
            stager.staging.plan = plan
            staged = stager.staging.free_buffer()
            stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
            # staging "host" over nccl: through the device buffers a sender uploads into
            up = Uploader(dev, max(b.numel() for b in staged.buffers)) if staged.pinned and backend == "nccl" else None

            def send():
                if up is None:
                    for buf in staged.buffers:
                        group.broadcast(buf, src=0, stream=stream)
                    return
                up.begin(staged.buffers, None)
                for i in range(len(staged.buffers)):
                    group.broadcast(up.take(i, stream), src=0, stream=stream, wait=False)
                    up.sent(i, stream)
                stream.synchronize()

            t_snap = r.timed(lambda: stager.staging.stage(staged, tensors), reps)
            t_bucketed = r.timed(send, reps)
            del staged, stager, up
        else:
            def receive():
                with torch.no_grad():
                    for b in plan:
                        install_weights(tensors, receive_weights(group, b, flattened=True))

            t_snap = r.timed(lambda: None, reps)
            t_bucketed = r.timed(receive, reps)
        group.close()
        ok_bucketed = r.rank == 0 or checksum(tensors, names) == expected
        if r.rank == 1:
            for t in tensors.values():
                t.zero_()
        row |= {"bucketed": nbytes / t_bucketed / 2**30, "snapshot_ms": t_snap * 1e3}

        # push: Pusher (trainer side) -> HTTP + broadcasts -> the server's routes, per protocol
        pushes = {path: _push(r, tensors, names, expected, loop, reps, PushConfig(
            mode="sync", backend=backend, protocol=path.split("-")[0], bucket_bytes=mb << 20,
            packed_buffer_bytes=mb << 20, num_staging_buffers=1, deadline_s=300, init_timeout_s=120, staging=staging,
            pipelined=not path.endswith("-seq"), ack_posted=not path.endswith("-noack")), path) for path in protocols}
        if k == 0 and flavor in disk_sets:
            with tempfile.TemporaryDirectory(prefix="weight_push_disk_") as folder:
                pushes["disk"] = _push(r, tensors, names, expected, loop, reps, PushConfig(
                    mode="sync", backend="disk", disk_folder=r.share(folder), deadline_s=600), "disk")
        wrong = [path for path, (_, _, _, ok) in pushes.items() if not ok]
        if not _all_ok(r, ok_bucketed):
            wrong.insert(0, "bucketed")
        if r.rank == 0:
            for proto, (t_push, t_transfer, t_async, _) in pushes.items():
                row[proto] = nbytes / t_push / 2**30
                row[proto + "_transfer"] = nbytes / t_transfer / 2**30
                row[proto + "_async"] = nbytes / t_async / 2**30
            row["check"] = "MISMATCH " + "+".join(wrong) if wrong else "ok"
            print("row: " + _format_row(row, [p for p in PATHS if p in row]), flush=True)
        rows.append(row)
    tensors = None  # not del: the closures above hold it (pyflakes)
    gc.collect()  # the last pusher's staging buffers
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _push(r: Ranks, tensors: dict[str, torch.Tensor], names: list[str], expected: list[int], loop,
          reps: int, cfg, path: str) -> tuple[float, float, float, bool]:
    """``reps`` + 1 versions through ``Pusher.push(wait=True)`` from rank 0 to a
    built-in server app on rank 1 (``cfg`` picks protocol and transport), then
    as many through ``push(wait=False)`` + ``wait_for``. Returns the medians
    after the first of the whole push, of its transfer (the push less the
    trainer's host stall, ``time/push_stall_s``; on GPUs the snapshot's device
    copy is mostly still inside) and of the async push from the trainer's
    return to the replica serving it, and whether the replica ended with the
    trainer's bytes and the last version."""
    trace = parts.TRACE  # None unless --trace
    push_times: list[float] = []
    transfer_times: list[float] = []
    async_times: list[float] = []
    last = 2 * (reps + 1)
    if r.rank == 0:
        from torchtitan_grpo.weight_sync.pusher import Pusher

        url = r.share(None, src=1)
        pusher = Pusher(loop, [url], cfg, device=r.device)
        try:
            pusher.connect(initial_version=0)
            for v in range(1, reps + 2):
                t0 = time.perf_counter()
                m = pusher.push(tensors, version=v, wait=True)
                push_times.append(time.perf_counter() - t0)
                transfer_times.append(push_times[-1] - m["time/push_stall_s"])
                if trace is not None:
                    trace.events.append((f"trainer snapshot (host stall) v{v}", t0, t0 + m["time/push_stall_s"]))
            async_start = time.perf_counter()  # the trace below is of the last waited push, from t0
            for v in range(reps + 2, last + 1):  # async mode: published once staged
                ta0 = time.perf_counter()
                m = pusher.push(tensors, version=v, wait=False)
                t1 = time.perf_counter()
                if "push/bytes" not in m:
                    raise RuntimeError(f"async version {v} was skipped: {m}")
                if trace is not None:
                    trace.events.append((f"trainer snapshot (host stall, async) v{v}", ta0, t1))
                pusher.wait_for(v, timeout_s=cfg.deadline_s)
                async_times.append(time.perf_counter() - t1)
        finally:
            pusher.close()
            del pusher
            gc.collect()  # its staging buffers (cyclic references through its tasks)
        dist.barrier(group=r.ctrl)
        ok = True  # judged by the replica
        if trace is not None:
            theirs = r.share(None, src=1)
            name = f"{path} push of version {reps + 1}"
            parts.print_trace(name, t0, [e for e in trace.events + theirs if t0 <= e[2] and e[1] < async_start])
            parts.print_trace(f"{path} async push of version {last}", ta0,
                        [e for e in trace.events + theirs if ta0 <= e[2]])
            trace.events.clear()
    else:
        holder = LoopThread("bench-replica")
        engine = parts.TensorEngine(tensors, r.device)
        runner, http_port = holder.run(parts.serve_routes(engine, r.device))
        r.share(f"http://127.0.0.1:{http_port}", src=1)
        dist.barrier(group=r.ctrl)  # rank 0 pushes meanwhile
        r.sync()
        ok = checksum(tensors, names) == expected and engine.weight_version == str(last)
        holder.run(runner.cleanup())
        holder.close()
        if trace is not None:
            r.share(list(trace.events), src=1)
            trace.events.clear()
        for t in tensors.values():
            t.zero_()
    ok = _all_ok(r, ok)
    if r.rank != 0:
        return 0.0, 0.0, 0.0, ok
    return (statistics.median(push_times[1:]), statistics.median(transfer_times[1:]),
            statistics.median(async_times[1:]), ok)


def _all_ok(r: Ranks, ok: bool) -> bool:
    t = torch.tensor([1 if ok else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=r.ctrl)
    return bool(t.item())


# ----------------------------------------------------------------------- output


PUSH_PATHS = ("sglang", "sglang-seq", "sglang-noack", "vllm", "vllm-seq", "vllm-noack")
"""``-seq``: to the same built-in server without pipelined requests (``PushConfig.pipelined``
off: each request after the reply it must follow), the way a real SGLang or vLLM is sent to;
``-noack``: without ``PushConfig.ack_posted``."""
PATHS = PUSH_PATHS + ("disk",)


def _format_row(row: dict, paths: list[str] | None = None) -> str:
    cells = [row["set"], f"{row['GB']:.2f}", str(row["bucket_mb"]), str(row["buckets"]), f"{row['raw']:.1f}",
             f"{row['bucketed']:.1f}"]
    for path in paths or PATHS:
        if path in row:
            for key in (path, path + "_transfer", path + "_async"):
                cells += [f"{row[key]:.1f}", f"{row[key] / row['raw']:.2f}"]
        else:
            cells += ["-"] * 6
    cells += [f"{row['snapshot_ms']:.1f}", row["check"]]
    return "| " + " | ".join(cells) + " |"


def print_table(rows: list[dict], backend: str, devices: str, reps: int, staging: str = "device") -> None:
    print(f"# weight push: {backend}, {devices}; staging {staging}; bf16 qwen3 weight sets (HF names/shapes from TorchTitan's "
          f"flavors); median of {reps} after 1 warm-up; GB = 1e9 bytes, GiB/s = 2^30 bytes/s")
    print("# raw = one flat broadcast (baseline); bucketed = WeightGroup broadcasts of the staging buckets + "
          "receive_weights + install; <path> push = Pusher.push(wait=True) over HTTP to the built-in server's "
          "routes, snapshot included; <path> xfer = the same less the trainer's host stall (on GPUs the snapshot's "
          "device copy, overlapped with the broadcasts bucket by bucket, stays inside; the senders' HTTP up to the "
          "first receive runs during the stall, so xfer = trainer's return -> replica serving); <path> async = "
          "Pusher.push(wait=False) (published once staged), from its return to the replica serving it; sglang: one update request per bucket; vllm: one request, packed chunks of 'bucket MiB'; "
          "disk: safetensors in a local folder + update_weights_from_disk; snapshot = staging copy alone; "
          "staging host: snapshot = the copy to pinned host memory, bucketed = uploads to the GPU overlapped with "
          "the broadcasts")
    heads = ["set", "GB", "bucket MiB", "buckets", "raw GiB/s", "bucketed GiB/s"]
    paths = [p for p in PATHS if any(p in row for row in rows)]
    for path in paths:
        heads += [f"{path} {what}{unit}" for what in ("push", "xfer", "async") for unit in (" GiB/s", " / raw")]
    heads += ["snapshot ms", "check"]
    print("| " + " | ".join(heads) + " |")
    print("| --- | " + " | ".join(["---:"] * (len(heads) - 2)) + " | --- |")
    for row in rows:
        print(_format_row(row, paths))


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
    if args.trace:
        parts.start_trace(rank)
    rows = []
    try:
        for flavor in args.sets:
            rows += _measure_set(r, flavor, args.bucket_mb, args.reps, backend, raw_group, loop, args.protocols,
                                 args.disk_sets, args.staging)
        if rank == 0:
            if args.cpu:
                devices = f"cpu -> cpu (2 processes), torch {torch.__version__}"
            else:
                v = torch.cuda.nccl.version()
                v = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
                devices = f"{torch.cuda.get_device_name(0)}: cuda:0 -> cuda:1, torch {torch.__version__}, NCCL {v}"
            print_table(rows, backend, devices, args.reps, args.staging)
        dist.barrier(group=ctrl)  # leave together: a peer gone early can abort this rank at exit
        bad = [f"{row['set']}/{row['bucket_mb']}MiB: {row['check']}" for row in rows if row.get("check", "ok") != "ok"]
        if bad:
            raise RuntimeError(f"the replica did not end up with the trainer's bytes for {bad}")
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
    ap.add_argument("--protocols", default="sglang,vllm",
                    help="push paths to measure, comma-separated, of " + ", ".join(PUSH_PATHS)
                    + " (-seq: pipelined requests off; -noack: ack_posted off)")
    ap.add_argument("--disk-sets", default=None, help="sets also pushed through the disk transport (GPU: "
                                                       f"{GPU_DISK_SETS}; --cpu: {CPU_SETS}); 'none' for none")
    ap.add_argument("--trace", action="store_true", help="print a timeline of the last version of each push")
    ap.add_argument("--staging", default="device", choices=["device", "host"],
                    help="weight_sync.staging of the pushes (host: pinned host memory, uploaded per bucket)")
    args = ap.parse_args(argv)
    args.sets = (args.sets or (CPU_SETS if args.cpu else GPU_SETS)).split(",")
    args.protocols = [p for p in args.protocols.split(",") if p]
    if set(args.protocols) - set(PUSH_PATHS):
        sys.exit(f"--protocols: some of {', '.join(PUSH_PATHS)}, got {args.protocols}")
    disk = args.disk_sets or (CPU_SETS if args.cpu else GPU_DISK_SETS)
    args.disk_sets = [] if disk == "none" else disk.split(",")
    args.bucket_mb = [int(x) for x in (args.bucket_mb or (CPU_BUCKETS_MB if args.cpu else GPU_BUCKETS_MB)).split(",")]
    if not args.cpu and torch.cuda.device_count() < 2:
        sys.exit(f"needs 2 GPUs (found {torch.cuda.device_count()}); use --cpu for the gloo version")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    torch.multiprocessing.spawn(_worker, args=(args,), nprocs=2, join=True)


if __name__ == "__main__":
    main()
