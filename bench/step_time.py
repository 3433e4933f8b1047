"""Trainer step time with the weight push off, sync and async, measured in one
run; then a slow replica and a replica killed mid-transfer.

    python bench/step_time.py                 # trainer on cuda:0, built-in servers on cuda:1 (NCCL)
    python bench/step_time.py --cpu           # gloo, tiny model, one server in run 1 (what the tests run)
    python bench/step_time.py --one-gpu [--transport ipc|gloo]   # trainer and servers share cuda:0

The trainer is what ``grpo_train.py`` runs: a TorchTitan qwen3 built by
``trainer.build_policy`` from an HF checkpoint written locally (GPU: the
shape of Qwen3-0.6B with random weights, float32 master weights, TorchTitan's
fused AdamW; ``--cpu``: the demo's tiny Qwen3), taking real forward / backward
/ AdamW steps (``trainer.train_step``) on one fixed synthetic GRPO batch, and
pushing the HF-named weights (``DirectPush.tensors``) after each step with
``weight_sync.pusher.Pusher`` (nccl, or gloo with ``--cpu``) to built-in
servers (``python -m torchtitan_grpo.server``, bf16 on cuda:1; they
receive the float32 tensors ``grpo_train.py`` sends and cast them as they
load). The servers only receive weights: nothing generates, so every
difference between the rows is the push.

1. **off / sync / async.** One pusher over ``--servers`` replicas. The three
   modes alternate in ``--rounds`` rounds of ``--steps`` steps each (the
   pusher is drained between blocks and that wait is not counted), so drift
   of the machine hits every mode alike. ``off`` skips the push (as
   ``weight_sync.mode = "off"`` does); ``sync`` is ``push(wait=True)`` (every
   replica has loaded the version when the step ends); ``async`` is
   ``push(wait=False)``: snapshot into a staging buffer and return.
2. **slow replica.** The warm-up sync pushes measure a replica's normal
   update time ``t_u`` (``Pusher.status()["last_transfer_s"]``: begin ->
   every bucket -> end). Before run 1 starts, a new server is started with
   ``--debug-update-delay-s = slow_factor * t_u / buckets``: the knob sleeps in
   *each* update handler, so one version costs that replica ``slow_factor *
   t_u`` more than normal (10x its update time by default); it idles through
   run 1. Then a new pusher over [first replica, slow replica] (two replicas,
   as in run 1) runs async steps: the step time against the unslowed async
   row, and the fast replica's version lag, show whether the slow one holds
   anything up.
3. **kill.** Still async, the slow replica is killed with SIGKILL while a
   transfer to it is in flight (its sender is between begin and end; almost
   always the server is then sleeping in an update handler, a bucket
   received and not yet answered); the
   trainer keeps stepping; the replica must be ejected within the deadline
   and no step may take as long as the deadline. A server is restarted on
   the same port; the trainer keeps stepping until the pusher has
   reconnected, sent it the newest version and readmitted it, and then its
   served version must equal the latest.

Step time is the wall time of ``train_step`` + the HF-named weights
(``DirectPush.tensors``, as ``grpo_train.py`` takes them) + ``push`` on the
trainer's thread (the trainer's stream is synchronised; the pusher's own
streams are not: overlapping them is the point). ``stall`` is the pusher's
``time/push_stall_s`` (snapshot, or the skip decision); ``lag`` is
``push/replicaK_version_lag`` as ``push`` returns it (newest version minus
the replica's; in async mode 1 means the replica had the previous version
when the new one was snapshotted). Prints one markdown table and PASS / FAIL
lines; interim rows are printed as soon as they are measured.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchtitan_grpo.aio import LoopThread  # noqa: E402
from torchtitan_grpo.models.demo_assets import QWEN3_0_6B, TinyQwen3, write_tiny_qwen3  # noqa: E402
from torchtitan_grpo.fleet.launcher import free_port, log_tail, stop_process  # noqa: E402
from torchtitan_grpo.weight_sync import buckets as bk  # noqa: E402

GROUP_NAME = "weight_update_group"


# --------------------------------------------------------------------- servers


@dataclass
class Server:
    url: str
    port: int
    proc: subprocess.Popen
    log: str
    delay_s: float


def _die_with_parent() -> None:
    """preexec_fn: Linux sends the server SIGTERM when the benchmark dies."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_server(model_dir: str, device: str, dtype: str, log_dir: str, delay_s: float = 0.0,
                 port: int | None = None, threads: int = 1) -> Server:
    """Start one built-in server (returns at once; see ``wait_healthy``)."""
    port = port or free_port()
    log = os.path.join(log_dir, f"server_{port}_{int(time.time() * 1000) % 100000}.log")
    cmd = [sys.executable, "-m", "torchtitan_grpo.server", "--model", model_dir, "--port", str(port),
           "--device", device, "--dtype", dtype, "--weight-group-timeout", "120",
           "--debug-update-delay-s", f"{delay_s:.6f}"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
    return Server(f"http://127.0.0.1:{port}", port, proc, log, delay_s)


def wait_healthy(s: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if s.proc.poll() is not None:
            raise RuntimeError(f"server {s.url} exited with {s.proc.returncode}:\n{log_tail(s.log)}")
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(s.url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(0.2)
    raise RuntimeError(f"server {s.url} not healthy after {timeout_s:.0f}s:\n{log_tail(s.log)}")


def stop_server(s: Server) -> None:
    stop_process(s.proc, grace_s=10)


def http(url: str, body: dict | None = None, timeout_s: float = 30) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        text = r.read()
    return json.loads(text) if text else {}


def served_version(s: Server) -> str:
    return str(http(s.url + "/model_info")["weight_version"])


def forget_group(s: Server) -> None:
    """Drop the server's weight group (a new pusher makes a new one)."""
    with contextlib.suppress(urllib.error.URLError, OSError):
        http(s.url + "/destroy_weights_update_group", {"group_name": GROUP_NAME})


# --------------------------------------------------------------------- trainer


def write_model(model_dir: str, gpu: bool) -> None:
    """The HF checkpoint (random weights, float32): Qwen3-0.6B's shape on GPUs,
    the demo's tiny Qwen3 with ``--cpu``."""
    write_tiny_qwen3(model_dir, QWEN3_0_6B if gpu else TinyQwen3())


def synthetic_batch(num: int, prompt_len: int, completion_len: int, vocab: int, seed: int = 0):
    """A fixed GRPO batch: random tokens, rollout logprobs near uniform, advantages +-1."""
    from torchtitan_grpo.train.trainer import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        prompt = torch.randint(2, vocab, (prompt_len,), generator=g).tolist()
        completion = torch.randint(2, vocab, (completion_len,), generator=g).tolist()
        logprobs = (-math.log(vocab) + 0.1 * torch.randn(completion_len, generator=g)).tolist()
        adv = 1.0 if i % 2 == 0 else -1.0
        out.append(Sample(prompt, completion, logprobs, adv, float(i % 2 == 0), "length", ["0"]))
    return out


class Trainer:
    """The trainer of ``grpo_train.py`` on one device, on a fixed batch."""

    def __init__(self, args, model_dir: str, device: torch.device):
        from torchtitan_grpo.config.parse import parse_config
        from torchtitan_grpo.train.trainer import Dist, build_policy
        from torchtitan_grpo.weight_sync.gather import DirectPush

        self.args = args
        seq = args.prompt_len + args.completion_len
        argv = ["--model.name", "qwen3", "--model.hf_assets_path", model_dir, "--training.seq_len", str(seq),
                "--training.steps", "1000000", "--training.max_norm", "1.0", "--optimizer.lr", "1e-5",
                "--optimizer.weight_decay", "0.0", "--lr_scheduler.warmup_steps", "1",
                "--grpo.micro_batch_size", str(args.micro_batch_size), "--job.dump_folder", args.log_dir]
        if device.type == "cpu":
            argv += ["--optimizer.implementation", "for-loop"]
        self.cfg = parse_config(argv)
        self.d = Dist(0, 1, 0, device)
        self.policy = build_policy(self.cfg, model_dir, self.d)
        # What grpo_train.py pushes on one rank, as it pushes it (the pusher is set per mode)
        self.export = DirectPush(self.policy.model_parts, self.policy.adapter, None, sync=False,
                                 optimizers=self.policy.optimizers)
        self.vocab = self.policy.model_args.vocab_size
        self.set_batch(args.samples)
        self.version = 0

    def set_batch(self, num: int) -> None:
        self.batch = synthetic_batch(num, self.args.prompt_len, self.args.completion_len, self.vocab)

    def step(self, pusher, mode: str) -> dict:
        from torchtitan_grpo.train.trainer import train_step

        a = self.args
        t0 = time.perf_counter()
        train_step(self.policy, self.batch, self.cfg.grpo, 1.0, a.completion_len,
                   global_num_samples=len(self.batch), global_num_tokens=len(self.batch) * a.completion_len,
                   pad_id=0, d=self.d)
        m: dict = {}
        if mode != "off":
            self.version += 1
            self.export.pusher = pusher
            m = self.export.snapshot(self.version, wait=mode == "sync")
        if self.d.device.type == "cuda":
            torch.cuda.current_stream(self.d.device).synchronize()  # the trainer's stream only
        m["step_s"] = time.perf_counter() - t0
        m["t_end"] = time.monotonic()
        return m

    def push_specs(self) -> list[bk.TensorSpec]:
        from torchtitan_grpo.train.trainer import hf_weights

        return [bk.TensorSpec.of(n, t) for n, t in hf_weights(self.policy).items()]


# ----------------------------------------------------------------- statistics


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)] if s else float("nan")


@dataclass
class Row:
    name: str
    recs: list[dict]
    skipped: int = 0
    replicas: int = 0

    def times(self) -> list[float]:
        return [r["step_s"] for r in self.recs]

    @property
    def median(self) -> float:
        return statistics.median(self.times()) if self.recs else float("nan")

    def lag(self, k: int) -> str:
        vals = [r[f"push/replica{k}_version_lag"] for r in self.recs if f"push/replica{k}_version_lag" in r]
        return f"{max(vals):.0f}" if vals else "-"

    def stall(self, fn) -> str:
        vals = [r["time/push_stall_s"] for r in self.recs if "time/push_stall_s" in r]
        return f"{fn(vals) * 1e3:.2f}" if vals else "-"

    def format(self, off: float, lags: int) -> str:
        t = self.times()
        lag_cols = " | ".join(self.lag(k) for k in range(lags))
        return (f"| {self.name} | {len(t)} | {self.median * 1e3:.1f} | {pct(t, 0.9) * 1e3:.1f} "
                f"| {self.median / off:.3f} | {self.stall(statistics.median)} | {self.stall(max)} "
                f"| {self.skipped} | {lag_cols} |")


def print_table(rows: list[Row], title: str, lags: int) -> None:
    off = next((r.median for r in rows if r.name == "off"), float("nan"))
    print(title)
    lag_head = " | ".join(f"max lag r{k}" for k in range(lags))
    print(f"| run | steps | median ms | p90 ms | vs off | stall median ms | stall max ms | skipped versions "
          f"| {lag_head} |")
    print("| --- " + "| ---: " * (7 + lags) + "|")
    for r in rows:
        print(r.format(off, lags))
    for r in rows:  # staging "host": DirectPush's GPU time of the copy to the host
        copy = [m["time/push_host_copy_s"] * 1e3 for m in r.recs if "time/push_host_copy_s" in m]
        if copy:
            print(f"# {r.name}: copy to the host median {statistics.median(copy):.1f} ms, max {max(copy):.1f} ms "
                  f"on the GPU (beside the next step)")
    sys.stdout.flush()


# ------------------------------------------------------------------ the run


class Events:
    """Eject / readmit callbacks of the pusher (called on its event loop)."""

    def __init__(self):
        self.ejected: dict[str, float] = {}
        self.readmitted: dict[str, float] = {}

    def eject(self, url: str) -> None:
        self.ejected[url] = time.monotonic()

    def readmit(self, url: str) -> None:
        self.readmitted[url] = time.monotonic()


def run_block(tr: Trainer, pusher, mode: str, steps: int, guard_s: float) -> list[dict]:
    recs = []
    for _ in range(steps):
        faulthandler.dump_traceback_later(guard_s, exit=True)  # a hung step prints where and ends the run
        recs.append(tr.step(pusher, mode))
        faulthandler.cancel_dump_traceback_later()
    return recs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="gloo, tiny model, one server (tests, CI)")
    ap.add_argument("--one-gpu", action="store_true",
                    help="the GPU settings with trainer and servers on cuda:0 (NCCL cannot join two "
                         "processes on one GPU): see --transport")
    ap.add_argument("--transport", default=None, choices=["nccl", "gloo", "ipc"],
                    help="weight_sync.transport (GPU nccl, --one-gpu ipc, --cpu gloo)")
    ap.add_argument("--servers", type=int, default=None, help="replicas in the off/sync/async run (GPU 2, --cpu 1)")
    ap.add_argument("--steps", type=int, default=None, help="steps per mode per round (GPU 8, --cpu 4)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of off/sync/async (GPU 3, --cpu 2)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="sync warm-up steps (GPU 4, --cpu 3); at least 2 run: the first, which also creates "
                         "the communicators, is not timed, and t_u is the median of the others")
    ap.add_argument("--slow-steps", type=int, default=None, help="async steps with the slow replica (GPU 24, --cpu 8)")
    ap.add_argument("--after-kill-steps", type=int, default=None, help="steps after the kill before the restart "
                                                                         "(GPU 10, --cpu 5)")
    ap.add_argument("--samples", type=int, default=None, help="samples in the batch (GPU 32, --cpu 16)")
    ap.add_argument("--prompt-len", type=int, default=None, help="GPU 32, --cpu 16")
    ap.add_argument("--completion-len", type=int, default=None, help="GPU 32, --cpu 16")
    ap.add_argument("--micro-batch-size", type=int, default=32)
    ap.add_argument("--target-ms", type=float, default=None,
                    help="grow the batch (up to 8x) until an off step takes about this long (GPU 150; 0 = keep)")
    ap.add_argument("--bucket-mb", type=int, default=1024, help="weight_sync.bucket_size_mb")
    ap.add_argument("--staging", default="device", choices=["device", "host"], help="weight_sync.staging")
    ap.add_argument("--ack-posted", action=argparse.BooleanOptionalAction, default=True,
                    help="weight_sync.ack_posted (SGLang updates answered once their receive is posted)")
    ap.add_argument("--push-dtype", default="model", choices=["model", "bfloat16", "float32"],
                    help="weight_sync.dtype: the dtype the weights are sent in")
    ap.add_argument("--slow-factor", type=float, default=10.0, help="the slow replica's extra time per version, "
                                                                      "in units of the normal update time")
    ap.add_argument("--deadline-s", type=float, default=None, help="weight_sync.replica_deadline_s (GPU 20, --cpu 15)")
    ap.add_argument("--max-slow-ratio", type=float, default=None,
                    help="PASS bound on async step time with a slow replica / without (GPU 1.15, --cpu 1.5)")
    ap.add_argument("--model-dir", default=None, help="HF checkpoint dir (written if missing)")
    ap.add_argument("--log-dir", default=None, help="server logs (default: a temporary directory)")
    args = ap.parse_args(argv)
    gpu = not args.cpu
    for key, g, c in (("servers", 2, 1), ("steps", 8, 4), ("rounds", 3, 2), ("warmup", 4, 3),
                      ("slow_steps", 24, 8), ("after_kill_steps", 10, 5), ("samples", 32, 16),
                      ("prompt_len", 32, 16), ("completion_len", 32, 16), ("target_ms", 150.0, 0.0),
                      ("deadline_s", 20.0, 15.0), ("max_slow_ratio", 1.15, 1.5)):
        if getattr(args, key) is None:
            setattr(args, key, g if gpu else c)
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.cpu and args.one_gpu:
        ap.error("--cpu and --one-gpu exclude each other")
    need = 1 if args.one_gpu else 2
    if gpu and torch.cuda.device_count() < need:
        print(f"needs {need} GPU(s) (found {torch.cuda.device_count()}); use --cpu for the gloo version",
              file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.cpu:
        torch.set_num_threads(1)  # the servers take one thread each too
    with tempfile.TemporaryDirectory(prefix="step_time_") as tmp:
        args.log_dir = args.log_dir or os.path.join(tmp, "logs")
        os.makedirs(args.log_dir, exist_ok=True)
        model_dir = args.model_dir or os.path.join(tmp, "qwen3")
        return _run(args, model_dir, gpu)


def _run(args, model_dir: str, gpu: bool) -> int:
    from torchtitan_grpo.weight_sync.pusher import Pusher, PushConfig

    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    server_device, server_dtype = ("cuda:0" if args.one_gpu else "cuda:1", "bfloat16") if gpu else ("cpu", "float32")
    backend = args.transport or ("nccl" if gpu and not args.one_gpu else "ipc" if args.one_gpu else "gloo")
    if gpu:
        torch.cuda.set_device(device)
    t_start = time.monotonic()
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        write_model(model_dir, gpu)
    print(f"# model written/found at {model_dir} ({time.monotonic() - t_start:.1f}s)", flush=True)

    servers = [start_server(model_dir, server_device, server_dtype, args.log_dir) for _ in range(args.servers)]
    everything = list(servers)
    loop = LoopThread()
    events = Events()
    results: list[Row] = []
    checks: list[tuple[bool, str]] = []
    guard_s = max(120.0, 3 * args.deadline_s)

    def new_pusher(urls: list[str], initial_version: int):
        p = Pusher(loop, urls, PushConfig(mode="async", backend=backend, bucket_bytes=args.bucket_mb << 20,
                                          num_staging_buffers=2, deadline_s=args.deadline_s, init_timeout_s=120,
                                          reconnect_interval_s=1.0, staging=args.staging, ack_posted=args.ack_posted,
                                          dtype=None if args.push_dtype == "model" else getattr(torch, args.push_dtype)),
                   device=device, on_eject=events.eject, on_readmit=events.readmit)
        p.connect(initial_version=initial_version)
        return p

    def check(ok: bool, msg: str) -> None:
        checks.append((bool(ok), msg))
        print(f"# interim {'PASS' if ok else 'FAIL'} {msg}", flush=True)  # kept if a later phase dies

    def drain(p, timeout_s: float = 120) -> None:
        if tr.version:
            p.wait_for(tr.version, timeout_s=timeout_s)

    try:
        tr = Trainer(args, model_dir, device)  # builds while the servers load
        n_params = sum(p.numel() for p in tr.policy.model.parameters())
        for s in servers:
            wait_healthy(s, 300)
        print(f"# trainer: qwen3 {n_params / 1e6:.1f}M params on {device} (float32, AdamW); "
              f"{len(servers)} server(s) on {server_device} ({server_dtype}); ready after "
              f"{time.monotonic() - t_start:.1f}s", flush=True)

        # ---- warm-up, batch size, normal update time
        p1 = new_pusher([s.url for s in servers], 0)
        run_block(tr, p1, "off", 3, guard_s)
        if args.target_ms > 0:
            t_off = statistics.median(r["step_s"] for r in run_block(tr, p1, "off", 3, guard_s))
            if t_off * 1e3 < args.target_ms / 1.5:
                tr.set_batch(min(8 * args.samples, math.ceil(args.samples * args.target_ms / (t_off * 1e3))))
                run_block(tr, p1, "off", 2, guard_s)
        update_s = []
        # The first push also creates the communicators and is not timed: t_u
        # needs one timed push after it, so at least 2 run whatever --warmup says.
        for k in range(max(args.warmup, 2)):
            run_block(tr, p1, "sync", 1, guard_s)
            if k > 0:
                update_s.append(max(st["last_transfer_s"] for st in p1.status()))
        t_u = statistics.median(update_s)
        sent = [bk.TensorSpec(x.name, getattr(torch, args.push_dtype) if args.push_dtype != "model" else x.dtype,
                              x.shape) for x in tr.push_specs()]
        n_buckets = len(bk.plan_buckets(sent, args.bucket_mb << 20))  # as the pusher plans them
        handlers = 1 if backend == "ipc" else n_buckets  # ipc: one update request per version
        delay = args.slow_factor * t_u / handlers
        push_gb = sum(s.nbytes for s in tr.push_specs()) / 1e9
        print(f"# batch: {len(tr.batch)} samples x ({args.prompt_len} prompt + {args.completion_len} completion) "
              f"tokens; push: {push_gb:.2f} GB/version of float32 master weights, sent as {args.push_dtype}, in "
              f"{n_buckets} bucket(s) of <= {args.bucket_mb} MiB over {backend}", flush=True)
        print(f"# normal update time t_u = {t_u * 1e3:.1f} ms/version (median of sync warm-up pushes, slowest "
              f"replica); slow replica: --debug-update-delay-s {delay:.4f} x {handlers} handler(s) = "
              f"+{args.slow_factor:g} t_u per version", flush=True)
        slow = start_server(model_dir, server_device, server_dtype, args.log_dir, delay_s=delay)
        everything.append(slow)
        wait_healthy(slow, 300)  # a loading server takes CPU: let it settle before anything is timed

        # ---- 1. off / sync / async, interleaved
        recs: dict[str, list[dict]] = {"off": [], "sync": [], "async": []}
        skipped = {"off": 0, "sync": 0, "async": 0}
        for _ in range(args.rounds):
            for mode in ("off", "sync", "async"):
                drain(p1)
                before = p1.skipped_versions
                recs[mode] += run_block(tr, p1, mode, args.steps, guard_s)
                skipped[mode] += p1.skipped_versions - before
        drain(p1)
        for mode in ("off", "sync", "async"):
            results.append(Row(mode, recs[mode], skipped[mode], len(servers)))
        lags = max(2, len(servers))
        print_table(results, "# interim: off / sync / async", lags)
        sync_lag = max((v for r in recs["sync"] for k, v in r.items() if k.endswith("_version_lag")), default=-1)
        check(sync_lag == 0, f"sync: every replica served every sync version when its step ended (max lag "
                             f"{sync_lag:.0f}, must be 0): the pushes were delivered")
        p1.close()
        del p1
        for s in servers:
            forget_group(s)
        for s in servers[1:]:
            stop_server(s)

        # ---- 2. slow replica
        fast = servers[0]
        p2 = new_pusher([fast.url, slow.url], tr.version)
        run_block(tr, p2, "async", 3, guard_s)  # new communicators form here
        before = p2.skipped_versions
        slow_recs = run_block(tr, p2, "async", args.slow_steps, guard_s)
        slow_row = Row("async, r1 slowed", slow_recs, p2.skipped_versions - before, 2)
        results.append(slow_row)
        async_med = results[2].median
        ratio = slow_row.median / async_med
        fast_lag = max(r["push/replica0_version_lag"] for r in slow_recs)
        # With a transfer shorter than a step (NCCL) the unslowed lag is 1. When one
        # takes many steps (gloo on one GPU) every replica lags that many versions
        # anyway: the slowed peer must not add to it.
        lag_bound = max([1.0] + [r["push/replica0_version_lag"] for r in recs["async"]
                                 if "push/replica0_version_lag" in r])
        st = {x["url"]: x for x in p2.status()}
        check(ratio <= args.max_slow_ratio,
              f"slow replica: async step time with one replica slowed x{args.slow_factor:g} is "
              f"x{ratio:.3f} of the unslowed async run (<= {args.max_slow_ratio})")
        check(fast_lag <= lag_bound, f"slow replica: fast replica max version lag {fast_lag:.0f} (<= {lag_bound:.0f}, "
                                     f"its max in the unslowed async run, or 1); slow replica max "
                             f"lag {slow_row.lag(1)}, {st[slow.url]['transfers']} transfers for "
                             f"{args.slow_steps + 3} versions, no ejection: {slow.url not in events.ejected}")
        print_table(results, "# interim: + slow replica", lags)

        # ---- 3. kill the slow replica mid-transfer
        t_wait = time.monotonic()
        while not p2.replicas[1].busy and time.monotonic() - t_wait < 30:
            run_block(tr, p2, "async", 1, guard_s)
        before = p2.skipped_versions
        in_flight = p2.replicas[1].busy
        slow.proc.kill()
        t_kill = time.monotonic()
        slow.proc.wait()
        kill_recs: list[dict] = []
        version_at_kill = tr.version
        while (len(kill_recs) < args.after_kill_steps or slow.url not in events.ejected) and \
                time.monotonic() - t_kill < args.deadline_s + 30:
            kill_recs += run_block(tr, p2, "async", 1, guard_s)
        ejected_after = events.ejected.get(slow.url, math.inf) - t_kill
        check(in_flight, f"kill: SIGKILL while a transfer to the replica was in flight: {in_flight}")
        check(ejected_after <= args.deadline_s,
              f"kill: replica ejected {ejected_after:.2f}s after SIGKILL (deadline {args.deadline_s:g}s)")
        worst = max(r["step_s"] for r in kill_recs)
        check(worst < args.deadline_s,
              f"kill: trainer kept stepping: {len(kill_recs)} steps after the kill, median "
              f"{statistics.median(r['step_s'] for r in kill_recs) * 1e3:.1f} ms (unslowed async "
              f"{async_med * 1e3:.1f} ms), max {worst * 1e3:.1f} ms (< deadline {args.deadline_s:g}s)")
        restarted = start_server(model_dir, server_device, server_dtype, args.log_dir, port=slow.port)
        everything.append(restarted)
        t_restart = time.monotonic()
        restart_budget = 90
        while slow.url not in events.readmitted and time.monotonic() - t_restart < restart_budget:
            if restarted.proc.poll() is not None:
                raise RuntimeError(f"restarted server exited:\n{log_tail(restarted.log)}")
            kill_recs += run_block(tr, p2, "async", 1, guard_s)
        readmitted = slow.url in events.readmitted
        results.append(Row("async, r1 killed + restarted", kill_recs, p2.skipped_versions - before, 2))
        versions, problem = {}, ""
        try:
            if readmitted:
                # The newest async version may have been skipped (every staging buffer
                # busy: a transfer longer than a step, as over gloo on one GPU). A
                # run's last push waits, as grpo_train.py's does, so it is delivered.
                run_block(tr, p2, "sync", 1, guard_s)
                drain(p2, 60)
                versions = {u: served_version(s) for u, s in ((fast.url, fast), (slow.url, restarted))}
        except Exception as e:  # noqa: BLE001  (reported in the verdict)
            problem = f"; {type(e).__name__}: {e}"
        latest = tr.version
        check(readmitted and versions.get(slow.url) == str(latest) and versions.get(fast.url) == str(latest),
              f"kill: restarted replica readmitted {events.readmitted.get(slow.url, math.inf) - t_restart:.1f}s "
              f"after the restart (killed at version {version_at_kill}); served versions {versions} == "
              f"latest {latest}{problem}")
        p2.close()

        ack = "" if args.ack_posted else ", ack_posted off"
        print_table(results, f"# step time: trainer on {device}, {backend} push to built-in servers on "
                             f"{server_device} ({server_dtype}), staging {args.staging}{ack}; vs off = median / median(off); r0, r1 = the "
                             f"run's first and second replica (slowed / killed: r1)", lags)
        for ok, msg in checks:
            print(("PASS " if ok else "FAIL ") + msg)
        print(f"# total {time.monotonic() - t_start:.0f}s", flush=True)
        return 0 if all(ok for ok, _ in checks) else 1
    finally:
        faulthandler.cancel_dump_traceback_later()
        for s in everything:
            stop_server(s)
        loop.close()


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:  # noqa: BLE001  (print it, then exit without waiting for threads)
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # A reconnect attempt of the pusher may still sit in a gloo rendezvous
    # (it times out after init_timeout_s); do not wait for it at exit.
    os._exit(code)
