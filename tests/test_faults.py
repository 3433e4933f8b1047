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


def test_sigterm_checkpoint_resume_then_the_only_server_gone_for_good(tmp_path, tiny_model_dir):
    """Two faults, one resumed run between them (each a trainer start saved).

    1. SIGTERM (what SLURM sends before a preemption) mid-run, checkpoint
       interval far away: the last completed step is saved and the trainer
       exits with one line saying so.
    2. The same command again (the demo's sync push this time, its only
       server not allowed to restart) resumes right after that step; then the
       server is killed: the run saves its last completed step and stops at
       once with one line naming the cause, instead of waiting
       request_timeout_s. No step is lost or trained twice over both runs."""
    dump = str(tmp_path / "run")
    args = ("--training.steps", "1000", "--checkpoint.enable", "--checkpoint.interval", "1000")
    p, log = _start(dump, tiny_model_dir, *args, "--weight_sync.mode", "async")
    try:
        _wait_steps(p, dump, log, 4)
        os.killpg(p.pid, signal.SIGTERM)  # torchrun and its worker, as a terminal or SLURM would
        out = _finish(p, log, 120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    lines = _stop_lines(out)
    assert len(lines) == 1, out[-4000:]
    done = int(lines[0].split("stopped after step ")[1].split()[0])
    assert "received SIGTERM" in lines[0] and f"checkpoint of step {done}" in lines[0], lines[0]
    assert done >= 4 and os.path.isdir(os.path.join(dump, "checkpoint", f"step-{done}"))
    assert [m["step"] for m in _steps(dump)] == list(range(1, done + 1))

    p, log = _start(dump, tiny_model_dir, *args, "--inference.server_max_restarts", "0",
                    "--inference.request_timeout_s", "600")
    try:
        _wait_steps(p, dump, log, done + 3)
        assert f"resumed from {os.path.join(dump, 'checkpoint')} at step {done}" in open(log).read()
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
    assert last >= done + 3 and os.path.isdir(os.path.join(dump, "checkpoint", f"step-{last}"))
    # the worker's own output has no traceback wall (torchrun's report of the exit code follows it)
    assert "Traceback" not in out.split(lines[0])[0], out[-4000:]
    assert [m["step"] for m in _steps(dump)] == list(range(1, last + 1))
