"""Where a decode step's time goes, in the built-in engine (and optionally a
real vLLM), and what the HTTP replies cost on the host (issue 50).

Decode profile. The engine runs in this process on a random-weight Qwen3 of
``--shape`` (``bench/engine_vs_vllm.py``'s model files: bf16, word-level
tokenizer), ``--seqs`` sequences as requests of n=8, temperature 1, logprobs
on, every sample forced long enough. After ``--warm-steps`` decode steps
(default 512: the profiled context, prompt 128 + 512, is about the mean
context of a 1,024-token sample) the torch profiler (CPU + CUDA) records
``--steps`` steps. From its chrome trace, per decode step:

  GEMM        matmul kernels (cuBLAS / CUTLASS / nvjet names)
  attention   attention kernels (flash / fmha / sdpa / paged decode names)
  sampling    kernels launched by the engine's sampling, other than ...
  logprobs    ... log-softmax, gather and top-k (the logprob extraction; at
              temperature 1 the sampling draws from the same log-softmax)
  copies      memcpy / memset (the step's host copies of tokens and logprobs)
  other       every other kernel (norms, rotary, activations, elementwise)
  GPU idle    step wall time minus GPU busy time (the union of the above):
              CPU-side launches and host gaps the GPU waits through

plus kernel launches per step (launch calls; graph launches apart), graph
coverage (share of kernel time and count replayed from CUDA graphs) and the
HBM roofline step, (weight bytes + KV bytes read) / ``--hbm-tbps``, beside
the step time measured without the profiler. Our kernels go to forward or
sampling by the ``record_function`` range (the bench wraps the engine's
methods) their launch sat in; vLLM's by kernel name alone.

vLLM (``--engines ours,vllm``, ``--vllm-seqs``): vLLM 0.26 started with
``--profiler-config`` (torch, ``delay_iterations`` = warm steps,
``max_iterations`` = steps), ``/start_profile`` as the same requests are
sent; its worker's trace summarised the same way. A vLLM start: ~100-130 s.

Reply side (``--reply-lengths``): the host time of building each route's
JSON reply for 64 samples (``--reply-seqs``) of 128 / 1,024 tokens, logprobs
on: the route's own builder as its handler calls it (garbage collector held
off, ``httputil.gc_paused``), then ``json.dumps`` (what aiohttp's
``json_response`` runs); "cold" with the engine's token-text cache empty
(a random-weight model samples mostly new ids), "warm" after.

  python bench/engine_profile.py --shape 0.6b --seqs 64,256 --out OUT     # one H200, ~40 s
  python bench/engine_profile.py --cpu --out OUT                          # tiny, CPU: checks the script
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torchtitan_grpo  # noqa: E402,F401  (before torchtitan)

from bench.engine_vs_vllm import SHAPES, write_model  # noqa: E402
from bench.reply_cost import reply_rows, reply_table  # noqa: E402
from bench.paged_speed import N_PER_PROMPT, make_prompts  # noqa: E402

CATEGORIES = ("GEMM", "attention", "sampling", "logprobs", "copies", "other")
ATTENTION = re.compile(r"flash|fmha|attn|attention|sdpa|paged|_split_kernel|_merge_kernel|reshape_and_cache", re.I)
GEMM = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma|matmul|aten::(mm|addmm|bmm|linear)$", re.I)
LOGPROBS = re.compile(r"log_?softmax|gather|topk|top_k", re.I)
SAMPLING = re.compile(r"exponential|distribution|argmax|multinomial|sampl|sort|cumsum|searchsorted|uniform|philox|softmax",
                      re.I)
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
            "cudaMemcpyAsync", "cudaMemsetAsync")
REGION = "profile:"
"""Prefix of the bench's record_function ranges around the engine's methods."""


# ---- trace analysis ----------------------------------------------------------- #


@dataclass
class DeviceEvent:
    """One kernel / copy (or, on a CPU, one top-level op) of the trace."""

    name: str
    ts: float
    dur: float
    region: str | None
    """The bench's range that launched it ("forward", "sample"), None if unknown."""
    graph: bool = False
    copy: bool = False


def classify(e: DeviceEvent) -> str:
    """The breakdown's category of one event: by launching range where known, else by name."""
    if e.copy:
        return "copies"
    if e.region == "sample" or e.region is None:
        if LOGPROBS.search(e.name):
            return "logprobs"
        if e.region == "sample" or (SAMPLING.search(e.name) and not ATTENTION.search(e.name)):
            return "sampling"
    if ATTENTION.search(e.name):
        return "attention"
    if GEMM.search(e.name):
        return "GEMM"
    return "other"


def load_trace(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def ranges(trace: dict, steps: bool = False) -> dict[Any, tuple[list[float], list[tuple[float, float, str]]]]:
    """The bench's ranges per thread, (sorted starts, [(start, end, name)]): the
    forward / sample / record ranges (disjoint), or with ``steps`` the step ranges."""
    by_tid: dict[Any, list[tuple[float, float, str]]] = {}
    for ev in trace.get("traceEvents", []):
        name = str(ev.get("name", ""))
        if ev.get("ph") != "X" or not name.startswith(REGION) or ev.get("cat") == "gpu_user_annotation":
            continue
        if (name == REGION + "step") == steps:
            by_tid.setdefault(ev.get("tid"), []).append((ev["ts"], ev["ts"] + ev["dur"], name[len(REGION):]))
    return {tid: ([r[0] for r in sorted(rs)], sorted(rs)) for tid, rs in by_tid.items()}


def region_at(index: dict, tid: Any, ts: float) -> str | None:
    """The bench range on thread ``tid`` that holds time ``ts`` (forward / sample / record), if any."""
    starts, rs = index.get(tid, ([], []))
    i = bisect.bisect_right(starts, ts) - 1
    return rs[i][2] if i >= 0 and ts <= rs[i][1] else None


def gpu_events(trace: dict) -> list[DeviceEvent]:
    """Kernels, copies and sets, each with the range its launch call sat in and whether a graph ran it."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    launch = {e["args"]["correlation"]: e for e in evs
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    index = ranges(trace)
    out = []
    for e in evs:
        cat = e.get("cat")
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        call = launch.get(e.get("args", {}).get("correlation"))
        graph = bool(e.get("args", {}).get("graph node id")) or (call is not None and call["name"] == "cudaGraphLaunch")
        region = region_at(index, call.get("tid"), call["ts"]) if call is not None else None
        out.append(DeviceEvent(e["name"], e["ts"], e["dur"], region, graph, cat != "kernel"))
    return out


def cpu_events(trace: dict) -> list[DeviceEvent]:
    """On a CPU: the top-level aten ops inside the bench's forward / sample ranges stand for kernels."""
    index = ranges(trace)
    ops = sorted((e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "cpu_op"),
                 key=lambda e: (e["ts"], -e["dur"]))
    out, open_until = [], {}
    for e in ops:
        tid = e.get("tid")
        if e["ts"] < open_until.get(tid, -1.0):
            continue  # nested in an op already counted
        open_until[tid] = e["ts"] + e["dur"]
        region = region_at(index, tid, e["ts"])
        if region is not None:
            out.append(DeviceEvent(e["name"], e["ts"], e["dur"], region))
    return out


def busy_time(events: list[DeviceEvent], lo: float, hi: float) -> float:
    """Length of the union of the events' intervals, clipped to [lo, hi]."""
    total, end = 0.0, lo
    for e in sorted(events, key=lambda e: e.ts):
        s, f = max(e.ts, end), min(e.ts + e.dur, hi)
        if f > s:
            total += f - s
            end = f
    return total


def step_window(trace: dict, events: list[DeviceEvent], steps_hint: int = 0) -> tuple[float, float, int]:
    """(start, end, steps) of the steady window: from the first to the last
    ``profile:step`` range start but the first (ours: the profiler's start
    is in it), else between the first and last
    log-softmax kernel (one per step while logprobs are on: vLLM), else the
    span of every event as ``steps_hint`` steps."""
    starts = sorted(s for ss, _ in ranges(trace, steps=True).values() for s in ss)[1:]  # the first holds the start
    if len(starts) < 2:
        starts = sorted(e.ts for e in events if re.search(r"log_?softmax", e.name, re.I))
    if len(starts) < 2 and steps_hint and events:
        return min(e.ts for e in events), max(e.ts + e.dur for e in events), steps_hint
    if len(starts) < 2:
        raise RuntimeError("the trace holds fewer than 2 decode steps")
    return starts[0], starts[-1], len(starts) - 1


def summarize(trace: dict, cpu: bool = False, steps_hint: int = 0) -> dict:
    """One decode step's breakdown (µs per step) from a torch-profiler chrome trace."""
    events = cpu_events(trace) if cpu else gpu_events(trace)
    lo, hi, steps = step_window(trace, events, steps_hint)
    inside = [e for e in events if lo <= e.ts < hi]
    per_cat = dict.fromkeys(CATEGORIES, 0.0)
    for e in inside:
        per_cat[classify(e)] += e.dur / steps
    wall = (hi - lo) / steps
    busy = busy_time(inside, lo, hi) / steps
    kernels = [e for e in inside if not e.copy]
    in_graph = [e for e in kernels if e.graph]
    calls = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("name") in LAUNCHES
             and lo <= e["ts"] < hi]
    return {
        "steps": steps, "step_us": wall, "busy_us": busy, "idle_us": max(wall - busy, 0.0), "by_category_us": per_cat,
        "kernels_per_step": len(kernels) / steps,
        "launch_calls_per_step": sum(c["name"] != "cudaGraphLaunch" for c in calls) / steps,
        "graph_launches_per_step": sum(c["name"] == "cudaGraphLaunch" for c in calls) / steps,
        "graph_share_time": sum(e.dur for e in in_graph) / max(sum(e.dur for e in kernels), 1e-9),
        "graph_share_count": len(in_graph) / max(len(kernels), 1),
        "top_kernels": top_kernels(inside, steps),
    }


def top_kernels(events: list[DeviceEvent], steps: int, n: int = 12) -> list[tuple[str, str, float, float]]:
    """The ``n`` names with the most time: (category, name, µs per step, calls per step)."""
    agg: dict[str, list[float]] = {}
    for e in events:
        a = agg.setdefault(e.name, [0.0, 0.0, classify(e)])
        a[0] += e.dur
        a[1] += 1
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])[:n]
    return [(a[2], name[:90], a[0] / steps, a[1] / steps) for name, a in rows]


# ---- roofline ----------------------------------------------------------------- #


def kv_bytes_per_token(model_dir: str) -> int:
    """Bytes of K and V one position holds over all layers (bf16)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2


def roofline_us(weight_bytes: int, kv_token: int, seqs: int, context: int, tbps: float) -> tuple[float, float]:
    """(µs per decode step at the HBM bound, KV bytes read) for ``seqs`` rows at ``context`` positions."""
    kv = seqs * context * kv_token
    return (weight_bytes + kv) / (tbps * 1e12) * 1e6, kv


# ---- our engine ----------------------------------------------------------------- #


class StepProfiler:
    """Wraps an engine's decode step, forward, sampling and bookkeeping in
    ``record_function`` ranges and runs the torch profiler on the engine's own
    worker thread for ``steps`` decode steps after ``warm`` of them (the
    profiler then sees that thread's ranges); also times the unprofiled steps."""

    def __init__(self, engine: Any, warm: int, steps: int, cuda: bool, trace_path: str):
        self.engine, self.warm, self.steps, self.cuda, self.trace_path = engine, warm, steps, cuda, trace_path
        self.count = 0
        self.plain_starts: list[float] = []
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._prof: Any = None
        self._wrap(engine, "_decode_step", "step", self._around_step)
        self._wrap(engine._batch, "decode", "forward")
        self._wrap(engine, "_launch", "sample")
        self._wrap(engine, "_record", "record")

    @staticmethod
    def _wrap(obj: Any, attr: str, name: str, around: Callable | None = None) -> None:
        import torch

        inner = getattr(obj, attr)

        def wrapped(*a: Any, **kw: Any) -> Any:
            if around is not None:
                around()
            with torch.profiler.record_function(REGION + name):
                return inner(*a, **kw)

        setattr(obj, attr, wrapped)

    def _around_step(self) -> None:
        """Before each decode step: time it, start or stop the profiler at the window's edges."""
        import torch

        self.count += 1
        try:
            if self.count <= self.warm:
                self.plain_starts.append(time.perf_counter())
            elif self.count == self.warm + 1:
                self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if self.cuda else []))
                self._prof.__enter__()
            elif self.count == self.warm + self.steps + 3 and self._prof is not None:
                if self.cuda:
                    torch.cuda.synchronize()
                self._prof.__exit__(None, None, None)
                self._prof.export_chrome_trace(self.trace_path)
                self._prof = None
                self.done.set()
        except BaseException as e:  # noqa: BLE001 - reported by the caller, the engine goes on
            self.error = e
            self.done.set()

    def plain_step_us(self) -> float:
        """Mean decode step time over the last half of the unprofiled steps (steady, no profiler)."""
        s = self.plain_starts[len(self.plain_starts) // 2:]
        return (s[-1] - s[0]) / (len(s) - 1) * 1e6 if len(s) > 1 else float("nan")


def warm_up_profiler(cuda: bool) -> None:
    """An empty profile on this thread first: kineto initialises its client on
    the thread that first profiles and refuses to from another (the worker)."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts):
        torch.zeros(1, device="cuda" if cuda else "cpu").add_(1)


def profile_ours(model_dir: str, args: argparse.Namespace, seqs: int, vocab: int, out: str) -> dict:
    """Steady decode of ``seqs`` sequences, ``args.steps`` of them profiled; the summary dict."""
    from torchtitan_grpo.server.engine.engine import Engine, EngineConfig
    from torchtitan_grpo.server.engine.requests import SamplingParams

    new, gpu = args.warm_steps + args.steps + 8, args.device != "cpu"  # decode steps: new - 1
    # As bench/engine_vs_vllm.py's server runs it: bf16 on a GPU (static cache, decode graphs), float32 on a CPU.
    eng = Engine(EngineConfig(model_dir, device=args.device, dtype="bfloat16" if gpu else "float32",
                              max_batch_size=seqs, max_model_len=args.prompt_len + new + 8, kv_cache=args.kv_cache))
    trace_path = os.path.join(out, f"trace-ours-{args.shape}-{seqs}-{args.kv_cache}.json")
    hook = StepProfiler(eng, args.warm_steps, args.steps, gpu, trace_path)
    params = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True, n=N_PER_PROMPT)
    futures = [eng.submit(p, params, top_logprobs_num=args.top_logprobs)
               for p in make_prompts(seqs, args.prompt_len, vocab)]
    warm_up_profiler(gpu)
    eng.start()  # every request queued first: one prefill, then steady decode
    try:
        for f in futures:
            f.result(timeout=args.step_timeout_s)
    finally:
        eng.shutdown()
    if hook.error is not None or not hook.done.is_set():
        raise RuntimeError(f"profiling failed: {hook.error!r}")
    summary = summarize(load_trace(trace_path), cpu=not gpu)
    summary["plain_step_us"] = hook.plain_step_us()
    summary["graphs"] = bool(getattr(eng._batch, "graphs", False))
    summary["late_captures"] = getattr(eng._batch, "late_captures", 0)
    return summary


# ---- vLLM ---------------------------------------------------------------------- #


def profile_vllm(model_dir: str, args: argparse.Namespace, seqs: int, vocab: int, out: str) -> dict:
    """vLLM with its torch profiler on ``args.steps`` decode steps after ``args.warm_steps``; the summary dict."""
    import asyncio
    import glob
    import shlex
    import subprocess
    import urllib.request

    from bench.engine_vs_vllm import Server, healthy, request_body, run_requests, stop, vllm_shell
    from torchtitan_grpo.fleet.launcher import log_tail
    from torchtitan_grpo.net import free_port

    trace_dir = os.path.abspath(os.path.join(out, f"vllm-trace-{args.shape}-{seqs}"))
    os.makedirs(trace_dir, exist_ok=True)
    config = {"profiler": "torch", "torch_profiler_dir": trace_dir, "torch_profiler_with_stack": False,
              "torch_profiler_use_gzip": False, "torch_profiler_dump_cuda_time_total": False,
              "ignore_frontend": True, "delay_iterations": args.warm_steps, "max_iterations": args.steps}
    port = free_port()
    new = args.warm_steps + args.steps + 64
    cmd = (f"exec python3 -m vllm.entrypoints.openai.api_server --model {shlex.quote(model_dir)} --dtype bfloat16 "
           f"--port {port} --seed 0 --gpu-memory-utilization {args.vllm_memory} "
           f"--max-model-len {args.prompt_len + new + 8} --profiler-config {shlex.quote(json.dumps(config))}")
    log = os.path.join(out, f"vllm-{args.shape}-{seqs}.log")
    with open(log, "ab") as f:
        proc = subprocess.Popen(vllm_shell(args.vllm_env, cmd), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    srv = Server("vllm", f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + args.start_timeout_s
        while not healthy(srv.url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not come up; its log ends:\n{log_tail(log, 25)}")
            time.sleep(2)
        bodies = [request_body("completions", p, new, args.top_logprobs, model_dir)
                  for p in make_prompts(seqs, args.prompt_len, vocab)]
        asyncio.run(run_requests(srv.url, "completions", [dict(b, max_tokens=16) for b in bodies]))  # warm-up
        urllib.request.urlopen(urllib.request.Request(srv.url + "/start_profile", method="POST"), timeout=60)
        asyncio.run(run_requests(srv.url, "completions", bodies))
        urllib.request.urlopen(urllib.request.Request(srv.url + "/stop_profile", method="POST"), timeout=300)
        traces = sorted(glob.glob(os.path.join(trace_dir, "*.json*")), key=os.path.getsize)
        if not traces:
            raise RuntimeError(f"vLLM wrote no trace in {trace_dir}")
        return summarize(load_trace(traces[-1]), steps_hint=args.steps)  # the worker's trace: the largest
    finally:
        stop(srv)


# ---- output ---------------------------------------------------------------------- #


DECODE_ROWS = (("step, no profiler (µs)", "plain_step_us"), ("step, profiled (µs)", "step_us"),
               *((f"{c} (µs)", c) for c in CATEGORIES), ("GPU busy (µs)", "busy_us"),
               ("GPU idle: launches, host gaps (µs)", "idle_us"), ("kernels per step", "kernels_per_step"),
               ("launch calls per step (not graphs)", "launch_calls_per_step"),
               ("graph launches per step", "graph_launches_per_step"),
               ("graph coverage, kernel time", "graph_share_time"), ("graph coverage, kernel count", "graph_share_count"),
               ("HBM roofline step (µs)", "roofline_us"), ("roofline / step, no profiler", "roofline_share"),
               ("status", "status"))


def decode_table(rows: list[dict]) -> str:
    """The per-step breakdown, one column per (engine, seqs)."""
    def get(r: dict, key: str) -> Any:
        if key in CATEGORIES:
            return r.get("by_category_us", {}).get(key)
        if key == "roofline_share":
            return r["roofline_us"] / r["plain_step_us"] if r.get("plain_step_us") else None
        return r.get(key)

    lines = ["| per decode step | " + " | ".join(f"{r['engine']} {r['seqs']}" for r in rows) + " |",
             "| --- |" + " ---: |" * len(rows)]
    lines += [f"| {label} | " + " | ".join(_fmt(get(r, key)) for r in rows) + " |" for label, key in DECODE_ROWS]
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}"
    return str(v)


# ---- main ------------------------------------------------------------------------- #


def save(args: argparse.Namespace, header: str, rows: list[dict], replies: list[dict], vocab: int) -> str:
    """Write engine_profile.{md,json} under ``args.out``; the markdown."""
    text = (header + "\n\n" + decode_table(rows) + f"\n\nReply building, host ms for {args.reply_seqs} samples as "
            f"requests of n={N_PER_PROMPT} (vocabulary {vocab:,}):\n\n" + reply_table(replies) + "\n")
    text += "\n".join(f"\n{r['engine']} {r['seqs']}: top kernels (category, name, µs/step, calls/step)\n" + "\n".join(
        f"  {c:9s} {u:9.1f} {n:6.1f}  {name}" for c, name, u, n in r.get("top_kernels", [])) for r in rows) + "\n"
    with open(os.path.join(args.out, "engine_profile.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "engine_profile.json"), "w") as f:
        json.dump({"header": header, "decode": rows, "replies": replies}, f, indent=1)
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="tiny shape on the CPU, few steps: checks the script")
    ap.add_argument("--shape", choices=list(SHAPES), default="0.6b")
    ap.add_argument("--seqs", default="64", help="comma-separated sequence counts (multiples of 8)")
    ap.add_argument("--engines", default="ours", help="ours, vllm or both, comma-separated")
    ap.add_argument("--vllm-seqs", default="64", help="vLLM's sequence counts (a vLLM start each)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--warm-steps", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top-logprobs", type=int, default=0)
    ap.add_argument("--kv-cache", default="auto", choices=("auto", "static", "paged"),
                    help="our engine's KV cache (EngineConfig.kv_cache)")
    ap.add_argument("--hbm-tbps", type=float, default=4.8)
    ap.add_argument("--reply-lengths", default="128,1024", help="reply benchmark lengths ('' for none)")
    ap.add_argument("--reply-seqs", type=int, default=64)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--vllm-env", default="/tmp/vsite/env.sh" if os.path.exists("/tmp/vsite/env.sh") else None)
    ap.add_argument("--vllm-memory", type=float, default=0.85)
    ap.add_argument("--start-timeout-s", type=float, default=400)
    ap.add_argument("--step-timeout-s", type=float, default=300)
    ap.add_argument("--budget-s", type=float, default=0, help="skip a profile that would start after this (0: none)")
    ap.add_argument("--out", default="outputs/engine_profile")
    args = ap.parse_args(argv)
    if args.cpu:
        args.shape, args.device = "tiny", "cpu"
        args.warm_steps, args.steps = min(args.warm_steps, 6), min(args.steps, 4)
        args.prompt_len = min(args.prompt_len, 16)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        sys.exit("error: no GPU (pass --cpu to check the script on a CPU)")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.monotonic()
    model_dir = os.path.join(tempfile.mkdtemp(prefix="engine_profile_"), f"qwen3-{args.shape}")
    weight_bytes, vocab = write_model(model_dir, args.shape, args.device)
    print(f"# model {args.shape} written in {time.monotonic() - t0:.0f} s", flush=True)
    kv_token = kv_bytes_per_token(model_dir)
    context = args.prompt_len + args.warm_steps + args.steps // 2
    device = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    header = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {device}, torch {torch.__version__}; "
              f"random-weight Qwen3 {args.shape} ({weight_bytes / 1e9:.2f} GB weights), prompt {args.prompt_len}, "
              f"{args.steps} decode steps profiled after {args.warm_steps} (context ~{context}), temperature 1, "
              f"logprobs on (top {args.top_logprobs}); roofline = (weights + KV read) / {args.hbm_tbps} TB/s")
    rows: list[dict] = []
    for engine in [e for e in args.engines.split(",") if e]:
        for seqs in [int(s) for s in (args.vllm_seqs if engine == "vllm" else args.seqs).split(",") if s]:
            t1 = time.monotonic()
            run = profile_vllm if engine == "vllm" else profile_ours
            need = 150 if engine == "vllm" else 20  # a vLLM start; our engine's load, warm steps, profile
            try:
                if args.budget_s and t1 - t0 + need > args.budget_s:
                    raise TimeoutError(f"skipped: budget ({args.budget_s:.0f} s)")
                row = {"engine": engine, "seqs": seqs, **run(model_dir, args, seqs, vocab, args.out), "status": "ok"}
            except Exception as e:  # noqa: BLE001 - one failing profile must not hide the others
                row = {"engine": engine, "seqs": seqs, "status": f"error: {type(e).__name__}: {str(e)[:300]}"}
            row["roofline_us"], row["kv_bytes"] = roofline_us(weight_bytes, kv_token, seqs, context, args.hbm_tbps)
            rows.append(row)
            print(f"# {engine} {seqs}: {row['status']} in {time.monotonic() - t1:.0f} s", flush=True)
            save(args, header, rows, [], vocab)  # a call cut short keeps what it measured
    lengths = [int(x) for x in args.reply_lengths.split(",") if x]
    replies = reply_rows(model_dir, vocab, args.reply_seqs, lengths) if lengths else []
    print("\n" + save(args, header, rows, replies, vocab), flush=True)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
