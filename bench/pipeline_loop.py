"""Serial vs pipelined GRPO loop on the same workload, in one run.

    python bench/pipeline_loop.py --cpu                # tiny Qwen3, digits task, 1 and 2 CPU servers
    python bench/pipeline_loop.py --one-gpu            # Qwen3-0.6B shape, trainer + server on cuda:0, ipc push
    python bench/pipeline_loop.py --two-gpu            # the same model, trainer on cuda:0, server on cuda:1, NCCL push

Each row is one real ``grpo_train.py`` run under torchrun, against built-in
servers this script starts fresh for it (a server keeps the weights a run
pushed, so runs never share one). "serial" is ``rollout.pipeline_depth 0``,
"pipelined" depth 1; both push in ``weight_sync.mode async``, so the overlap
of generation and training is the only difference. Per run, after
``--warmup`` steps:

* trained samples/s: samples trained / wall time of those steps;
* wait, train: the trainer's wait for data and the rest of its step (train,
  push, log); in the serial loop the wait is the generation;
* ideal: ``(wait + train) / max(wait, train)`` from the serial run's own
  phase times, the speed-up a perfect overlap would give;
* "of ideal": pipelined samples/s / (serial samples/s x ideal); the
  target is >= 0.9;
* push stall: what the snapshot cost the trainer's thread per step; lag: how
  many versions the first server was behind when the step was logged;
* per run (its summary line): the train step's wall time, its training
  thread's CPU time (wall minus it: the thread off the CPU, waiting for the
  GIL or a core; on a GPU also a sync that blocks rather than spins) and the
  CPU time of the trainer process's other threads meanwhile (the push's, the
  rollouts');
* CPU seconds per step of the trainer's processes and of the servers, the
  GPU's busy fraction on a GPU (bench/step_usage.py), and the box bound: the
  ideal capped by what shared hardware allows, serial step x cores / serial
  CPU s per step on CPU, 1 / serial busy fraction on one GPU (two processes'
  kernels take turns), the ideal itself on two GPUs (nothing is shared but
  the host's 16+ cores; both GPUs' busy fractions are printed); "of bound"
  is the pipelined gain's share of it.

"serial-N-sync" is the serial loop with a synchronous push: on CPU the demo
as shipped, the baseline of "the demo's loop time pipelined vs serial"; on a
GPU (only when ``--only`` names it, like "serial-N-in-place", the async push
installed between decode steps) the serial step with no version installed
while it generates.

"pipelined-N-real-order" repeats the pipelined run with the weight push in
the order a real SGLang gets it (``weight_sync.pipeline_requests`` and
``ack_posted`` off: one request after another's reply).

"pipelined-N-in-process" runs the rollout client in the trainer's process
(``rollout.client_process off``); pipelined rows otherwise run it in a
process of its own (the default when pipelined).

"serial-N-push-off" and "pipelined-N-push-off" (only when ``--only`` names
them) run with ``weight_sync.mode off``; the pipelined one is compared with
the serial one without the push.

The slow-replica rows (``--slow-factor``, default 10) start the second of two
servers with ``--debug-decode-delay-s`` set so that its groups take about
slow-factor times as long (from the 2-fast-server run's measured group
latency), and print pipelined and serial samples/s as fractions of the
2-fast-server pipelined figure (target: pipelined >= 0.45).

Also printed: each run's first and last 10 steps' mean reward (the CPU demo
must still learn pipelined) and the loop's wall time.

``--repeats N`` runs the rows N times, one pass after another, and ends with
each pipelined row's x serial, of ideal and of bound per pass and their
median: on a box whose speed drifts between passes (the 2-core CPU box) one
pass does not settle a target.

``--concurrent-runs N`` runs N rows at once (the suite's smoke test: every
row's code path in less time); their figures then share the machine and
mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.step_usage import StepUsageMeter, cores  # noqa: E402
from torchtitan_grpo.fleet.launcher import ServerSpec, log_tail, start_servers, stop_process  # noqa: E402


def server_specs(args, delays: list[float]) -> list[ServerSpec]:
    """One built-in server per entry of ``delays`` (its --debug-decode-delay-s)."""
    return [ServerSpec(args.model_dir, device=args.server_device, dtype=args.server_dtype,
                       extra_args=("--num-threads", "1", *(("--debug-decode-delay-s", f"{d:.6f}") if d > 0 else ()),
                                   *shlex.split(args.server_args)))
            for d in delays]


# --------------------------------------------------------------------- one run


@dataclass
class Run:
    name: str
    rows: list[dict]
    warmup: int
    wall_s: float
    usage: dict[str, float]
    """After the warm-up: CPU seconds per step ("trainer", "servers") and the
    GPU's busy fraction ("gpu_busy"); empty if not measured."""

    def _after(self) -> list[dict]:
        return self.rows[self.warmup:]

    def mean(self, key: str) -> float:
        vals = [r.get(key, 0.0) for r in self._after()]
        return statistics.fmean(vals) if vals else float("nan")

    @property
    def samples_per_s(self) -> float:
        rows = self._after()
        t = sum(r["time/step_s"] for r in rows)
        return sum(r["offpolicy/kept_samples"] for r in rows) / t if t > 0 else float("nan")

    @property
    def wait_s(self) -> float:
        return self.mean("time/wait_s")

    @property
    def rest_s(self) -> float:
        return self.mean("time/step_s") - self.wait_s

    def reward(self, first: bool) -> float:
        rows = self.rows[:10] if first else self.rows[-10:]
        return statistics.fmean(r["reward/mean"] for r in rows)


def train(args, name: str, depth: int, delays: list[float], extra: tuple[str, ...] = (), out: str = "") -> Run:
    dump = os.path.join(out or args.out, name)
    shutil.rmtree(dump, ignore_errors=True)
    os.makedirs(dump)
    servers = start_servers(server_specs(args, delays), dump, timeout_s=600)  # each answers /health
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
               os.path.join(ROOT, "grpo_train.py"), "--job.config_file", args.config,
               "--job.dump_folder", dump, "--model.hf_assets_path", args.model_dir,
               "--inference.urls", ",".join(s.url for s in servers),
               "--weight_sync.mode", "async", "--weight_sync.transport", args.transport,
               "--rollout.pipeline_depth", str(depth), "--training.steps", str(args.steps), *args.extra, *extra]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
        t0 = time.perf_counter()
        with open(os.path.join(dump, "train.log"), "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            meter = StepUsageMeter(os.path.join(dump, "metrics.jsonl"), args.warmup,
                                 [s.proc.pid for s in servers], proc.pid, gpus=args.gpus)
            try:
                rc = proc.wait(timeout=args.run_timeout_s)
            finally:
                if proc.poll() is None:
                    stop_process(proc)
                usage = meter.per_step()
        wall = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"run {name} failed (exit {rc}):\n{log_tail(os.path.join(dump, 'train.log'), 40)}")
    finally:
        for srv in servers:
            stop_process(srv.proc)
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    run = Run(name, rows, min(args.warmup, len(rows) - 1), wall, usage)
    print(f"# {name}: {len(rows)} steps in {wall:.1f} s, {run.samples_per_s:.1f} samples/s, "
          f"wait {run.wait_s:.3f} s, rest {run.rest_s:.3f} s; "
          f"per train step (ms): wall {run.mean('time/train_s') * 1e3:.1f}, training thread on CPU {run.mean('cpu/train_thread_s') * 1e3:.1f}, the process's other threads "
          f"{run.mean('cpu/other_threads_s') * 1e3:.1f}", flush=True)
    return run


# --------------------------------------------------------------------- table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--cpu", action="store_true", help="tiny Qwen3, digits task, CPU servers, gloo push")
    mode.add_argument("--one-gpu", action="store_true",
                      help="Qwen3-0.6B shape (random weights), trainer and bf16 server on cuda:0, ipc push")
    mode.add_argument("--two-gpu", action="store_true",
                      help="the same model, trainer on cuda:0 and bf16 server(s) on cuda:1, NCCL push")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (CPU 150, GPU 12)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of the figures (CPU 5, GPU 3)")
    ap.add_argument("--replicas", default=None, help="comma-separated server counts (CPU '1,2', GPU '1')")
    ap.add_argument("--slow-factor", type=float, default=10.0, help="0: no slow-replica rows")
    ap.add_argument("--model-dir", default=None, help="HF model dir (written if missing)")
    ap.add_argument("--out", default=os.path.join(ROOT, "outputs", "bench_pipeline"))
    ap.add_argument("--server-args", default="",
                    help="more built-in server flags, e.g. '--kv-cache dynamic' (the engine before the static cache)")
    ap.add_argument("--run-timeout-s", type=float, default=1800.0)
    ap.add_argument("--concurrent-runs", type=int, default=1,
                    help="rows run at once (each with its own servers); >1 only where the figures do not "
                         "matter (the suite's smoke test): concurrent runs share the CPU")
    ap.add_argument("--only", default="", help="comma-separated row names to run (default: all)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the rows this many times (the slow-replica rows once) and print each pipelined "
                         "row's shares per repeat and their median")
    ap.add_argument("extra", nargs="*", help="more grpo_train.py overrides, after --")
    args = ap.parse_args(argv)

    from torchtitan_grpo.models.demo_assets import QWEN3_0_6B, TinyQwen3, ensure_tiny_qwen3

    gpu = "two" if args.two_gpu else "one" if args.one_gpu else ""  # print_table's mode; "" on CPU
    args.steps = args.steps or (12 if gpu else 150)
    args.warmup = args.warmup if args.warmup is not None else (3 if gpu else 5)
    replicas = [int(x) for x in (args.replicas or ("1" if gpu else "1,2")).split(",")]
    args.model_dir = args.model_dir or os.path.join(args.out, "qwen3-0.6b-shape" if gpu else "tiny-qwen3")
    ensure_tiny_qwen3(args.model_dir, QWEN3_0_6B if gpu else TinyQwen3())
    os.makedirs(args.out, exist_ok=True)
    if gpu:
        args.config = os.path.join(ROOT, "train_configs", "bench_pipeline_gpu.toml")
        args.server_device, args.server_dtype = ("cuda:1" if gpu == "two" else "cuda:0"), "bfloat16"
        args.transport = "nccl" if gpu == "two" else "ipc"
        args.gpus = (0, 1) if gpu == "two" else (0,)
    else:
        args.config = os.path.join(ROOT, "train_configs", "demo_cpu.toml")
        args.server_device, args.server_dtype, args.transport = "cpu", "float32", "gloo"
        args.gpus = ()

    # (name, pipeline depth, per-server decode delays, extra overrides), in table order
    plan: list[tuple[str, int, list[float], tuple[str, ...]]] = []
    for n in replicas:
        for depth, loop in ((0, "serial"), (1, "pipelined")):
            plan.append((f"{loop}-{n}", depth, [0.0] * n, ()))
    n = replicas[0]
    # The serial loop with a synchronous push (exactly on-policy): the demo as
    # shipped, and on a GPU the serial step without a version installed while
    # it generates.
    sync = (f"serial-{n}-sync", 0, [0.0] * n, ("--weight_sync.mode", "sync"))
    # Serial, async push installed between decode steps (in_place) rather
    # than after the running batch drains (the serial default, "none").
    in_place = (f"serial-{n}-in-place", 0, [0.0] * n, ("--weight_sync.pause_mode", "in_place"))
    if not gpu:
        plan.append(sync)
    elif args.only:  # on a GPU only when named: the default plan fits the device scripts' budgets
        plan += [sync, in_place]
    # What a real SGLang gets: one request after another's reply, no early answers.
    plan.append((f"pipelined-{n}-real-order", 1, [0.0] * n,
                 ("--weight_sync.no-pipeline-requests", "--weight_sync.no-ack-posted")))
    # The rollout client in the trainer's process (pipelined, its default is a process of its own).
    plan += [(f"pipelined-{k}-in-process", 1, [0.0] * k, ("--rollout.client_process", "off")) for k in replicas]
    if args.only:
        # No weight push at all, each pipelined row against the serial one without it: what the
        # push costs the overlap (only when named).
        plan += [(f"{loop}-{k}-push-off", depth, [0.0] * k, ("--weight_sync.mode", "off"))
                 for k in replicas for depth, loop in ((0, "serial"), (1, "pipelined"))]
        plan = [p for p in plan if p[0] in args.only.split(",")]
    shares = []  # per repeat: pipelined row -> (x serial, of ideal, of bound)
    for rep in range(args.repeats):
        out = args.out if args.repeats == 1 else os.path.join(args.out, f"repeat{rep + 1}")
        if args.repeats > 1:
            print(f"# repeat {rep + 1} of {args.repeats}", flush=True)
        # the slow-replica rows once: they compare loops, not passes
        runs = run_plan(args, plan, out, slow=rep == 0)
        shares.append(print_table(runs, gpu))
    if args.repeats > 1:
        print_spread(shares)
    return 0


def run_plan(args, plan, out: str, slow: bool) -> dict[str, Run]:
    """Every row of ``plan``, then (``slow``) the slow-replica rows."""
    if args.concurrent_runs > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(args.concurrent_runs) as pool:
            done = list(pool.map(lambda p: train(args, p[0], p[1], p[2], p[3], out), plan))
    else:
        done = [train(args, name, depth, delays, extra, out) for name, depth, delays, extra in plan]
    runs: dict[str, Run] = {r.name: r for r in done}
    slow_delay = 0.0
    if slow and args.slow_factor > 0 and "pipelined-2" in runs:
        fast = runs["pipelined-2"]
        latency = fast.mean("rollout/group_latency_s")
        tokens = max(fast.mean("rollout/completion_len"), 1.0)
        # The delay is per decode step of the slow server's batch: a group of
        # `tokens` steps then takes about slow_factor times its fast latency.
        slow_delay = (args.slow_factor - 1) * latency / tokens
        print(f"# slow replica: --debug-decode-delay-s {slow_delay:.4f} (fast group latency {latency:.3f} s, "
              f"{tokens:.1f} tokens per completion)", flush=True)
        for depth, loop in ((0, "serial"), (1, "pipelined")):
            runs[f"{loop}-2-slow"] = train(args, f"{loop}-2-slow", depth, [0.0, slow_delay], out=out)

    return runs


def print_table(runs: dict[str, Run], gpu: str = "") -> dict[str, tuple[float, float, float]]:
    """The table of one pass (``gpu``: "" on CPU, "one" or "two" GPUs);
    returns each pipelined row's (x serial, of ideal, of bound)."""
    shares = {}
    ncores = cores()
    print()
    print("| run | steps | samples/s | step s | wait s | train+push s | push stall ms | lag | ideal x | x serial | of ideal | "
          "cpu s/step trainer + servers | GPU busy | box bound x | of bound | reward first 10 | last 10 | loop s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in runs.items():
        serial = runs.get(name.replace("pipelined", "serial").replace("-real-order", "").replace("-in-process", "").replace("-sync", "")
                          .replace("-in-place", ""))
        ideal = (serial.wait_s + serial.rest_s) / max(serial.wait_s, serial.rest_s) if serial else float("nan")
        gain = r.samples_per_s / serial.samples_per_s if serial else float("nan")
        # On shared cores a step takes at least (CPU s per step) / cores, and on
        # one shared GPU (kernels of two processes take turns) at least its busy
        # time: the overlap can give at most serial step / that.
        box = float("nan")
        if serial and gpu == "two":
            box = ideal  # the phases run on different GPUs: nothing they need is shared
        elif serial and gpu and "gpu_busy" in serial.usage:
            box = min(ideal, 1.0 / max(serial.usage["gpu_busy"], 1e-9))
        elif serial and serial.usage and not gpu:
            box = min(ideal, serial.mean("time/step_s") * ncores / (serial.usage["trainer"] + serial.usage["servers"]))
        pipelined = name.startswith("pipelined")
        if pipelined:
            shares[name] = (gain, gain / ideal, gain / box)
        cpu = f"{r.usage['trainer']:.3f} + {r.usage['servers']:.3f}" if r.usage else ""
        busy = " / ".join(f"{v:.0%}" for k, v in r.usage.items() if k.endswith("_busy"))
        loop_s = sum(x["time/step_s"] for x in r.rows)
        print(f"| {name} | {len(r.rows)} | {r.samples_per_s:.1f} | {r.mean('time/step_s'):.3f} | {r.wait_s:.3f} | "
              f"{r.rest_s:.3f} | {r.mean('time/push_stall_s') * 1e3:.1f} | {r.mean('push/replica0_version_lag'):.1f} | {ideal:.2f} | {gain:.2f} | "
              f"{gain / ideal if pipelined else float('nan'):.2f} | {cpu} | {busy} | {box:.2f} | "
              f"{gain / box if pipelined else float('nan'):.2f} | "
              f"{r.reward(True):.3f} | {r.reward(False):.3f} | {loop_s:.1f} |")
    print(f"\nbox bound = min(ideal, serial step s x cores / serial CPU s per step) on CPU ({ncores} cores), "
          f"min(ideal, 1 / serial GPU busy fraction) on one GPU: the most an overlap can give when the trainer "
          f"and the servers share the cores or the GPU; the ideal on two GPUs (GPU busy: trainer's / server's)")
    if "pipelined-2-slow" in runs:
        base = runs["pipelined-2"].samples_per_s
        lat = [runs["pipelined-2-slow"].mean(f"pool/replica{i}_latency_s") for i in (0, 1)]
        print(f"\nslow replica (group latency {lat[1]:.3f} s against {lat[0]:.3f} s, {lat[1] / max(lat[0], 1e-9):.1f}x): "
              f"pipelined {runs['pipelined-2-slow'].samples_per_s / base:.2f} x and serial "
              f"{runs['serial-2-slow'].samples_per_s / base:.2f} x of the 2-fast-replica pipelined samples/s")
    return shares


def print_spread(shares: list[dict[str, tuple[float, float, float]]]) -> None:
    """Each pipelined row over the repeats. A pass's figures move with the
    box's speed; each repeat compares rows run back to back, and the median
    over repeats is what a target can be read from."""
    print()
    print("| run | repeats | x serial, each | of ideal, each | median of ideal | of bound, each | median of bound |")
    print("| --- | ---: | --- | --- | ---: | --- | ---: |")
    for name in shares[0]:
        got = [s[name] for s in shares if name in s]
        each = [" ".join(f"{g[k]:.2f}" for g in got) for k in range(3)]
        print(f"| {name} | {len(got)} | {each[0]} | {each[1]} | {statistics.median(g[1] for g in got):.2f} | "
              f"{each[2]} | {statistics.median(g[2] for g in got):.2f} |")


if __name__ == "__main__":
    sys.exit(main())
