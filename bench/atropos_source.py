"""The Atropos source against the built-in source on the CPU demo, in one run.

    OMP_NUM_THREADS=1 python bench/atropos_source.py [--steps 150] [--repeats 2]

Each row is one real ``grpo_train.py`` run of ``train_configs/demo_cpu.toml``
(16 prompts x 16 samples per step, async push, one built-in server the
trainer starts). "built-in": the trainer's own single-turn digits loop.
"atropos": every part a real process, as a user runs them: atroposlib's
trajectory API (uvicorn), the trainer with ``rollout.source = "atropos"``,
and ``examples/atropos/digits_env.py`` (two turns) sampling from the
trainer's server and posting scored groups. The rows alternate, ``--repeats``
times, so that a drift in the box's speed shows in both.

Per run, over steps 2..N (step 1 also waits for the environment to start):
steps/s, the trainer's wait for data (``time/wait_s``), the reward over the
first and last 10 steps, and for Atropos the pull and the conversion of each
batch (``atropos/pull_s``, ``atropos/convert_s``, medians), their sum as a
share of the step (issue 26's target: < 5 %), and the part of it the
trainer waited through (``atropos/exposed_s``; with the prefetch the rest
ran while it trained). The load average at each run's end says whether
anything else shared the box.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from torchtitan_grpo.fleet.launcher import log_tail  # noqa: E402
from torchtitan_grpo.net import free_port  # noqa: E402

PROMPTS, GROUP = 16, 16


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)}


def _spawn(cmd: list[str], log: str, **env: str) -> subprocess.Popen:
    """In a session of its own, so that killpg takes its children (the trainer's server) too."""
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env={**_env(), **env},
                                start_new_session=True)


def _kill(proc: subprocess.Popen) -> None:
    """The process's whole group (a group already gone: nothing to do)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=20)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def _wait_for(what: str, ok, proc: subprocess.Popen, log: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen; last lines of {log}:\n{log_tail(log, 40)}")
        time.sleep(0.2)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def run(args, name: str, out: str) -> list[dict]:
    """One trainer run (``name``: "built-in" or "atropos"); its metrics.jsonl rows."""
    dump = os.path.join(out, name)
    shutil.rmtree(dump, ignore_errors=True)
    os.makedirs(dump)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(ROOT, "grpo_train.py"), "--job.config_file", os.path.join(ROOT, "train_configs", "demo_cpu.toml"),
           "--job.dump_folder", dump, "--model.hf_assets_path", args.model_dir, "--weight_sync.mode", "async",
           "--training.steps", str(args.steps), "--grpo.prompts_per_step", str(PROMPTS),
           "--grpo.group_size", str(GROUP)]
    procs: list[subprocess.Popen] = []
    try:
        if name == "atropos":
            url = f"http://127.0.0.1:{free_port()}"
            api_log = os.path.join(dump, "api.log")
            procs.append(_spawn([sys.executable, "-m", "uvicorn", "atroposlib.api.server:app", "--host", "127.0.0.1",
                                 "--port", url.rsplit(":", 1)[1], "--log-level", "warning"], api_log))
            _wait_for("the Atropos API answering /status", lambda: _answers(url + "/status"), procs[0], api_log, 120)
            cmd += ["--rollout.source", "atropos", "--rollout.atropos_url", url]
        trainer_log = os.path.join(dump, "train.log")
        trainer = _spawn(cmd, trainer_log)
        procs.append(trainer)
        if name == "atropos":
            # The environment samples from the servers the trainer lists once they are up.
            replicas = os.path.join(dump, "servers", "replicas.txt")
            _wait_for("the trainer's replicas.txt", lambda: os.path.exists(replicas) and open(replicas).read().strip(),
                      trainer, trainer_log, 300)
            procs.append(_spawn([sys.executable, os.path.join(ROOT, "examples", "atropos", "digits_env.py"), "serve",
                                 "--env.tokenizer_name", args.model_dir, "--env.replica_file", replicas,
                                 "--env.rollout_server_url", url, "--env.group_size", str(GROUP)],
                                os.path.join(dump, "env.log"), DIGITS_MODEL=args.model_dir))
        rc = trainer.wait(timeout=args.run_timeout_s)
        if rc != 0:
            raise RuntimeError(f"run {name} failed (exit {rc}):\n{log_tail(trainer_log, 40)}")
    finally:
        for p in reversed(procs):
            _kill(p)
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def summarize(rows: list[dict]) -> dict[str, float]:
    """Figures over steps 2..N of one run's metrics rows."""
    after = rows[1:]
    step = sum(r["time/step_s"] for r in after)
    rewards = [r["reward/mean"] for r in rows]
    out = {"steps_per_s": len(after) / step, "wait_s": statistics.mean(r["time/wait_s"] for r in after),
           "reward_first": statistics.mean(rewards[:10]), "reward_last": statistics.mean(rewards[-10:])}
    if "atropos/pull_s" in after[0]:
        pull = [r["atropos/pull_s"] for r in after]
        conv = [r["atropos/convert_s"] for r in after]
        exposed = [r.get("atropos/exposed_s", p + c) for r, p, c in zip(after, pull, conv)]
        out.update(pull_ms=1e3 * statistics.median(pull), convert_ms=1e3 * statistics.median(conv),
                   share=(sum(pull) + sum(conv)) / step, exposed_share=sum(exposed) / step,
                   prefetched=statistics.mean(r.get("atropos/prefetched", 0.0) for r in after))
    return out


def print_table(results: list[tuple[str, dict[str, float], float]]) -> None:
    print()
    print("| run | steps/s | wait s | reward first 10 | last 10 | pull ms | convert ms | pull + convert, % of step "
          "| waited on, % of step | prefetched | load |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, s, load in results:
        at = (f"{s['pull_ms']:.1f} | {s['convert_ms']:.1f} | {s['share']:.1%} | {s['exposed_share']:.1%} | "
              f"{s['prefetched']:.0%}") if "share" in s else " | | | | "
        print(f"| {name} | {s['steps_per_s']:.2f} | {s['wait_s']:.3f} | {s['reward_first']:.3f} | "
              f"{s['reward_last']:.3f} | {at} | {load:.2f} |")
    print("\npull, convert: medians over steps 2..N; % of step: their sums over the run's step time")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=1, help="built-in and Atropos rows, alternated, this many times")
    ap.add_argument("--only", default="built-in,atropos", help="comma-separated rows")
    ap.add_argument("--model-dir", default=None, help="the demo's tiny model (written if missing)")
    ap.add_argument("--out", default=os.path.join(ROOT, "outputs", "bench_atropos"))
    ap.add_argument("--run-timeout-s", type=float, default=1800.0)
    args = ap.parse_args(argv)

    from torchtitan_grpo.models.demo_assets import TinyQwen3, ensure_tiny_qwen3

    args.model_dir = args.model_dir or os.path.join(args.out, "tiny-qwen3")
    ensure_tiny_qwen3(args.model_dir, TinyQwen3())
    results = []
    for rep in range(args.repeats):
        for name in args.only.split(","):
            rows = run(args, name, os.path.join(args.out, f"repeat{rep + 1}"))
            s = summarize(rows)
            results.append((name, s, os.getloadavg()[0]))
            print(f"# {name} (pass {rep + 1}): {s}", flush=True)
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
