"""What Python threads beside the training thread cost a train step, in one run.

    OMP_NUM_THREADS=1 python bench/gil_contention.py [--steps 150]

The trainer of ``grpo_train.py`` (``bench/step_time.Trainer``: the demo's
tiny Qwen3 built by ``trainer.build_policy``, real forward / backward / AdamW
steps through ``trainer.train_step``) trains a fixed batch of the demo's
shape (256 samples, 2 completion tokens) on the main thread, while
background threads of the kinds a pipelined trainer process runs do their
work once per step:

* "http": an asyncio loop exchanging small JSON requests over a local
  socket pair, ~20 round trips a step (what the weight push's control
  traffic is to the trainer's process);
* "unpickle": one ``pickle.loads`` of a step's groups as the rollout client
  sends them (16 groups of 16 samples, built by ``GroupScorer``'s types),
  one C call that holds the GIL throughout (the receiving thread of
  ``rollout/client_process.py``).

Rows: none (the baseline, measured in the same run), each kind alone, both,
and both with ``sys.setswitchinterval`` at 0.5 ms instead of 5 ms; they take
turns in rounds, so drift of the machine's speed hits every row alike.
Columns: the step's median wall time, the background threads' CPU time per
step (``time.thread_time`` in each), the step's growth over the baseline,
and that growth as a share of the background CPU: ~1 means the
training thread loses what the others run and no more (the GIL hands over
without waiting out switch intervals); well above 1 would mean contention
costs more than the work itself. Run it on an otherwise idle machine with
at least 2 cores: the threads must not also compete for a core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import socket
import statistics
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.step_time import Trainer, write_model  # noqa: E402


def step_groups() -> bytes:
    """One step's groups as the client process pickles them (16 x 16 samples, 2 tokens each)."""
    from torchtitan_grpo.rollout.groups import ScoredGroup
    from torchtitan_grpo.train.sample import Sample

    groups = []
    for i in range(16):
        prompt = [5, 17, 9]
        samples = [Sample(prompt, [10 + j % 10, 1], [-0.1 * j, -0.01], (-1) ** j * 0.9, float(j % 2), "stop",
                          ["7"], version_spans=[("7", 0, 2)]) for j in range(16)]
        groups.append(ScoredGroup(i, samples, [s.reward for s in samples], 32, 0, False,
                                  replica="http://127.0.0.1:30000", versions=["7"]))
    return pickle.dumps(("groups", groups), protocol=pickle.HIGHEST_PROTOCOL)


class Background:
    """The background threads of one row; each does its work once per ``period_s``."""

    def __init__(self, kinds: list[str], period_s: float):
        self.kinds, self.period_s = kinds, period_s
        self.stop = threading.Event()
        self.cpu: dict[str, float] = {}
        self.payload = step_groups()
        self.threads = [threading.Thread(target=getattr(self, f"_{k}"), name=k, daemon=True) for k in kinds]

    def __enter__(self) -> Background:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def _http(self) -> None:
        loop = asyncio.new_event_loop()
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        body = {"names": [f"model.layers.{i}.weight" for i in range(30)], "dtypes": ["float32"] * 30,
                "shapes": [[64, 64]] * 30, "weight_version": "7"}

        async def run() -> None:
            while not self.stop.is_set():
                for _ in range(20):
                    await loop.sock_sendall(a, json.dumps(body).encode())
                    json.loads(await loop.sock_recv(b, 1 << 16))
                await asyncio.sleep(self.period_s)

        t0 = time.thread_time()
        loop.run_until_complete(run())
        self.cpu["http"] = time.thread_time() - t0
        loop.close()

    def _unpickle(self) -> None:
        t0 = time.thread_time()
        while not self.stop.wait(self.period_s):
            pickle.loads(self.payload)
        self.cpu["unpickle"] = time.thread_time() - t0


def run_row(tr: Trainer, kinds: list[str], steps: int, period_s: float) -> tuple[list[float], float]:
    """Step times with ``kinds`` running beside the trainer, and their CPU seconds in all."""
    times = []
    with Background(kinds, period_s) as bg:
        tr.step(None, "off")  # the threads settle
        for _ in range(steps):
            times.append(tr.step(None, "off")["step_s"])
    return times, sum(bg.cpu.values()) * steps / (steps + 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="timed steps per row, over all rounds")
    ap.add_argument("--rounds", type=int, default=8, help="rounds in which the rows take turns")
    ap.add_argument("--samples", type=int, default=256, help="samples per step (the demo: 16 x 16)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = tempfile.mkdtemp(prefix="gil_contention_")
    model_dir = os.path.join(out, "tiny-qwen3")
    write_model(model_dir, gpu=False)
    targs = SimpleNamespace(prompt_len=3, completion_len=2, micro_batch_size=args.samples, log_dir=out,
                            samples=args.samples)
    tr = Trainer(targs, model_dir, torch.device("cpu"))
    for _ in range(20):  # warm-up
        tr.step(None, "off")
    # The background work comes once per (baseline) step, as a pipelined trainer's does.
    period = statistics.median(run_row(tr, [], 30, 0.0)[0])
    plan = [("none", [], None), ("http", ["http"], None), ("unpickle", ["unpickle"], None),
            ("http + unpickle", ["http", "unpickle"], None),
            ("http + unpickle, switch 0.5 ms", ["http", "unpickle"], 0.0005)]
    # Rows take turns in rounds, so drift of the machine's speed hits them all alike.
    times: dict[str, list[float]] = {name: [] for name, _, _ in plan}
    cpu: dict[str, float] = {name: 0.0 for name, _, _ in plan}
    per_round = max(args.steps // args.rounds, 1)
    for _ in range(args.rounds):
        for name, kinds, switch in plan:
            old = sys.getswitchinterval()
            if switch is not None:
                sys.setswitchinterval(switch)
            try:
                t, c = run_row(tr, kinds, per_round, period)
            finally:
                sys.setswitchinterval(old)
            times[name] += t
            cpu[name] += c
    base = statistics.median(times["none"])
    print(f"\n{args.samples} samples a step, {per_round * args.rounds} steps a row in {args.rounds} rounds, "
          f"cores {os.cpu_count()}, torch {torch.__version__}\n")
    print("| row | step ms (median) | background CPU ms / step | step growth ms | growth / background CPU |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, _, _ in plan:
        step = statistics.median(times[name])
        growth, bg = (step - base) * 1e3, cpu[name] / len(times[name]) * 1e3
        share = f"{growth / bg:.2f}" if bg > 0.05 else ""
        print(f"| {name} | {step * 1e3:.2f} | {bg:.2f} | {growth:+.2f} | {share} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
