"""Supervision of the servers the launcher starts (issue 27): a server that
exits is restarted on the same URL, one that keeps dying is given up, and
shutdown restarts nothing. Real built-in servers on CPU with the tiny model;
the waits are hang guards for a loaded machine, not speed checks."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from torchtitan_grpo.fleet.launcher import ReplicaEvent, ServerProcess, ServerSpec, Supervisor, format_events, running_servers

HANG_GUARD_S = 240  # a server start takes 10-30 s on a busy 2-core box


def wait_for(cond, what: str, timeout_s: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def kinds(sup: Supervisor) -> list[str]:
    return [e.kind for e in sup.events]


def get(url: str, key: str = "") -> tuple[int, dict | None]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None
    except OSError:
        return 0, None  # nothing listens


def server_pids_on(port: int) -> list[int]:
    """Built-in server processes started with ``--port port``, whoever started them."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "torchtitan_grpo.server" in args and f"--port\0{port}" in "\0".join(args):
            pids.append(int(pid))
    return pids


def test_killed_server_comes_back_on_its_url_and_shutdown_restarts_nothing(tmp_path, tiny_model_dir):
    seen: list[ReplicaEvent] = []
    spec = ServerSpec(tiny_model_dir, api_key="sesame", extra_args=("--max-batch-size", "3"))
    with running_servers([spec], str(tmp_path), HANG_GUARD_S, on_event=seen.append) as servers:
        (srv,) = servers
        sup, url, first = servers.supervisor, srv.url, srv.proc
        assert sup.alive(url) and not sup.gave_up(url)
        assert get(url + "/model_info")[0] == 401  # --api-key reached the server
        assert get(url + "/model_info", "sesame")[1]["max_batch_size"] == 3  # and so did extra_args

        first.send_signal(signal.SIGKILL)
        first.wait()
        assert not sup.alive(url)  # known at once, before the watcher's next poll
        wait_for(lambda: "restarted" in kinds(sup) or sup.gave_up(url), "the restart")
        assert kinds(sup) == ["exited", "restarted"], format_events(sup.events)
        assert "SIGKILL" in sup.events[0].detail and sup.events[1].url == url
        assert srv.proc is not first and srv.proc.poll() is None
        assert get(url + "/health")[0] == 200 and sup.alive(url)
        assert seen == sup.events  # the callback saw the same events, in order
        assert sup.counts() == {"exited": 1, "restarted": 1}

        # Die again and leave while the restart waits out its back-off (1 s, then 2 s).
        srv.proc.kill()
        wait_for(lambda: kinds(sup).count("exited") == 2, "the second exit")
        port = srv.port
    time.sleep(3.0)  # past the back-off: a watcher still running would have restarted it
    assert kinds(sup) == ["exited", "restarted", "exited"]
    assert get(url + "/health")[0] == 0 and server_pids_on(port) == []
    with open(srv.log_path) as f:
        log = f.read()
    assert log.count("=== ") == 2 and "sesame" not in log  # two starts, the key masked


def test_server_that_keeps_dying_is_given_up(tmp_path, tiny_model_dir):
    """A server whose restart fails during start-up (its model lost its
    config.json) is given up after max_restarts. The first process is a
    stand-in (what it was does not matter once it died); the restart is a
    real built-in server failing to load the model."""
    from tests.server_procs import free_port

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    os.remove(model / "config.json")  # every start fails while loading the model
    port = free_port()
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    srv = ServerProcess(f"http://127.0.0.1:{port}", port, str(tmp_path / "server_0.log"), first)
    sup = Supervisor([srv], [ServerSpec(str(model))], HANG_GUARD_S, max_restarts=1, backoff_s=0.1, poll_s=0.1)
    sup.start()
    try:
        first.kill()
        wait_for(lambda: sup.gave_up(srv.url), "the give-up")
        assert kinds(sup) == ["exited", "restart_failed", "gave_up"], format_events(sup.events)
        assert "during start-up" in sup.events[1].detail and not sup.alive(srv.url)
        assert srv.proc is not first and srv.proc.poll() is not None  # a real start was tried, and it died
        with open(srv.log_path) as f:
            assert "config.json" in f.read()  # of the model it could not load
        table = format_events(sup.events)
        assert "gave_up" in table and srv.url in table and len(table.splitlines()) == 5
    finally:
        sup.stop()
        first.wait()


# ---- without real servers: a sleeping process stands in for one ------------- #

def stand_in(tmp_path) -> ServerProcess:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    return ServerProcess("http://127.0.0.1:9", 9, str(tmp_path / "stand_in.log"), proc)


def test_no_restarts_allowed_records_the_exit_and_gives_up(tmp_path):
    srv = stand_in(tmp_path)
    sup = Supervisor([srv], [ServerSpec("unused")], 5, max_restarts=0, poll_s=0.05)
    sup.start()
    try:
        proc = srv.proc
        proc.kill()
        wait_for(lambda: sup.gave_up(srv.url), "the give-up", 30)
        assert kinds(sup) == ["exited", "gave_up"] and srv.proc is proc  # nothing was started
    finally:
        sup.stop()


def test_stop_cancels_a_pending_restart(tmp_path):
    srv = stand_in(tmp_path)
    sup = Supervisor([srv], [ServerSpec("unused")], 5, max_restarts=3, backoff_s=0.5, poll_s=0.05)
    sup.start()
    proc = srv.proc
    proc.kill()
    wait_for(lambda: kinds(sup) == ["exited"], "the exit", 30)
    sup.stop()
    time.sleep(1.0)  # past the back-off
    assert kinds(sup) == ["exited"] and srv.proc is proc and not sup.gave_up(srv.url)


def test_a_failing_callback_does_not_stop_supervision(tmp_path):
    srv = stand_in(tmp_path)

    def broken(event: ReplicaEvent) -> None:
        raise RuntimeError("listener bug")

    sup = Supervisor([srv], [ServerSpec("unused")], 5, max_restarts=0, poll_s=0.05, on_event=broken)
    sup.start()
    try:
        srv.proc.kill()
        wait_for(lambda: sup.gave_up(srv.url), "the give-up", 30)
        assert kinds(sup) == ["exited", "gave_up"]
    finally:
        sup.stop()


def test_format_events():
    assert format_events([]) == "inference replicas: no events"
    rows = format_events([ReplicaEvent(0.0, "http://h:1", "exited", "killed by SIGKILL"),
                          ReplicaEvent(1.0, "http://h:1", "restarted", "pid 7")]).splitlines()
    assert len(rows) == 4 and rows[2].split()[1:] == ["http://h:1", "exited", "killed", "by", "SIGKILL"]
