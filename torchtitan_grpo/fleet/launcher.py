"""Start and stop built-in inference servers as child processes.

Guarantees: each server gets a port that is free at launch (two runs on one
machine never collide; a lost race is retried on another port), a server that
fails to come up raises an error that shows the tail of its log, and the
servers never outlive the trainer — they are stopped on normal exit, on an
exception and on Ctrl-C/SIGTERM, and on Linux the kernel also sends them
SIGTERM if the trainer itself is killed (PR_SET_PDEATHSIG).

While they run, a ``Supervisor`` watches them: a server that exits is
restarted on the same port (so its URL, which the pool and the pusher know it
by, stays valid), a bounded number of times with growing back-off, and every
exit, restart and give-up is recorded for callbacks and the run's summary.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from torchtitan_grpo.fleet.engine_commands import EngineLaunch, server_command
from torchtitan_grpo.protocol.builtin import API_KEY_ENV
from torchtitan_grpo.net import free_port  # noqa: F401  (shared with the weight push; re-exported here)

logger = logging.getLogger(__name__)



@dataclass
class ServerSpec:
    """How to start one server: the built-in one, or a real engine (``engine_commands``)."""

    model_dir: str
    device: str = "cpu"
    dtype: str = "float32"
    host: str = "127.0.0.1"
    threads: int = 1
    seed: int = 0
    api_key: str = ""
    """When set, the server requires it (handed over in ``GRPO_API_KEY``, not
    on its command line) and is probed with it."""
    extra_args: tuple[str, ...] = ()
    """Appended to the server's command line (e.g. benchmarks' debug knobs); a list works too."""
    engine: str = "builtin"
    """"builtin", "vllm" or "sglang" (``engine_commands.ENGINES``)."""
    launch: EngineLaunch = field(default_factory=EngineLaunch)
    """A real engine's own settings (memory share, context, served name, weight transfer)."""


@dataclass
class ServerProcess:
    """One launched server. ``proc`` is replaced in place when the supervisor
    restarts it; ``url``, ``port`` and ``log_path`` never change."""

    url: str
    port: int
    log_path: str
    proc: subprocess.Popen


class ServerStartError(RuntimeError):
    """A server that did not come up; ``summary`` is the one line for the user
    (its first error and where its log is), the message adds the log's tail."""

    def __init__(self, message: str, summary: str = ""):
        super().__init__(message)
        self.summary = summary or message.splitlines()[0]


_ERROR_LINE = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)")


def root_cause(path: str) -> str:
    """The first exception line (``SomeError: message``) of the newest start
    in a server's log: a real engine's own report of a failed start ends on
    its wrapper's error ("Engine core initialization failed. See root cause
    above"), while the cause is logged first (vLLM 0.26 on an H200: a missing
    module of its IPC engine). "" if there is none."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    newest = text.rsplit("\n=== ", 1)[-1]  # _spawn heads each start with its command line
    for line in newest.splitlines():
        m = _ERROR_LINE.search(line)
        if m:
            return f"{m.group(1)}: {m.group(2).strip()}"[:300]
    return ""


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


def _healthy(url: str, api_key: str = "") -> bool:
    # The built-in server exempts /health from the key; other engines may not.
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/health", headers=headers), timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _spawn(spec: ServerSpec, log_path: str, port: int | None = None) -> tuple[subprocess.Popen, int]:
    """Start one server process on ``port``, by default one that is free right now."""
    port = free_port(spec.host) if port is None else port
    cmd, engine_env = server_command(spec, port)
    env = dict(os.environ, OMP_NUM_THREADS=str(spec.threads), PYTHONUNBUFFERED="1")
    env.pop(API_KEY_ENV, None)  # a key of the user's shell must not lock a server the trainer calls without one
    env |= engine_env  # each engine's own way of taking its API key among them
    # torchrun's rendezvous variables must not leak into the server. Above all
    # TORCHELASTIC_USE_AGENT_STORE: with it, torch's tcp:// rendezvous makes
    # every rank a client of a store torchrun's agent would host, so a vLLM
    # worker's own one-rank group waited for a store nobody serves (seen on an
    # H200: the launched vLLM hung at its distributed init until killed).
    for k in [k for k in env if k.startswith("TORCHELASTIC_")] + [
            "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE"]:
        env.pop(k, None)
    shown = ["***" if i and cmd[i - 1] == "--api-key" else a for i, a in enumerate(cmd)]  # a key in extra_args
    with open(log_path, "ab") as log:
        log.write(f"\n=== {' '.join(shown)}\n".encode())
        log.flush()
        # PR_SET_PDEATHSIG fires when the *thread* that forked exits, so this
        # must run on a long-lived thread (the caller's or the supervisor's
        # watcher), never a pool worker.
        # A session of its own: torchrun stops a worker by signalling the worker's whole
        # process group, and a terminal's Ctrl-C reaches its foreground group; the
        # servers must not die with the trainer's signal (the run saw them "exit",
        # restarted and ejected them while stopping). The trainer stops them itself,
        # and PR_SET_PDEATHSIG still ends them if it is killed.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
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
                what = (f"inference server ({specs[i].engine}) on port {procs[i][1]} did not answer /health "
                        f"within {timeout_s:.0f}s (inference.startup_timeout_s)")
                raise ServerStartError(f"{what}; last lines of {logs[i]}:\n{log_tail(logs[i])}",
                                       f"{what}; its log: {logs[i]}")
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
                    cause = root_cause(logs[i])
                    what = f"inference server ({specs[i].engine}) exited with code {proc.returncode} during start-up"
                    raise ServerStartError(
                        f"{what}{': ' + cause if cause else ''}; last lines of {logs[i]}:\n{tail}",
                        f"{what}{': ' + cause if cause else ''}; its log: {logs[i]}")
                if _healthy(url, specs[i].api_key):
                    logger.info("inference server %s ready (pid %d, log %s)", url, proc.pid, logs[i])
                    ready[i] = ServerProcess(url, port, logs[i], proc)
            time.sleep(0.25)
    except BaseException:
        for proc, _ in procs:
            stop_process(proc)
        raise
    return ready  # type: ignore[return-value]


def stop_process(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace_s)
    sweep_group(proc)


def sweep_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the process group ``proc`` leads (every server
    is started in a session of its own): a real engine runs its model in child
    processes (vLLM's engine core), which a killed server leaves behind
    holding the GPU's memory, and a restart on that GPU would not fit."""
    try:
        if os.getpgid(proc.pid) != proc.pid:
            return
    except ProcessLookupError:
        pass  # the leader is reaped; its group may still have members
    except OSError:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def describe_exit(code: int) -> str:
    """A process's return code in words: exit code N, or killed by SIGNAME."""
    if code >= 0:
        return f"exit code {code}"
    return f"killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"signal {-code}"


@dataclass
class ReplicaEvent:
    """Something that happened to a launched server, as its supervisor saw it."""

    time: float  # wall clock, time.time()
    url: str
    kind: str
    """"exited" (it was serving), "restart_failed" (an attempt did not come
    up), "restarted" (serving again on the same URL) or "gave_up"."""
    detail: str = ""


@dataclass
class _Watched:
    """The supervisor's bookkeeping for one server (changed by the watcher only)."""

    server: ServerProcess
    spec: ServerSpec
    state: str = "up"  # up | waiting (back-off before a restart) | starting | gave_up
    attempts: int = 0  # restart attempts so far, over the whole run
    due: float = 0.0  # monotonic: when to restart (waiting), to stop waiting for /health (starting)


class Supervisor:
    """Restarts launched servers that exit, from a daemon thread polling them
    (no event loop needed). Restarts reuse the port, wait ``backoff_s``, then
    twice that..., and stop after ``max_restarts`` attempts per server over the
    run (0: record exits only); an attempt that dies at start-up or is not
    healthy within ``startup_timeout_s`` counts. ``on_event(event)`` (settable
    later) runs on the watcher thread: keep it quick and thread-safe, e.g.
    ``loop.call_soon_threadsafe``. Restarted servers are forked by the watcher,
    so they get SIGTERM when it ends (PR_SET_PDEATHSIG): stop() is for shutdown.
    """

    def __init__(self, servers: list[ServerProcess], specs: list[ServerSpec], startup_timeout_s: float,
                 max_restarts: int = 3, backoff_s: float = 1.0, poll_s: float = 0.5,
                 on_event: Callable[[ReplicaEvent], None] | None = None):
        self._watched = {s.url: _Watched(s, spec) for s, spec in zip(servers, specs)}
        self.startup_timeout_s, self.max_restarts, self.backoff_s = startup_timeout_s, max_restarts, backoff_s
        self.poll_s, self.on_event = poll_s, on_event
        self._events: list[ReplicaEvent] = []
        # Held while (re)spawning and by stop(): once stop() returns, no new
        # process appears and every spawned one is in its ServerProcess.
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- any thread -------------------------------------------------------- #
    @property
    def events(self) -> list[ReplicaEvent]:
        """A copy of the events so far, oldest first."""
        with self._lock:
            return list(self._events)

    def alive(self, url: str) -> bool:
        """Whether ``url``'s process is running and passed /health since its
        last (re)start. KeyError for a URL this supervisor did not launch."""
        w = self._watched[url.rstrip("/")]
        return w.state == "up" and w.server.proc.poll() is None

    def gave_up(self, url: str) -> bool:
        """Whether ``url`` exited and will not be restarted again."""
        return self._watched[url.rstrip("/")].state == "gave_up"

    def counts(self) -> dict[str, int]:
        """How many events of each kind, for a run's summary (the table: ``format_events``)."""
        return dict(collections.Counter(e.kind for e in self.events))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="server-supervisor", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop watching: nothing is restarted after this returns."""
        with self._lock:
            self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # ---- watcher thread ---------------------------------------------------- #
    def _watch(self) -> None:
        while not self._stopping.wait(self.poll_s):
            for w in list(self._watched.values()):
                if self._stopping.is_set():  # shutting down: report nothing more
                    return
                try:
                    self._step(w)
                except Exception:  # one bad step must not end the supervision of all
                    logger.exception("supervising inference server %s", w.server.url)

    def _step(self, w: _Watched) -> None:
        proc = w.server.proc
        if w.state == "up" and proc.poll() is not None:
            self._failed(w, "exited", f"pid {proc.pid} {describe_exit(proc.returncode)}")
        elif w.state == "waiting" and time.monotonic() >= w.due:
            self._respawn(w)
        elif w.state == "starting":
            if proc.poll() is not None:
                self._failed(w, "restart_failed", f"{describe_exit(proc.returncode)} during start-up")
            elif _healthy(w.server.url, w.spec.api_key):
                w.state = "up"
                detail = f"pid {proc.pid}, attempt {w.attempts}/{self.max_restarts}"
                self._record(w, "restarted", detail)
                logger.warning("inference server %s restarted on the same port (%s)", w.server.url, detail)
            elif time.monotonic() > w.due:
                stop_process(proc)
                self._failed(w, "restart_failed", f"no /health within {self.startup_timeout_s:.0f}s")

    def _failed(self, w: _Watched, kind: str, what: str) -> None:
        """Record an exit or a failed restart, plan the next attempt or give
        up, and say all of it on one log line with the end of the log."""
        self._record(w, kind, what)
        if w.attempts >= self.max_restarts:
            w.state = "gave_up"
            plan = ("not restarting it (inference.server_max_restarts = 0)" if self.max_restarts == 0 else
                    f"giving up on it after {w.attempts} restart attempt(s)")
        else:
            delay = self.backoff_s * 2 ** w.attempts
            w.attempts += 1
            w.state, w.due = "waiting", time.monotonic() + delay
            plan = f"restarting it on the same port in {delay:.1f}s (attempt {w.attempts}/{self.max_restarts})"
        tail = " | ".join(line.strip() for line in log_tail(w.server.log_path, 5).splitlines() if line.strip())
        logger.log(logging.ERROR if w.state == "gave_up" else logging.WARNING,
                   "inference server %s %s: %s; %s; its log %s ends: %s", w.server.url,
                   kind.replace("_", " "), what, plan, w.server.log_path, tail)
        if w.state == "gave_up":
            self._record(w, "gave_up", "restarts off (inference.server_max_restarts = 0)" if self.max_restarts == 0
                         else f"after {w.attempts} restart attempt(s)")

    def _respawn(self, w: _Watched) -> None:
        with self._lock:
            if self._stopping.is_set():
                return
            sweep_group(w.server.proc)  # an engine's children of the exited server still hold its GPU memory
            try:
                w.server.proc, _ = _spawn(w.spec, w.server.log_path, port=w.server.port)
            except OSError as e:  # e.g. out of processes: counts as an attempt
                error = f"cannot start: {e}"
            else:
                w.state, w.due = "starting", time.monotonic() + self.startup_timeout_s
                return
        self._failed(w, "restart_failed", error)  # outside the lock: _record takes it

    def _record(self, w: _Watched, kind: str, detail: str) -> None:
        event = ReplicaEvent(time.time(), w.server.url, kind, detail)
        with self._lock:
            self._events.append(event)
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # a faulty listener must not stop the restarts
                logger.exception("on_event callback failed for %s", event)


def format_events(events: list[ReplicaEvent]) -> str:
    """The events as a short text table for the end-of-run summary."""
    if not events:
        return "inference replicas: no events"
    width = max(len(e.url) for e in events)
    rows = [f"inference replicas: {len(events)} event(s)",
            f"  {'time':8}  {'server':{width}}  {'event':14}  detail"]
    rows += [f"  {time.strftime('%H:%M:%S', time.localtime(e.time))}  {e.url:{width}}  {e.kind:14}  {e.detail}"
             for e in events]
    return "\n".join(rows)


class LaunchedServers(list):
    """What ``running_servers`` yields: the ``ServerProcess`` list, as before,
    with the ``Supervisor`` watching them as ``.supervisor``."""

    def __init__(self, servers: list[ServerProcess], supervisor: Supervisor):
        super().__init__(servers)
        self.supervisor = supervisor


@contextlib.contextmanager
def running_servers(specs: list[ServerSpec], log_dir: str, timeout_s: float, *, max_restarts: int = 3,
                    backoff_s: float = 1.0, on_event: Callable[[ReplicaEvent], None] | None = None
                    ) -> Iterator[LaunchedServers]:
    """Start one server per spec, supervise them (see ``Supervisor``; restart
    attempts use ``timeout_s`` too), yield them, always stop them: the
    watcher first, so that nothing is restarted during shutdown.

    SIGTERM is turned into SystemExit for the duration so that torchrun or
    SLURM stopping the trainer still runs the clean-up below.
    """
    started: list[ServerProcess] = []
    supervisor: Supervisor | None = None
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        started = start_servers(specs, log_dir, timeout_s)
        supervisor = Supervisor(started, specs, timeout_s, max_restarts, backoff_s, on_event=on_event)
        supervisor.start()
        yield LaunchedServers(started, supervisor)
    finally:
        if supervisor is not None:
            supervisor.stop()
        for s in started:
            stop_process(s.proc)
        if previous in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
