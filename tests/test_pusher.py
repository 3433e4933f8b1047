"""The weight-push sidecar over real gloo groups and real built-in servers:
the trainer never waits, replicas skip to the newest version, a version is
never applied half-way, a slow or dead replica is ejected and catches up."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests
import torch
from safetensors.torch import load_file

from torchtitan_grpo.aio import LoopThread
from torchtitan_grpo.fleet.launcher import ServerSpec, start_servers, stop_process
from torchtitan_grpo.protocol.builtin import BuiltinTraits
from torchtitan_grpo.weight_sync.group_push import GroupPush
from torchtitan_grpo.weight_sync.pusher import Pusher, PushConfig
from torchtitan_grpo.weight_sync.transport import Transport

pytestmark = pytest.mark.slow


def _weights(model_dir: str, fill: float) -> dict[str, torch.Tensor]:
    """The model's HF tensors, every element set to ``fill`` (a version marker)."""
    w = load_file(os.path.join(model_dir, "model.safetensors"))
    return {k: torch.full_like(v, fill) for k, v in sorted(w.items())}


def _served_markers(url: str, names) -> set[float]:
    """The set of distinct values across all the server's tensors."""
    vals = set()
    for n in names:
        r = requests.get(url + "/get_weights_by_name", params={"name": n, "truncate_size": 4}, timeout=10)
        r.raise_for_status()
        flat = torch.tensor(r.json()).flatten()
        vals |= set(flat.tolist())
    return vals


def _version(url: str) -> str:
    return requests.get(url + "/model_info", timeout=10).json()["weight_version"]


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Recorder:
    def __init__(self):
        self.ejected, self.readmitted = [], []

    def eject(self, url):
        self.ejected.append(url)

    def readmit(self, url):
        self.readmitted.append(url)


@pytest.fixture
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


def _servers(tmp_path, model_dir, delays):
    specs = [ServerSpec(model_dir, extra_args=["--debug-update-delay-s", str(d), "--weight-group-timeout", "30"])
             for d in delays]
    return start_servers(specs, str(tmp_path / "logs"), 120)


def _reset(url: str) -> None:
    """Close what a finished test's Pusher left open on a shared server (the
    Pusher closes only its own side): its SGLang group and session, its
    vLLM transfer engine, a pause. Each may already be gone."""
    for path, body in (("/destroy_weights_update_group", {"group_name": "weight_update_group"}),
                       ("/end_weight_update", {}), ("/continue_generation", {}),
                       ("/shutdown_weight_transfer_engine", {}), ("/resume", {})):
        requests.post(url + path, json=body, timeout=60)


@pytest.fixture(scope="module")
def _shared_servers(tmp_path_factory, tiny_model_dir):
    """Two built-in servers for the tests that push to one or both of them and
    never stop them: ``srv`` without an update delay and ``slow_update_srv``
    with 0.5 s per update; two starts instead of twenty-six (the fast
    replica of the tests that start a slow one of their own is ``srv`` too).
    Both start at once (start_servers waits for each; a failed start stops
    both): one start-up's wait instead of two in a row."""
    fast, slow = _servers(tmp_path_factory.mktemp("pusher_shared"), tiny_model_dir, [0.0, 0.5])
    try:
        yield {"srv": fast, "slow": slow}
    finally:
        for s in (fast, slow):
            stop_process(s.proc)


@pytest.fixture
def srv(_shared_servers):
    """The shared server without an update delay. Each test connects a
    Pusher of its own (a new weight group, the replica tagged version 0) and
    pushes whole versions before it checks them, so none depends on what the
    one before left there; its group and session are closed after it."""
    yield _shared_servers["srv"]
    _reset(_shared_servers["srv"].url)


@pytest.fixture
def slow_update_srv(_shared_servers):
    """As ``srv``, with 0.5 s per update after its bytes arrived (inside the
    server's update lock), for the session-end ordering tests."""
    yield _shared_servers["slow"]
    _reset(_shared_servers["slow"].url)


def test_async_push_never_waits_and_skips_to_newest(tmp_path, tiny_model_dir, loop, srv):
    """A slow replica (3 s per update), a fast one, ONE staging buffer, and 6
    versions pushed back to back. The trainer's calls never wait for the slow
    replica (each returns before it serves the version pushed; versions are
    skipped while it holds the buffer), both replicas end on the newest
    version, and every replica only ever holds one whole version."""
    fast, (slow,) = srv, _servers(tmp_path, tiny_model_dir, [3.0])  # the fast one: the shared server
    rec = Recorder()
    # One bucket per version (the delay knob acts per update request).
    pusher = Pusher(loop, [fast.url, slow.url], PushConfig(mode="async", bucket_bytes=4 << 20,
                    num_staging_buffers=1, deadline_s=30), torch.device("cpu"),
                    on_eject=rec.eject, on_readmit=rec.readmit)
    try:
        pusher.connect(initial_version=0)
        names = list(_weights(tiny_model_dir, 0.0))
        slow_at_return = []
        for v in range(1, 7):
            pusher.push(_weights(tiny_model_dir, float(v)), version=v)
            slow_at_return.append(pusher.replicas[1].version)
            if v == 1:  # the slow replica holds the only buffer now, for its 3 s update
                _wait(lambda: pusher.replicas[1].busy, 60, "the slow replica's transfer of version 1")
        # A push waiting for the slow replica's update would return with it served.
        assert all(seen < v for v, seen in enumerate(slow_at_return, 1)), slow_at_return
        assert pusher.skipped_versions >= 1  # the only buffer was busy with the slow replica
        m = pusher.push(_weights(tiny_model_dir, 7.0), version=7, wait=True)  # a run's last version
        assert _version(fast.url) == _version(slow.url) == "7"
        st = {s["url"]: s for s in pusher.status()}
        assert st[slow.url]["transfers"] < 7  # it skipped intermediate versions
        for u in (fast.url, slow.url):
            assert _served_markers(u, names) == {7.0}  # all tensors from one version
        assert rec.ejected == []
        # Generations are tagged with the version that produced them.
        g = requests.post(fast.url + "/generate", json={"input_ids": [19, 31], "sampling_params": {
            "max_new_tokens": 2, "temperature": 0}, "return_logprob": True}, timeout=30).json()
        assert g["meta_info"]["weight_version"] == "7"
    finally:
        pusher.close()
        stop_process(slow.proc)


def test_sync_push_waits_for_every_replica(tmp_path, tiny_model_dir, loop, srv):
    a, (b,) = srv, _servers(tmp_path, tiny_model_dir, [0.3])  # a: the shared server
    pusher = Pusher(loop, [a.url, b.url], PushConfig(mode="sync", bucket_bytes=32 << 10), torch.device("cpu"))
    try:
        pusher.connect(initial_version=0)
        names = list(_weights(tiny_model_dir, 0.0))
        for v in (1, 2):
            m = pusher.push(_weights(tiny_model_dir, float(v)), version=v)
            # When push returns, both replicas already serve v, whole.
            assert _version(a.url) == _version(b.url) == str(v)
            assert _served_markers(b.url, names) == {float(v)}
            assert m["time/push_s"] >= 0.3  # it waited for the slow one
            assert m["push/replica1_version_lag"] == 0
            # per-replica rate of the newest transfer: the slowed one is slower
            assert 0 < m["push/replica1_GBps"] < m["push/replica0_GBps"]
    finally:
        pusher.close()
        stop_process(b.proc)


def test_replica_missing_deadline_is_ejected_and_trainer_goes_on(tmp_path, tiny_model_dir, loop, srv):
    """A replica slower than the deadline is ejected from routing; the other
    keeps up; the trainer's push returns before the late replica's deadline
    (it never waits for it); the abandoned version is never loaded."""
    ok, (late,) = srv, _servers(tmp_path, tiny_model_dir, [4.0])  # the healthy one: the shared server
    rec = Recorder()
    pusher = Pusher(loop, [ok.url, late.url], PushConfig(mode="async", bucket_bytes=1 << 20, deadline_s=2.0,
                    reconnect_interval_s=60), torch.device("cpu"), on_eject=rec.eject, on_readmit=rec.readmit)
    try:
        pusher.connect(initial_version=0)
        pusher.push(_weights(tiny_model_dir, 1.0), version=1)
        # Its transfer starts once published, at the push's end: a push that
        # waited for it would return after its 2 s deadline, the ejection.
        assert rec.ejected == []
        _wait(lambda: rec.ejected == [late.url], 60, "the late replica's ejection")
        _wait(lambda: _version(ok.url) == "1", 20, "the healthy replica at version 1")
        pusher.push(_weights(tiny_model_dir, 2.0), version=2)
        _wait(lambda: _version(ok.url) == "2", 20, "the healthy replica at version 2")
        st = {s["url"]: s for s in pusher.status()}
        assert not st[late.url]["admitted"] and "deadline" in st[late.url]["eject_reason"]
        assert st[ok.url]["admitted"] and rec.readmitted == []
        # The abandoned version 1 is never loaded (its session's end was
        # pipelined on the connection the ejection closed, and the replica is
        # not rejoined before reconnect_interval_s): the late replica still
        # serves all of the original checkpoint, as version 0.
        original = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
        for n in sorted(original):
            served = requests.get(late.url + "/get_weights_by_name", params={"name": n, "truncate_size": 4},
                                  timeout=10).json()
            assert torch.equal(torch.tensor(served).flatten(), original[n][:4].flatten()), n  # first 4 rows
        assert _version(late.url) == "0"
    finally:
        pusher.close()
        stop_process(late.proc)


def test_killed_replica_is_ejected_then_catches_up_before_readmission(tmp_path, tiny_model_dir, loop):
    """Kill a replica mid-transfer (SIGKILL), restart it on the same port: the
    sidecar reconnects, sends it the newest version, and only then readmits it."""
    (srv,) = _servers(tmp_path, tiny_model_dir, [2.0])
    rec = Recorder()
    pusher = Pusher(loop, [srv.url], PushConfig(mode="async", bucket_bytes=1 << 20, deadline_s=5.0,
                    init_timeout_s=20, reconnect_interval_s=0.5), torch.device("cpu"),
                    on_eject=rec.eject, on_readmit=rec.readmit)
    restarted = None
    try:
        pusher.connect(initial_version=0)
        pusher.push(_weights(tiny_model_dir, 1.0), version=1)
        time.sleep(0.5)  # the transfer is in the server's 2 s update handler now
        srv.proc.kill()
        srv.proc.wait()
        _wait(lambda: rec.ejected == [srv.url], 20, "ejection of the killed replica")
        pusher.push(_weights(tiny_model_dir, 3.0), version=3)  # the trainer goes on meanwhile
        cmd = [sys.executable, "-m", "torchtitan_grpo.server", "--model", tiny_model_dir,
               "--port", str(srv.port), "--debug-update-delay-s", "0"]
        restarted = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
        _wait(lambda: rec.readmitted == [srv.url], 180, "readmission after catch-up")  # a restart on a busy box
        assert _version(srv.url) == "3"  # readmitted only with the newest version
        assert _served_markers(srv.url, list(_weights(tiny_model_dir, 0.0))) == {3.0}
    finally:
        pusher.close()
        stop_process(srv.proc)
        if restarted is not None:
            stop_process(restarted)



def test_vllm_protocol_push_in_packed_chunks(srv, tiny_model_dir, loop):
    """The vLLM weight-transfer sequence (pause, start, update_weights with
    packed chunks broadcast meanwhile, finish(version), resume) against the
    built-in server's vLLM routes: whole versions arrive, the version is set."""
    pusher = Pusher(loop, [srv.url], PushConfig(mode="sync", protocol="vllm", packed_buffer_bytes=20_000),
                    torch.device("cpu"))
    try:
        pusher.connect(initial_version=0)
        names = list(_weights(tiny_model_dir, 0.0))
        assert len(pusher.staging.plan or []) == 0  # planned at the first push
        for v in (1, 2):
            pusher.push(_weights(tiny_model_dir, float(v)), version=v)
            info = requests.get(srv.url + "/weight_info", timeout=10).json()
            assert info["weight_version"] == str(v)
            assert _served_markers(srv.url, names) == {float(v)}
        assert len(pusher.staging.plan) > 1  # several packed chunks were sent
        out = requests.post(srv.url + "/v1/completions", json={"prompt": [19, 31], "max_tokens": 2,
                            "temperature": 0, "return_weight_versions": True}, timeout=30)
        assert out.status_code == 200, out.text
    finally:
        pusher.close()


@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_replica_joining_from_file_gets_newest_weights_before_traffic(tmp_path, tiny_model_dir, loop, monkeypatch,
                                                                       backend):
    """The pool reads a launcher's replica file; a replica added mid-run is
    held as catching-up, joined by the pusher's transport (gloo: its weight
    group; ipc: asked for its ranks), sent the newest version, and only then
    routed to."""
    from torchtitan_grpo.fleet.pool import InferencePool, PoolConfig

    a, b = _servers(tmp_path, tiny_model_dir, [0.0, 0.0])
    listing = tmp_path / "replicas.txt"
    listing.write_text(a.url + "\n")
    rec = Recorder()
    pool = InferencePool([], PoolConfig(replica_file=str(listing), replica_file_interval_s=0.2,
                                        health_interval_s=0.2))
    before = torch.multiprocessing.get_sharing_strategy()
    pusher = Pusher(loop, [], PushConfig(mode="async", backend=backend, bucket_bytes=32 << 10), torch.device("cpu"),
                    on_eject=pool.eject, on_readmit=lambda u: (rec.readmit(u), pool.readmit(u)))
    pool.on_join = pusher.add_replica
    probed = []
    real_connect = pusher.transport.connect

    async def connect(r):
        probed.append(r.url)
        await real_connect(r)

    monkeypatch.setattr(pusher.transport, "connect", connect)
    try:
        loop.run(pool.start())
        _wait(lambda: pool.states().get(a.url) == "healthy", 30, "replica a from the file")
        pusher.connect(initial_version=0)
        pusher.push(_weights(tiny_model_dir, 1.0), version=1, wait=True)
        assert _version(a.url) == "1"
        listing.write_text(a.url + "\n" + b.url + "\n")  # a launcher adds replica b
        _wait(lambda: b.url in pool.states(), 30, "replica b listed")
        assert pool.states()[b.url] == "catching-up" or rec.readmitted == [b.url]
        _wait(lambda: rec.readmitted == [b.url], 60, "replica b readmitted after catching up")
        assert _version(b.url) == "1"
        assert _served_markers(b.url, list(_weights(tiny_model_dir, 0.0))) == {1.0}
        _wait(lambda: pool.states()[b.url] == "healthy", 30, "replica b routable")
        assert probed == [a.url, b.url]  # a at connect, b once listed
        assert all((r.group is not None) is (backend == "gloo") for r in pusher.replicas)
    finally:
        pusher.close()
        loop.run(pool.close())
        torch.multiprocessing.set_sharing_strategy(before)
        for s in (a, b):
            stop_process(s.proc)


def test_push_in_bfloat16_casts_inside_the_snapshot(srv, tiny_model_dir, loop):
    """weight_sync.dtype = bfloat16: fp32 trainer weights are sent as bf16
    (half the bytes); an fp32 server then holds exactly the bf16-rounded values."""
    pusher = Pusher(loop, [srv.url], PushConfig(mode="sync", dtype=torch.bfloat16), torch.device("cpu"))
    try:
        pusher.connect(initial_version=0)
        w = _weights(tiny_model_dir, 1.1)  # 1.1 is not a bf16 number
        m = pusher.push(w, version=1)
        assert m["push/bytes"] == sum(t.numel() * 2 for t in w.values())
        expected = torch.tensor(1.1).to(torch.bfloat16).float().item()
        assert expected != pytest.approx(1.1, abs=1e-6)
        assert _served_markers(srv.url, list(w)) == {expected}
    finally:
        pusher.close()


def test_disk_transport_writes_each_version_once(srv, slow_update_srv, tmp_path, tiny_model_dir, loop):
    """transport "disk": a version is written once as safetensors into the
    shared folder and loaded by every replica with /update_weights_from_disk;
    only the newest two versions are kept on disk."""
    a, b = srv, slow_update_srv
    folder = tmp_path / "pushed"
    pusher = Pusher(loop, [a.url, b.url], PushConfig(mode="sync", backend="disk", disk_folder=str(folder)),
                    torch.device("cpu"))
    try:
        pusher.connect(initial_version=0)
        names = list(_weights(tiny_model_dir, 0.0))
        for v in (1, 2, 3):
            pusher.push(_weights(tiny_model_dir, float(v)), version=v)
            for u in (a.url, b.url):
                assert _version(u) == str(v)
                assert _served_markers(u, names) == {float(v)}
        assert sorted(p.name for p in folder.iterdir()) == ["v2", "v3"]
        assert load_file(str(folder / "v3" / "model.safetensors")).keys() == set(names)
    finally:
        pusher.close()


def _record_requests(monkeypatch, events: list, lock) -> None:
    """Append ("post", path) when the pusher sends a control request and
    ("reply", path) when its reply is in, for requests of their own
    (``control.post``) and pipelined ones (``PipelinedConnection.post``) alike."""
    from torchtitan_grpo.weight_sync import control

    real_post, real_pipelined = control.post, control.PipelinedConnection.post

    async def post(session, url, body, timeout_s, params=None):
        path = url[url.rindex("/"):]
        with lock:
            events.append(("post", path))
        out = await real_post(session, url, body, timeout_s, params)
        with lock:
            events.append(("reply", path))
        return out

    def pipelined(self, path, body, params=None):
        with lock:
            events.append(("post", path))
        fut = real_pipelined(self, path, body, params)

        def replied(f):
            if not f.cancelled() and f.exception() is None:
                with lock:
                    events.append(("reply", path))

        fut.add_done_callback(replied)
        return fut

    monkeypatch.setattr(control, "post", post)
    monkeypatch.setattr(control.PipelinedConnection, "post", pipelined)


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_control_plane_runs_while_the_trainer_stages(srv, tiny_model_dir, loop, monkeypatch, protocol,
                                                     pipelined):
    """A version reaches its sender before the trainer's snapshot is done:
    the session is opened (SGLang begin, vLLM start) and the first update
    request posted while the trainer is still staging; the bytes are sent
    only once it is written, so the replica serves exactly the new version."""
    import threading

    events: list[tuple[str, str]] = []
    _record_requests(monkeypatch, events, threading.Lock())
    opener = "/begin_weight_update" if protocol == "sglang" else "/start_weight_update"
    pusher = Pusher(loop, [srv.url], PushConfig(mode="sync", protocol=protocol, bucket_bytes=32 << 10,
                                                packed_buffer_bytes=20_000, pipelined=pipelined),
                    torch.device("cpu"))
    stage_real = pusher.staging.stage
    during: list[bool] = []

    def stage(s, t):
        deadline = time.monotonic() + 10
        while ("reply", opener) not in events and time.monotonic() < deadline:
            time.sleep(0.01)
        during.append(("reply", opener) in events)  # the session opens while this waits
        time.sleep(0.3)  # and the first update request is in: the replica waits on its receive
        stage_real(s, t)

    try:
        pusher.connect(initial_version=0)
        names = list(_weights(tiny_model_dir, 0.0))
        pusher.staging.stage = stage
        for v in (1, 2):
            events.clear()
            pusher.push(_weights(tiny_model_dir, float(v)), version=v)
            assert _served_markers(srv.url, names) == {float(v)}
            assert _version(srv.url) == str(v)
        assert during == [True, True]
    finally:
        pusher.close()


@pytest.mark.parametrize("builtin,pipelined", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_session_end_goes_out_with_the_last_byte_only_to_the_builtin_server(
        slow_update_srv, tiny_model_dir, loop, monkeypatch, protocol, builtin, pipelined):
    """The built-in server (its /model_info says so) takes a session's end
    after the update in flight, so the pusher posts the end (SGLang end, vLLM
    finish) as soon as the last bucket has arrived (pipelined: with the last
    update request), before that update's reply; anything else (a real SGLang
    or vLLM: the same routes without the marker) gets it only after the
    reply, pipelining asked for or not. Either way the version is loaded whole."""
    import threading

    update = "/update_weights_from_distributed" if protocol == "sglang" else "/update_weights"
    end = "/end_weight_update" if protocol == "sglang" else "/finish_weight_update"
    events: list[tuple[str, str]] = []
    _record_requests(monkeypatch, events, threading.Lock())
    if not builtin:
        async def not_builtin(self, r):
            return BuiltinTraits()

        monkeypatch.setattr(Transport, "probe_builtin", not_builtin)
    # 0.5 s per update after its bytes arrived (inside the server's update lock).
    srv = slow_update_srv
    pusher = Pusher(loop, [srv.url], PushConfig(mode="sync", protocol=protocol, bucket_bytes=192 << 10,
                                                packed_buffer_bytes=20_000, pipelined=pipelined),
                    torch.device("cpu"))
    try:
        pusher.connect(initial_version=0)
        assert pusher.replicas[0].builtin is builtin
        names = list(_weights(tiny_model_dir, 0.0))
        events.clear()
        pusher.push(_weights(tiny_model_dir, 1.0), version=1)
        assert _served_markers(srv.url, names) == {1.0} and _version(srv.url) == "1"
        last_reply = max(i for i, e in enumerate(events) if e == ("reply", update))
        end_post = events.index(("post", end))
        assert (end_post < last_reply) is builtin, events
    finally:
        pusher.close()


@pytest.mark.parametrize("builtin", [True, False])
def test_sglang_version_rides_with_the_end_only_to_a_builtin_server_that_says_it_takes_it(
        srv, tiny_model_dir, loop, monkeypatch, builtin):
    """The built-in server's /end_weight_update takes the session's version
    (``end_weight_version`` in /model_info): its update bodies are then the
    same bytes every version (encoded once here, parsed once there) and the
    end carries ``weight_version``. Anything else (a real SGLang: the same
    routes without the marker) gets SGLang's own order: the version in the
    last bucket's update and an empty end. Either way the version is loaded
    whole and named right."""
    import threading

    from torchtitan_grpo.weight_sync import control

    sent: list[tuple[str, dict]] = []
    lock = threading.Lock()
    real_post, real_pipelined = control.post, control.PipelinedConnection.post

    def record(url_or_path: str, body) -> None:
        path = url_or_path[url_or_path.rindex("/"):]
        if path in ("/update_weights_from_distributed", "/end_weight_update"):
            with lock:
                sent.append((path, json.loads(body) if isinstance(body, bytes) else dict(body or {})))

    async def post(session, url, body, timeout_s, params=None):
        record(url, body)
        return await real_post(session, url, body, timeout_s, params)

    def pipelined(self, path, body, params=None):
        record(path, body)
        return real_pipelined(self, path, body, params)

    monkeypatch.setattr(control, "post", post)
    monkeypatch.setattr(control.PipelinedConnection, "post", pipelined)
    if not builtin:
        async def not_builtin(self, r):
            return BuiltinTraits()

        monkeypatch.setattr(Transport, "probe_builtin", not_builtin)
    pusher = Pusher(loop, [srv.url], PushConfig(mode="sync", protocol="sglang", bucket_bytes=32 << 10),
                    torch.device("cpu"))
    try:
        pusher.connect(initial_version=0)
        assert pusher.replicas[0].end_version is builtin
        names = list(_weights(tiny_model_dir, 0.0))
        bodies = {}
        for v in (1, 2):
            sent.clear()
            pusher.push(_weights(tiny_model_dir, float(v)), version=v)
            assert _served_markers(srv.url, names) == {float(v)} and _version(srv.url) == str(v)
            updates = [b for p, b in sent if p == "/update_weights_from_distributed"]
            ends = [b for p, b in sent if p == "/end_weight_update"]
            assert len(updates) == len(pusher.staging.plan) > 1 and len(ends) == 1, sent
            assert [u["flush_cache"] for u in updates] == [False] * (len(updates) - 1) + [True]
            if builtin:
                assert all(u["weight_version"] is None for u in updates), updates
                assert ends == [{"weight_version": str(v)}]
            else:
                assert [u["weight_version"] for u in updates] == [None] * (len(updates) - 1) + [str(v)]
                assert ends == [{}]
            bodies[v] = [{k: x for k, x in u.items() if k != "weight_version"} for u in updates]
        assert bodies[1] == bodies[2]
    finally:
        pusher.close()


@pytest.mark.parametrize("ack", [True, False])
@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_pipelined_requests_go_out_before_the_replies_they_follow(srv, tiny_model_dir, loop, monkeypatch,
                                                                  protocol, ack):
    """To the built-in server a transfer's requests all go out at once on one
    connection (vLLM: start, update, finish, resume; SGLang: begin, every
    bucket's update, end, continue), the pause first, or with ``ack_posted``
    just before the end (the updates answered once posted, it is handled
    while the bytes arrive); the broadcasts still wait for the opened session
    (and SGLang's bucket k for the reply to k-1); the connection is kept for
    the next transfer unless it has been idle too long, and every version is
    whole."""
    import threading

    from torchtitan_grpo.weight_sync import control

    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    _record_requests(monkeypatch, events, lock)
    real_broadcast, real_open = GroupPush.broadcast_all, control.PipelinedConnection.open
    opened: list[str] = []

    def broadcast(r, staged, buckets, stop, wait=True):
        with lock:
            events.append(("broadcast", str(buckets[0])))
        return real_broadcast(r, staged, buckets, stop, wait)

    async def open_(self, timeout_s):
        opened.append(self.url)
        return await real_open(self, timeout_s)

    monkeypatch.setattr(GroupPush, "broadcast_all", staticmethod(broadcast))
    monkeypatch.setattr(control.PipelinedConnection, "open", open_)
    pusher = Pusher(loop, [srv.url], PushConfig(mode="sync", protocol=protocol, bucket_bytes=32 << 10,
                                                packed_buffer_bytes=20_000, pause_mode="abort", ack_posted=ack),
                    torch.device("cpu"))
    try:
        pusher.connect(initial_version=0)
        names = list(_weights(tiny_model_dir, 0.0))
        for v in (1, 2):
            events.clear()
            pusher.push(_weights(tiny_model_dir, float(v)), version=v)
            assert _served_markers(srv.url, names) == {float(v)} and _version(srv.url) == str(v)
            first_reply = next(i for i, e in enumerate(events) if e[0] == "reply")
            first_broadcast = events.index(("broadcast", "0"))
            if protocol == "vllm":
                pause = "/pause"
                opening = ["/start_weight_update", "/update_weights"]
                closing = ["/finish_weight_update", "/resume"]
                assert events.index(("reply", "/start_weight_update")) < first_broadcast, events
            else:
                n = len(pusher.staging.plan)
                assert n > 2  # several buckets
                pause = "/pause_generation"
                opening = ["/begin_weight_update"] + ["/update_weights_from_distributed"] * n
                closing = ["/end_weight_update", "/continue_generation"]
                assert events.index(("reply", "/begin_weight_update")) < first_broadcast, events
            posted = opening + [pause] + closing if ack else [pause] + opening + closing
            assert [p for kind, p in events[:first_reply] if kind == "post"] == posted, events
            assert pusher.replicas[0].ack_posted  # the server takes ?ack=posted on both update routes
            if protocol == "sglang":
                replies = [i for i, e in enumerate(events) if e == ("reply", "/update_weights_from_distributed")]
                for k in range(1, n):  # bucket k is broadcast after the reply to k-1
                    assert replies[k - 1] < events.index(("broadcast", str(k))), events
        assert opened == [srv.url]  # one connection for both transfers
        from torchtitan_grpo.weight_sync import builtin_push

        monkeypatch.setattr(builtin_push, "CONN_MAX_IDLE_S", 0.0)  # too old to reuse: a new one
        pusher.push(_weights(tiny_model_dir, 3.0), version=3)
        assert _served_markers(srv.url, names) == {3.0} and _version(srv.url) == "3"
        assert opened == [srv.url, srv.url]
    finally:
        pusher.close()


@pytest.mark.parametrize("protocol,bad_at", [("sglang", -1), ("vllm", -1), ("sglang", 0)])
def test_a_refused_pipelined_update_leaves_the_replica_whole_and_generating(srv, tiny_model_dir, loop,
                                                                           protocol, bad_at):
    """An update the replica refuses (a tensor of the wrong shape) fails the
    pipelined transfer: the replica keeps the version it had, is not left
    paused, is ejected, and is readmitted once a good version has reached
    it. SGLang's updates ask for ``?ack=posted`` (refused before anything is
    posted), yet the first bucket goes out once the session is open, before
    its update's reply (``bad_at`` 0): that transfer fails all the same, and
    the group is made anew before the next."""
    rec = Recorder()
    pusher = Pusher(loop, [srv.url], PushConfig(mode="sync", protocol=protocol, bucket_bytes=32 << 10,
                                                packed_buffer_bytes=20_000, pause_mode="abort", deadline_s=30,
                                                reconnect_interval_s=0.2),
                    torch.device("cpu"), on_eject=rec.eject, on_readmit=rec.readmit)
    try:
        pusher.connect(initial_version=0)
        good = _weights(tiny_model_dir, 1.0)
        names = list(good)
        pusher.push(good, version=1)
        bad = _weights(tiny_model_dir, 2.0)
        bad[names[bad_at]] = torch.full((3, 5), 2.0)  # not the model's shape
        pusher.push(bad, version=2)  # returns: the only replica was ejected
        assert rec.ejected == [srv.url]
        assert "shape mismatch" in pusher.replicas[0].eject_reason, pusher.replicas[0].eject_reason
        assert _served_markers(srv.url, names) == {1.0} and _version(srv.url) == "1"
        if protocol == "vllm":
            assert requests.get(srv.url + "/is_paused", timeout=10).json() == {"is_paused": False}
        else:  # a paused SGLang server would hold this request until /continue_generation
            out = requests.post(srv.url + "/generate", json={"input_ids": [1, 2, 3],
                                                            "sampling_params": {"max_new_tokens": 2}}, timeout=20)
            assert out.status_code == 200, out.text
        pusher.push(_weights(tiny_model_dir, 3.0), version=3)
        _wait(lambda: rec.readmitted == [srv.url], 60, "readmission")
        assert _served_markers(srv.url, names) == {3.0} and _version(srv.url) == "3"
    finally:
        pusher.close()


def test_a_replica_is_readmitted_when_as_current_as_the_fleet_even_if_versions_outpace_transfers(
        tmp_path, tiny_model_dir, loop):
    """Every transfer takes longer than many trainer steps (gloo on one GPU
    does), so no replica is ever within one version of the newest. A killed
    and restarted replica must still come back once it serves at least what
    the admitted replica serves, whole, and not wait for a lag it can never
    reach."""
    ok, victim = _servers(tmp_path, tiny_model_dir, [0.6, 0.6])
    rec = Recorder()
    at_readmit = {}
    pusher = None

    def readmit(url):
        rec.readmit(url)
        at_readmit.update(newest=pusher.staging.newest, versions={s["url"]: s["version"] for s in pusher.status()})

    pusher = Pusher(loop, [ok.url, victim.url], PushConfig(mode="async", bucket_bytes=1 << 30, deadline_s=5.0,
                    init_timeout_s=20, reconnect_interval_s=0.5), torch.device("cpu"),
                    on_eject=rec.eject, on_readmit=readmit)
    restarted = None
    version = 0

    def step_until(pred, timeout, what):
        nonlocal version
        deadline = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {pusher.status()}"
            version += 1
            pusher.push(_weights(tiny_model_dir, float(version)), version=version)
            time.sleep(0.05)

    try:
        pusher.connect(initial_version=0)
        step_until(lambda: pusher.replicas[1].busy and version > 20, 30, "a transfer to the victim")
        victim.proc.kill()
        victim.proc.wait()
        step_until(lambda: rec.ejected == [victim.url], 20, "ejection of the killed replica")
        cmd = [sys.executable, "-m", "torchtitan_grpo.server", "--model", tiny_model_dir,
               "--port", str(victim.port), "--debug-update-delay-s", "0.6", "--weight-group-timeout", "30"]
        restarted = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
        step_until(lambda: rec.readmitted == [victim.url], 90, "readmission after catch-up")
        mine, theirs = at_readmit["versions"][victim.url], at_readmit["versions"][ok.url]
        assert at_readmit["newest"] - mine > 1, at_readmit  # the lag-of-one rule alone would have kept it out
        assert mine >= theirs, at_readmit  # as current as the replica that was being routed to
        served = _served_markers(victim.url, list(_weights(tiny_model_dir, 0.0)))
        assert len(served) == 1 and next(iter(served)) >= mine, served  # whole versions only
    finally:
        pusher.close()
        stop_process(ok.proc)
        stop_process(victim.proc)
        if restarted is not None:
            stop_process(restarted)


def test_ipc_push_hands_over_whole_versions_and_a_killed_replica_catches_up(tmp_path, tiny_model_dir, loop):
    """transport "ipc" on CPU: the replica maps the staging buffers (shared
    memory files) and copies each version out; sync pushes arrive whole, an
    async burst ends on the newest, and a replica killed mid-update is
    ejected, cleaned up after its restart and readmitted only with the newest
    version."""
    before = torch.multiprocessing.get_sharing_strategy()
    (srv,) = _servers(tmp_path, tiny_model_dir, [0.0])
    rec = Recorder()
    pusher = Pusher(loop, [srv.url], PushConfig(mode="sync", backend="ipc", deadline_s=5.0, init_timeout_s=20,
                    reconnect_interval_s=0.5), torch.device("cpu"), on_eject=rec.eject, on_readmit=rec.readmit)
    names = list(_weights(tiny_model_dir, 0.0))
    restarted = slow = None
    try:
        assert torch.multiprocessing.get_sharing_strategy() == "file_system"
        pusher.connect(initial_version=0)
        for v in (1, 2):
            m = pusher.push(_weights(tiny_model_dir, float(v)), version=v)
            assert _version(srv.url) == str(v) and _served_markers(srv.url, names) == {float(v)}, m
        assert pusher.staging.latest.buffers[0].is_shared()
        for v in range(3, 9):
            pusher.push(_weights(tiny_model_dir, float(v)), version=v, wait=False)
        pusher.wait_for(8, timeout_s=30)
        assert _version(srv.url) == "8" and _served_markers(srv.url, names) == {8.0}

        # Kill it inside an update handler (a slow replica in its place), restart it, catch up.
        stop_process(srv.proc)
        cmd = [sys.executable, "-m", "torchtitan_grpo.server", "--model", tiny_model_dir,
               "--port", str(srv.port)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        slow = subprocess.Popen(cmd + ["--debug-update-delay-s", "3"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env)
        _wait(lambda: _up(srv.url), 60, "the slow replica's start")
        pusher.push(_weights(tiny_model_dir, 9.0), version=9, wait=False)
        _wait(lambda: pusher.replicas[0].busy, 10, "a transfer in flight")
        time.sleep(0.5)
        slow.kill()
        slow.wait()
        _wait(lambda: rec.ejected == [srv.url], 20, "ejection of the killed replica")
        pusher.push(_weights(tiny_model_dir, 10.0), version=10, wait=False)
        restarted = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        _wait(lambda: rec.readmitted == [srv.url], 90, "readmission after catch-up")
        assert _version(srv.url) == "10" and _served_markers(srv.url, names) == {10.0}
    finally:
        pusher.close()
        torch.multiprocessing.set_sharing_strategy(before)
        for p in (srv.proc, slow, restarted):
            if p is not None:
                stop_process(p)


def _up(url: str) -> bool:
    try:
        return requests.get(url + "/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def _in_thread(fn, what: str) -> tuple[threading.Thread, list]:
    """Run ``fn`` on a thread of its own; the list gets its result (or error)."""
    out: list = []

    def run():
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=run, name=what, daemon=True)
    t.start()
    return t, out


def _joined(t: threading.Thread, out: list, what: str, hang_guard_s: float = 120) -> object:
    """``t``'s result; a hang guard only (a thread still waiting after it fails the test)."""
    t.join(hang_guard_s)
    assert not t.is_alive(), f"{what} did not return"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def test_a_replica_reported_down_leaves_a_sync_push_at_once_and_catches_up_after(tmp_path, tiny_model_dir, loop,
                                                                                  srv):
    """Issue 27: a replica stopped (SIGSTOP) in the middle of a sync push,
    then reported down by the pool (``replica_down``, from the event loop
    as the pool calls it): the push returns while the replica is still
    stopped (no waiting for the deadline), the other replica serves the
    version, the stopped one holds no staging buffer (with only one, the
    next sync push goes through too), and once it runs again it is sent the
    newest version and only then readmitted."""
    # a: the shared server; b: its 3 s update is surely in flight when stopped
    a, (b,) = srv, _servers(tmp_path, tiny_model_dir, [3.0])
    rec = Recorder()
    at_readmit: dict[str, int] = {}
    pusher = None

    def readmit(url):
        rec.readmit(url)
        at_readmit[url] = pusher.replicas[1].version

    # A deadline no test run reaches: only the down report can end the wait.
    pusher = Pusher(loop, [a.url, b.url], PushConfig(mode="sync", bucket_bytes=1 << 20, num_staging_buffers=1,
                                                     deadline_s=3600, init_timeout_s=60, reconnect_interval_s=0.5),
                    torch.device("cpu"), on_eject=rec.eject, on_readmit=readmit)
    names = list(_weights(tiny_model_dir, 0.0))
    stopped = False
    try:
        pusher.connect(initial_version=0)
        push1, out1 = _in_thread(lambda: pusher.push(_weights(tiny_model_dir, 1.0), version=1), "push 1")
        _wait(lambda: pusher.replicas[1].busy, 60, "the transfer of version 1 to b")
        os.kill(b.proc.pid, signal.SIGSTOP)
        stopped = True
        assert pusher.replicas[1].busy and pusher.replicas[1].version == 0  # stopped in the middle of it
        loop.loop.call_soon_threadsafe(pusher.replica_down, b.url, "health check failed")
        _joined(push1, out1, "the sync push with b stopped")
        assert stopped  # returned while b is stopped: b resumes only below
        assert _version(a.url) == "1" and _served_markers(a.url, names) == {1.0}
        _wait(lambda: rec.ejected == [b.url], 60, "b's ejection")
        st = pusher.status()[1]
        assert not st["admitted"] and st["version"] == 0, st
        assert "ReplicaDown" in st["eject_reason"] and "health check failed" in st["eject_reason"], st
        failures = st["failures"]
        # Reported again, or for a URL it does not push to: nothing happens.
        pusher.replica_down(b.url, "health check failed")
        pusher.replica_down("http://127.0.0.1:9", "not ours")
        # The only staging buffer is free again: the next sync push goes through too.
        push2, out2 = _in_thread(lambda: pusher.push(_weights(tiny_model_dir, 2.0), version=2), "push 2")
        _joined(push2, out2, "the second sync push with b stopped")
        assert _version(a.url) == "2" and _served_markers(a.url, names) == {2.0}
        assert rec.ejected == [b.url] and pusher.status()[1]["failures"] == failures
        os.kill(b.proc.pid, signal.SIGCONT)
        stopped = False
        _wait(lambda: rec.readmitted == [b.url], 180, "b's readmission after catching up")
        assert at_readmit == {b.url: 2}  # the newest version, before any traffic
        assert _version(b.url) == "2" and _served_markers(b.url, names) == {2.0}
    finally:
        if stopped:
            os.kill(b.proc.pid, signal.SIGCONT)
        pusher.close()
        pusher.replica_down(b.url, "after close")  # a no-op
        stop_process(b.proc)


def test_a_sync_push_takes_the_buffer_of_a_catch_up_transfer_instead_of_waiting(tmp_path, tiny_model_dir, loop,
                                                                                 srv):
    """A push that waits for a staging buffer waits for admitted replicas
    only: with one buffer, held by the catch-up transfer of a replica out of
    routing (3 s per update), the next sync push gives that transfer up and
    returns before the replica is readmitted, which then catches up to that
    newer version."""
    a, (b,) = srv, _servers(tmp_path, tiny_model_dir, [3.0])  # a: the shared server
    events: list[str] = []
    rec = Recorder()
    pusher = Pusher(loop, [a.url, b.url], PushConfig(mode="sync", bucket_bytes=1 << 20, num_staging_buffers=1,
                                                     deadline_s=3600, init_timeout_s=60, reconnect_interval_s=0.5),
                    torch.device("cpu"), on_eject=rec.eject,
                    on_readmit=lambda u: (rec.readmit(u), events.append("b readmitted")))
    names = list(_weights(tiny_model_dir, 0.0))
    try:
        pusher.connect(initial_version=0)
        pusher.push(_weights(tiny_model_dir, 1.0), version=1)
        pusher.replica_down(b.url, "connection refused")  # idle: ejected, it rejoins as it answers
        _wait(lambda: rec.ejected == [b.url], 60, "b's ejection")
        _wait(lambda: pusher.replicas[1].group is not None, 120, "b's rejoin")
        pusher.push(_weights(tiny_model_dir, 2.0), version=2)  # returns once a serves it
        _wait(lambda: pusher.replicas[1].busy, 60, "b's catch-up transfer of version 2")
        transfers = pusher.status()[1]["transfers"]
        push3, out3 = _in_thread(lambda: (pusher.push(_weights(tiny_model_dir, 3.0), version=3),
                                          events.append("push 3 returned")), "push 3")
        _joined(push3, out3, "the sync push while b's catch-up holds the buffer")
        assert _version(a.url) == "3"
        st = pusher.status()[1]
        assert "given up" in st["eject_reason"] and st["transfers"] == transfers, st
        _wait(lambda: rec.readmitted == [b.url], 180, "b's readmission")
        assert events == ["push 3 returned", "b readmitted"]
        assert _version(b.url) == "3" and _served_markers(b.url, names) == {3.0}
    finally:
        pusher.close()
        stop_process(b.proc)


def test_every_push_request_carries_the_api_key(tmp_path, tiny_model_dir, loop):
    """A built-in server started with --api-key answers 401 without it: a
    pusher without the key fails at connect, naming the 401 and the setting;
    with ``PushConfig.api_key`` the probes, the control requests (pipelined
    or one by one) and the version tag all get through."""
    from torchtitan_grpo.weight_sync.control import PushError

    key = "s3cret-key"
    (srv,) = start_servers([ServerSpec(tiny_model_dir, extra_args=["--api-key", key])], str(tmp_path / "logs"), 120)
    auth = {"Authorization": f"Bearer {key}"}

    def served(v: int) -> None:
        info = requests.get(srv.url + "/model_info", headers=auth, timeout=10).json()
        assert info["weight_version"] == str(v)
        for n in names:
            got = requests.get(srv.url + "/get_weights_by_name", params={"name": n, "truncate_size": 4},
                               headers=auth, timeout=10).json()
            assert set(torch.tensor(got).flatten().tolist()) == {float(v)}, n

    names = list(_weights(tiny_model_dir, 0.0))
    keyless = Pusher(loop, [srv.url], PushConfig(mode="sync"), torch.device("cpu"))
    pusher = Pusher(loop, [srv.url], PushConfig(mode="sync", bucket_bytes=32 << 10, api_key=key),
                    torch.device("cpu"))
    try:
        with pytest.raises(PushError, match=r"HTTP 401.*api_key"):
            keyless.connect(initial_version=0)
        keyless.close()
        pusher.connect(initial_version=0)
        assert pusher.replicas[0].builtin  # its /model_info was read with the key
        pusher.push(_weights(tiny_model_dir, 1.0), version=1)  # pipelined
        served(1)
        pusher.cfg.pipelined = False  # one request after another, through the client session
        pusher.push(_weights(tiny_model_dir, 2.0), version=2)
        served(2)
        assert pusher.status()[0]["failures"] == 0
    finally:
        keyless.close()
        pusher.close()
        stop_process(srv.proc)


def test_a_restarted_replica_is_caught_up_without_a_new_version(tmp_path, tiny_model_dir, loop):
    """The lone server of a run, killed and restarted, loads the initial
    weights from disk: no new version comes (with no replica routable no step
    runs), so the pusher must send it the newest one it has, and readmit it.
    Killed before any version was pushed, it holds the initial version and
    is readmitted as it is."""
    (srv,) = _servers(tmp_path, tiny_model_dir, [0.0])
    rec = Recorder()
    pusher = Pusher(loop, [srv.url], PushConfig(mode="sync", bucket_bytes=1 << 20, deadline_s=10.0,
                    init_timeout_s=20, reconnect_interval_s=0.5), torch.device("cpu"),
                    on_eject=rec.eject, on_readmit=rec.readmit)
    names = list(_weights(tiny_model_dir, 0.0))
    cmd = [sys.executable, "-m", "torchtitan_grpo.server", "--model", tiny_model_dir,
           "--port", str(srv.port)]
    procs = [srv.proc]

    def kill_and_restart(n: int) -> None:
        procs[-1].kill()
        procs[-1].wait()
        pusher.replica_down(srv.url, "its process exited")
        _wait(lambda: len(rec.ejected) == n, 20, "ejection of the killed replica")
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      env=dict(os.environ, OMP_NUM_THREADS="1")))
        _wait(lambda: len(rec.readmitted) == n, 180, "readmission of the restarted replica")  # a hang guard

    try:
        pusher.connect(initial_version=0)
        kill_and_restart(1)  # nothing pushed yet: it holds version 0 from disk
        assert _version(srv.url) == "0" and pusher.replicas[0].version == 0
        pusher.push(_weights(tiny_model_dir, 1.0), version=1)
        assert _version(srv.url) == "1"
        kill_and_restart(2)  # version 1 was staged: it is sent again, with nothing new pushed
        assert _version(srv.url) == "1" and pusher.replicas[0].version == 1
        assert _served_markers(srv.url, names) == {1.0}
        pusher.push(_weights(tiny_model_dir, 2.0), version=2)  # a sync push reaches it as before
        assert _version(srv.url) == "2" and _served_markers(srv.url, names) == {2.0}
    finally:
        pusher.close()
        for p in procs:
            stop_process(p)
