"""The built-in server with a stack sampler and an engine timeline, for
``bench/engine_vs_vllm.py --trace DIR`` (issue 50: where a route's host time
goes on the GPU machines, which have no py-spy, perf or ptrace).

Run as the server itself::

    python bench/server_trace.py PREFIX -- --model DIR --port N ...   # the server's own arguments

It starts a thread that every ``TRACE_INTERVAL_MS`` (default 2) reads every
thread's Python stack (``sys._current_frames``: a thread blocked in C, on the
GPU or a lock, shows where it waits), wraps ``Engine`` methods to log
when requests are queued, prefilled (with how many rows), finished and
answered and how long decode steps take, then runs ``python -m torchtitan_grpo.server``.
Two knobs for experiments: ``TRACE_SWITCH_INTERVAL_MS`` (the GIL's switch
interval) and ``TRACE_QUIET_MS`` (the admission window's quiet gap).
Nothing here changes what the server does; the sampler costs it a few
percent of the GIL.

A client cuts the record into pieces: it writes a label into ``PREFIX.ctl``;
within ~40 ms the sampler writes what it gathered since the last cut to
``PREFIX-<label>.json`` and starts afresh (label ``-``: dropped).

``python bench/server_trace.py --summary FILE...`` prints each piece: per
thread its samples, where they were (inclusive, the functions that matter)
and its top innermost frames; the engine's timeline (queued, prefills, decode
steps, finished).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading
import time
from collections import Counter
from typing import Any

MAX_DEPTH = 40


class Trace:
    """Stack samples and engine events since the last cut."""

    def __init__(self, prefix: str, interval_s: float):
        self.prefix = prefix
        self.interval_s = interval_s
        self.lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.t0 = time.perf_counter()
        self.stacks: Counter[str] = Counter()
        self.events: list[list] = []
        self.decode_n = 0
        self.decode_s = 0.0

    def event(self, kind: str, *fields: Any) -> None:
        with self.lock:
            self.events.append([round(time.perf_counter() - self.t0, 5), kind, *fields])

    def decode(self, seconds: float) -> None:
        with self.lock:
            self.decode_n += 1
            self.decode_s += seconds

    def cut(self, label: str) -> None:
        with self.lock:
            piece = {"label": label, "seconds": time.perf_counter() - self.t0, "interval_s": self.interval_s,
                     "stacks": dict(self.stacks), "events": self.events,
                     "decode_steps": self.decode_n, "decode_s": self.decode_s}
            self._reset()
        if label != "-":
            tmp = f"{self.prefix}-{label}.json.tmp"
            with open(tmp, "w") as f:
                json.dump(piece, f)
            os.replace(tmp, f"{self.prefix}-{label}.json")

    def sample_forever(self) -> None:
        me = threading.get_ident()
        ctl = self.prefix + ".ctl"
        tick = 0
        while True:
            time.sleep(self.interval_s)
            names = {t.ident: t.name for t in threading.enumerate()}
            frames = sys._current_frames()
            keys = []
            for ident, f in frames.items():
                if ident == me:
                    continue
                parts = [f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_qualname}:{f.f_lineno}"]
                f = f.f_back  # the innermost frame with its line: the C call it is in, if any
                while f is not None and len(parts) < MAX_DEPTH:
                    parts.append(f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_qualname}")
                    f = f.f_back
                keys.append(names.get(ident, str(ident)) + ";" + ";".join(reversed(parts)))
            del frames
            with self.lock:
                self.stacks.update(keys)
            tick += 1
            if tick % 20 == 0 and os.path.exists(ctl):
                with open(ctl) as fh:
                    label = fh.read().strip() or "-"
                os.remove(ctl)
                self.cut(label)


def instrument(trace: Trace) -> None:
    """Log the engine's queueing, prefills (wall and GPU span), decode steps,
    finished requests, and the cyclic collector's passes."""
    import gc

    import torch

    from torchtitan_grpo.server.engine import engine as eng

    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        elif time.perf_counter() - gc_start[0] > 1e-3:  # the passes that cost something
            trace.event("gc", info.get("generation"), round(time.perf_counter() - gc_start[0], 5))

    gc.callbacks.append(on_gc)

    E = eng.Engine
    submit, prefill, decode, finish = E.submit, E._prefill, E._decode_step, E._finish

    def traced_submit(self, prompt_ids, params, *a, **k):
        fut = submit(self, prompt_ids, params, *a, **k)
        trace.event("queued", len(prompt_ids), params.n)
        return fut

    def traced_prefill(self, seqs):
        t = time.perf_counter()
        running = len(self._rows)
        cuda = self.device.type == "cuda"
        if cuda:  # the GPU's span from this prefill's first launch to its last (idle gaps included)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        prefill(self, seqs)
        if cuda:
            b.record()
            b.synchronize()  # the prefill has synced already (its samples are recorded)
        trace.event("prefill", len(seqs), running, round(time.perf_counter() - t, 5),
                    round(a.elapsed_time(b) / 1e3, 5) if cuda else None)

    def traced_decode(self):
        t = time.perf_counter()
        decode(self)
        trace.decode(time.perf_counter() - t)

    def traced_finish(self, s, reason):
        last = s.finish is None and s.req.remaining == 1
        finish(self, s, reason)
        if last:
            trace.event("finished", s.req.rid[:12])

    E.submit, E._prefill, E._decode_step, E._finish = traced_submit, traced_prefill, traced_decode, traced_finish
    resolve = getattr(E, "_resolve", None)  # trees since 96d91e0: the texts of a step's ended requests, together
    if resolve is not None:
        def traced_resolve(self, reqs):
            t = time.perf_counter()
            resolve(self, reqs)
            trace.event("answered", len(reqs), round(time.perf_counter() - t, 5))

        E._resolve = traced_resolve


def serve(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] != "--":
        sys.exit("usage: server_trace.py PREFIX -- SERVER_ARGS...  |  server_trace.py --summary FILE...")
    trace = Trace(argv[0], float(os.environ.get("TRACE_INTERVAL_MS", "2")) / 1e3)
    if os.environ.get("TRACE_SWITCH_INTERVAL_MS"):  # how long a thread may keep the GIL from another (5 ms)
        sys.setswitchinterval(float(os.environ["TRACE_SWITCH_INTERVAL_MS"]) / 1e3)
    if os.environ.get("TRACE_QUIET_MS"):  # the admission window's quiet gap (admission.QUIET_MS), to try others
        from torchtitan_grpo.server.engine.admission import AdmissionWindow

        AdmissionWindow.__init__.__defaults__ = (float(os.environ["TRACE_QUIET_MS"]),)
    instrument(trace)
    threading.Thread(target=trace.sample_forever, name="stack-sampler", daemon=True).start()
    sys.argv = ["torchtitan_grpo.server", *argv[2:]]
    runpy.run_module("torchtitan_grpo.server", run_name="__main__", alter_sys=True)


# ---- summary ------------------------------------------------------------------ #

WATCH = ("_prefill", "_decode_step", "_record", "_finish", "resolve", "sample_result", "_ready_to_step",
         "read_json", "_parse", "render", "gather_samples", "_choice", "chat_content", "json_reply",
         "dumps", "_run_once", "select", "wait")
"""Functions whose inclusive share is printed per thread (matched on the name after the file)."""


def summary(path: str, top: int = 12) -> str:
    with open(path) as f:
        p = json.load(f)
    out = [f"## {p['label']}: {p['seconds']:.2f} s, {p['interval_s'] * 1e3:g} ms samples"]
    threads: dict[str, Counter] = {}
    for key, n in p["stacks"].items():
        name, _, stack = key.partition(";")
        threads.setdefault(name, Counter())[stack] += n
    for name, stacks in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(stacks.values())
        incl: Counter[str] = Counter()
        leaf: Counter[str] = Counter()
        for stack, n in stacks.items():
            frames = stack.split(";")
            leaf[";".join(frames[-2:])] += n
            for fn in {fr.split(":")[1].rsplit(".", 1)[-1] for fr in frames if ":" in fr}:
                if fn in WATCH:
                    incl[fn] += n
        out.append(f"- {name}: {total} samples; " + ", ".join(f"{k} {100 * v / total:.0f} %" for k, v in incl.most_common()))
        out += [f"    {100 * n / total:5.1f} %  {s}" for s, n in leaf.most_common(top)]
    ev = p["events"]
    pre = [e for e in ev if e[1] == "prefill"]
    q = [e[0] for e in ev if e[1] == "queued"]
    fin = [e[0] for e in ev if e[1] == "finished"]
    if q:
        out.append(f"- queued: {len(q)} requests from {q[0]:.3f} to {q[-1]:.3f} s")
    gpu = lambda e: "" if len(e) < 6 or e[5] is None else f", GPU {e[5] * 1e3:.1f}"  # noqa: E731
    out.append("- prefills: " + ", ".join(f"{e[2]} rows at {e[0]:.3f} s ({e[3]} running, {e[4] * 1e3:.1f} ms"
                                          f"{gpu(e)})" for e in pre[:12]) + (f" ... ({len(pre)})" if len(pre) > 12 else ""))
    gcs = [e for e in ev if e[1] == "gc"]
    if gcs:
        out.append(f"- collector passes over 1 ms: {len(gcs)}, " + ", ".join(
            f"gen {e[2]} {e[3] * 1e3:.0f} ms at {e[0]:.3f}" for e in gcs[:10]))
    if p["decode_steps"]:
        out.append(f"- decode steps: {p['decode_steps']}, {1e3 * p['decode_s'] / p['decode_steps']:.2f} ms each on the "
                   f"worker (launching it, recording the one before: its wait for the GPU included)")
    if fin:
        out.append(f"- finished: {len(fin)} requests from {fin[0]:.3f} to {fin[-1]:.3f} s")
    answered = [e for e in ev if e[1] == "answered"]
    if answered:
        out.append(f"- answered (texts decoded, futures set): {sum(e[2] for e in answered)} requests in "
                   f"{len(answered)} calls, {1e3 * max(e[3] for e in answered):.1f} ms the longest")
    out += [f"- burst {i}: {b}" for i, b in enumerate(bursts(ev))]
    return "\n".join(out)


def bursts(events: list[list]) -> list[str]:
    """Each burst of the piece (its requests queued into an engine with none live) in one line: how
    long queueing them took, when the first prefill started after the first was queued, the
    prefills (rows / wall ms), from the last prefill's end to the first finished request (the
    decode), how long the finished requests took to be answered, first queued to last finished."""
    out, live, cur = [], 0, []
    for e in events:
        if e[1] == "queued":
            if live == 0 and cur:
                out.append(cur)
                cur = []
            live += 1
        elif e[1] == "finished":
            live -= 1
        if e[1] in ("queued", "prefill", "finished"):
            cur.append(e)
    out.append(cur)
    lines = []
    for b in out:
        q = [e[0] for e in b if e[1] == "queued"]
        pre = [e for e in b if e[1] == "prefill"]
        fin = [e[0] for e in b if e[1] == "finished"]
        if not (q and pre and fin):
            continue
        ms = lambda x: f"{x * 1e3:.1f}"  # noqa: E731
        lines.append(f"{len(q)} queued in {ms(q[-1] - q[0])} ms, first prefill {ms(pre[0][0] - pre[0][4] - q[0])} ms "
                     f"after the first; prefills {' + '.join(f'{e[2]} rows / {ms(e[4])} ms' for e in pre)}; "
                     f"{ms(fin[0] - pre[-1][0])} ms to the first finished, {ms(fin[-1] - fin[0])} ms to the last; "
                     f"{ms(fin[-1] - q[0])} ms in all")
    return lines


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summary"]:
        print("\n\n".join(summary(f) for f in sys.argv[2:]))
    else:
        serve(sys.argv[1:])
