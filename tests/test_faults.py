"""The fault matrix over real processes: a trainer under torchrun with built-in
servers it launched, and a fault injected mid-run (kill -9 a server, kill the
only one for good, SIGTERM the trainer). Each test checks what the run did,
how many steps were lost, and that it says so in one line. Waits are hang
guards only; nothing here measures speed."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

DEMO = os.path.join(ROOT, "train_configs", "demo_cpu.toml")
pytestmark = pytest.mark.slow



def _stop_lines(out: str) -> list[str]:
    """The trainer's own stop lines (torchrun's failure report, which follows
    them, repeats the line from the error file the trainer writes for it)."""
    return [line for line in out.splitlines() if "stopped after step" in line and line.startswith("[rank0]")]

def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")


def _start(dump: str, model_dir: str, *args: str) -> tuple[subprocess.Popen, str]:
    log = os.path.join(os.path.dirname(dump), os.path.basename(dump) + ".log")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(ROOT, "grpo_train.py"), "--job.config_file", DEMO, "--job.dump_folder", dump,
           "--model.hf_assets_path", model_dir, *args]
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return p, log


def _steps(dump: str) -> list[dict]:
    path = os.path.join(dump, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def _wait_steps(p: subprocess.Popen, dump: str, log: str, n: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while len(_steps(dump)) < n:
        assert p.poll() is None, open(log).read()[-4000:]
        assert time.monotonic() < deadline, f"fewer than {n} steps in {timeout_s}s:\n" + open(log).read()[-4000:]
        time.sleep(0.2)


def _finish(p: subprocess.Popen, log: str, timeout_s: float = 300) -> str:
    try:
        p.wait(timeout_s)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return open(log).read()


def test_killed_server_is_restarted_caught_up_and_readmitted(tmp_path, tiny_model_dir):
    """kill -9 one of two launched servers mid-run: the run loses no step, the
    server comes back on its URL, gets the newest weights, serves again, and
    the summary lists what happened."""
    dump = str(tmp_path / "run")
    p, log = _start(dump, tiny_model_dir, "--training.steps", "5000", "--inference.num_servers", "2",
                    "--weight_sync.mode", "async")
    try:
        _wait_steps(p, dump, log, 3)
        pids = _server_pids(log)
        # pool/replica{i}_* follow the order of the servers' URLs (replicas.txt), not the order they got ready
        with open(os.path.join(dump, "servers", "replicas.txt")) as f:
            urls = f.read().split()
        assert len(pids) == 2 and sorted(pids) == sorted(urls), (pids, urls)
        victim = urls[1]
        os.kill(pids[victim], signal.SIGKILL)
        deadline = time.monotonic() + 300
        while f"inference replica {victim} readmitted" not in open(log).read():  # restarted and caught up
            assert p.poll() is None and time.monotonic() < deadline, open(log).read()[-4000:]
            time.sleep(0.2)
        served = _steps(dump)[-1]["pool/replica1_served"]
        # Routed to again and serving new groups.
        while not (_steps(dump)[-1]["pool/replica1_state"] == 0.0
                   and _steps(dump)[-1]["pool/replica1_served"] > served):
            assert p.poll() is None and time.monotonic() < deadline, open(log).read()[-4000:]
            time.sleep(0.2)
        os.killpg(p.pid, signal.SIGTERM)
        out = _finish(p, log, 120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    # torchrun exits 1 on its own SIGTERM; the worker's clean stop is its one line
    assert p.returncode != 0 and "received SIGTERM" in out, out[-4000:]
    rows = _steps(dump)
    assert [m["step"] for m in rows] == list(range(1, len(rows) + 1))
    summary = out.split("inference replica events:")[1]
    for kind in ("exited", "restarted", "down", "ejected", "readmitted"):
        assert f" {kind} " in summary, (kind, summary)
    # After its exit it was sent the newest weights (log lines of the trainer, its supervisor and the
    # rollout client process interleave: only this order is causal).
    lines = out.splitlines()
    gone = next(i for i, line in enumerate(lines) if f"inference server {victim} exited" in line)
    assert any(f"replica {victim} caught up at version" in line for line in lines[gone:]), out[-4000:]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_only_server_killed_mid_run_is_caught_up_and_the_run_finishes(tmp_path, tiny_model_dir, mode):
    """The demo's own layout (one launched server): kill -9 it mid-run. It is
    restarted, sent the newest weights although no step can run to stage a
    new version meanwhile, readmitted, and the run trains every step."""
    dump = str(tmp_path / "run")
    steps = 10
    p, log = _start(dump, tiny_model_dir, "--training.steps", str(steps), "--weight_sync.mode", mode)
    try:
        _wait_steps(p, dump, log, 3)
        (pid,) = _server_pids(log).values()
        os.kill(pid, signal.SIGKILL)
        out = _finish(p, log, 600)  # a hang guard: the restart and catch-up take seconds
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, out[-4000:]
    assert [m["step"] for m in _steps(dump)] == list(range(1, steps + 1)), out[-4000:]
    lines = out.splitlines()
    gone = next(i for i, line in enumerate(lines) if "inference server" in line and "exited" in line)
    assert any("caught up at version" in line for line in lines[gone:]), out[-4000:]


def _server_pids(log: str) -> dict[str, int]:
    """PID of each launched server by its URL, from the trainer's log."""
    import re

    return {url: int(pid) for url, pid in re.findall(r"inference server (http://\S+) ready \(pid (\d+),",
                                                      open(log).read())}


def test_sigterm_saves_resume_and_the_only_server_gone_for_good(tmp_path, tiny_model_dir):
    """Three faults over one run, three trainer starts of the same dump, each
    resuming where the one before stopped (these were two tests of two starts
    each, here and in test_rough_edges: their checks are all made below; the
    chain saves a trainer start and its server).

    1. Every step is an interval save; SIGTERM to the worker alone (as
       torchrun or SLURM sends it): the stop line names the checkpoint of its
       step, and torchrun's report of the failed worker carries that line (the
       error file), not a link to its docs.
    2. The same run resumed, async push, checkpoint interval far away; SIGTERM
       to torchrun and its worker (as a terminal or SLURM would): the last
       completed step is saved and the trainer exits with one line saying so.
    3. Resumed again (the demo's sync push, its only server not allowed to
       restart); the server is killed: the run saves its last completed step
       and stops at once with one line naming the cause and the checkpoint,
       instead of waiting request_timeout_s; the reason is said once; the
       summary's first 10 steps are the run's (from metrics.jsonl), not the
       resumed part's. No step is lost or trained twice over the three."""
    import re

    dump = str(tmp_path / "run")
    ckpt = os.path.join(dump, "checkpoint")

    # 1. Interval saves; SIGTERM to the worker only.
    p, log = _start(dump, tiny_model_dir, "--training.steps", "1000", "--checkpoint.enable", "true",
                    "--checkpoint.interval", "1")
    try:
        _wait_steps(p, dump, log, 3)
        (worker,) = subprocess.run(["pgrep", "-P", str(p.pid), "-f", "grpo_train.py"], capture_output=True,
                                   text=True).stdout.split()
        os.kill(int(worker), signal.SIGTERM)
        out = _finish(p, log, 120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    lines = [line for line in out.splitlines() if "stopped after step" in line]
    first = int(lines[0].split("stopped after step ")[1].split()[0])
    stop = f"stopped after step {first} of 1000: received SIGTERM; checkpoint of step {first} in {ckpt}"
    assert lines[0].endswith(stop), out[-4000:]
    assert f"traceback : {stop}" in out, out[-4000:]  # torchrun's Root Cause section
    assert p.returncode == 1  # torchrun's, whatever the worker's (143)
    assert [m["step"] for m in _steps(dump)] == list(range(1, first + 1))

    # 2. Resumed, async, interval far away; SIGTERM to torchrun and its worker.
    args = ("--training.steps", "1000", "--checkpoint.enable", "--checkpoint.interval", "1000")
    p, log = _start(dump, tiny_model_dir, *args, "--weight_sync.mode", "async")
    try:
        _wait_steps(p, dump, log, first + 4)
        assert f"resumed from {ckpt} at step {first}" in open(log).read()
        os.killpg(p.pid, signal.SIGTERM)  # torchrun and its worker, as a terminal or SLURM would
        out = _finish(p, log, 120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    lines = _stop_lines(out)
    assert len(lines) == 1, out[-4000:]
    done = int(lines[0].split("stopped after step ")[1].split()[0])
    assert "received SIGTERM" in lines[0] and f"checkpoint of step {done}" in lines[0], lines[0]
    # no interval save comes before step 1000: this checkpoint is the stop's own
    assert done >= first + 4 and os.path.isdir(os.path.join(ckpt, f"step-{done}"))
    assert [m["step"] for m in _steps(dump)] == list(range(1, done + 1))

    # 3. Resumed, sync, no restart allowed; the only server killed for good.
    p, log = _start(dump, tiny_model_dir, *args, "--inference.server_max_restarts", "0",
                    "--inference.request_timeout_s", "600")
    try:
        _wait_steps(p, dump, log, max(11, done + 3))
        assert f"resumed from {ckpt} at step {done}" in open(log).read()
        (pid,) = _server_pids(log).values()
        os.kill(pid, signal.SIGKILL)
        out = _finish(p, log, 300)  # a hang guard: waiting request_timeout_s (600) would fail it
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode != 0
    lines = _stop_lines(out)
    assert len(lines) == 1, out[-4000:]
    last = int(lines[0].split("stopped after step ")[1].split()[0])
    assert "gone for good" in lines[0] and f"checkpoint of step {last}" in lines[0], lines[0]
    assert re.search(rf"stopped after step {last} of 1000: .*gone for good.*; checkpoint of step {last} in ", out)
    assert last >= done + 3 and os.path.isdir(os.path.join(ckpt, f"step-{last}"))
    # the worker's own output has no traceback wall (torchrun's report of the exit code follows it)
    assert "Traceback" not in out.split(lines[0])[0], out[-4000:]
    failures = re.findall(r"rollout producer stopped: (.*)", out)
    assert len(failures) == len(set(failures)), failures
    # the stop reason once from the trainer (torchrun's report after it repeats it from the error file)
    worker = out.split("stopped after step")[0] + out.split("stopped after step")[1]
    assert worker.count("every inference replica is gone for good") == 1, out[-4000:]
    assert "inference.server_max_restarts = 0 allows no restart" in worker, out[-4000:]
    rows = _steps(dump)
    assert [m["step"] for m in rows] == list(range(1, last + 1))
    first10 = sum(m["reward/mean"] for m in rows[:10]) / 10
    last10 = sum(m["reward/mean"] for m in rows[-10:]) / 10
    assert (f"mean reward: first 10 steps {first10:.3f}, last 10 steps {last10:.3f} (run resumed at step {done}; "
            "earlier steps read from metrics.jsonl)") in out, out[-4000:]
