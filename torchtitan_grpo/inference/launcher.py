"""Start and stop built-in inference servers as child processes.

Guarantees: each server gets a port that is free at launch (two runs on one
machine never collide; a lost race is retried on another port), a server that
fails to come up raises an error that shows the tail of its log, and the
servers never outlive the trainer — they are stopped on normal exit, on an
exception and on Ctrl-C/SIGTERM, and on Linux the kernel also sends them
SIGTERM if the trainer itself is killed (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class ServerSpec:
    """How to start one built-in server."""

    model_dir: str
    device: str = "cpu"
    dtype: str = "float32"
    host: str = "127.0.0.1"
    threads: int = 1
    seed: int = 0
    extra_args: list[str] = field(default_factory=list)


@dataclass
class ServerProcess:
    url: str
    port: int
    log_path: str
    proc: subprocess.Popen


class ServerStartError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS considers free right now (the caller may still lose a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """preexec_fn: ask Linux to SIGTERM this child when its parent dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def log_tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _spawn(spec: ServerSpec, log_path: str) -> tuple[subprocess.Popen, int]:
    """Start one server process on a port that is free right now."""
    port = free_port(spec.host)
    cmd = [
        sys.executable, "-m", "torchtitan_grpo.inference.server",
        "--model", spec.model_dir, "--port", str(port), "--host", spec.host,
        "--device", spec.device, "--dtype", spec.dtype, "--seed", str(spec.seed),
        *spec.extra_args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(spec.threads), PYTHONUNBUFFERED="1")
    # torchrun's rendezvous variables must not leak into the server.
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK"):
        env.pop(k, None)
    with open(log_path, "ab") as log:
        log.write(f"\n=== {' '.join(cmd)}\n".encode())
        log.flush()
        # PR_SET_PDEATHSIG fires when the *thread* that forked exits, so this
        # must run on a long-lived thread (the caller's), never a pool worker.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    return proc, port


def start_servers(specs: list[ServerSpec], log_dir: str, timeout_s: float, attempts: int = 3) -> list[ServerProcess]:
    """Start every server (from this thread), wait until each answers /health.

    A server that lost the race for its port is restarted on another one; any
    other failure stops them all and raises with the tail of the failing log.
    """
    os.makedirs(log_dir, exist_ok=True)
    logs = [os.path.join(log_dir, f"server_{i}.log") for i in range(len(specs))]
    procs = [_spawn(s, p) for s, p in zip(specs, logs)]
    tries = [1] * len(specs)
    ready: list[ServerProcess | None] = [None] * len(specs)
    deadline = time.monotonic() + timeout_s
    try:
        while not all(ready):
            if time.monotonic() > deadline:
                i = ready.index(None)
                raise ServerStartError(
                    f"inference server on port {procs[i][1]} did not answer /health within {timeout_s:.0f}s "
                    f"(inference.startup_timeout_s); last lines of {logs[i]}:\n{log_tail(logs[i])}")
            for i, (proc, port) in enumerate(procs):
                if ready[i]:
                    continue
                url = f"http://{specs[i].host}:{port}"
                if proc.poll() is not None:
                    tail = log_tail(logs[i])
                    if "address already in use" in tail.lower() and tries[i] < attempts:
                        tries[i] += 1
                        procs[i] = _spawn(specs[i], logs[i])
                        continue
                    raise ServerStartError(
                        f"inference server exited with code {proc.returncode} during start-up; "
                        f"last lines of {logs[i]}:\n{tail}")
                if _healthy(url):
                    logger.info("inference server %s ready (pid %d, log %s)", url, proc.pid, logs[i])
                    ready[i] = ServerProcess(url, port, logs[i], proc)
            time.sleep(0.25)
    except BaseException:
        for proc, _ in procs:
            stop_process(proc)
        raise
    return ready  # type: ignore[return-value]


def stop_process(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace_s)


@contextlib.contextmanager
def running_servers(specs: list[ServerSpec], log_dir: str, timeout_s: float):
    """Start one server per spec, yield them, always stop them.

    SIGTERM is turned into SystemExit for the duration so that torchrun or
    SLURM stopping the trainer still runs the clean-up below.
    """
    started: list[ServerProcess] = []
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        started = start_servers(specs, log_dir, timeout_s)
        yield started
    finally:
        for s in started:
            stop_process(s.proc)
        if previous in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
