"""InferencePool over real processes: built-in servers and fault servers.

Two built-in servers (tiny random Qwen3, CPU, one thread each) and two fault
servers (tests/fault_server.py, each in front of one of them) serve the whole
module; the last test kills one server with SIGKILL mid-batch and restarts it. Every batch is checked against a reference taken straight from a
server without the pool: requests are seeded, and a seeded group is the same
on every server whatever else is batched with it, so "each prompt got exactly
its own group of n, once" is an equality of token ids. A group mixed from two
attempts, a duplicated or lost sample, or a group from a faulty reply would
all break it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest

from torchtitan_grpo.fleet import sglang
from torchtitan_grpo.fleet.pool import CATCHING_UP, DOWN, HEALTHY, REMOVED, SLOW, STATE_CODES, GenerationFailed, InferencePool, NoHealthyReplica, PoolConfig
from torchtitan_grpo.fleet.types import SamplingParams

REPO = Path(__file__).resolve().parents[1]
N = 4  # samples per prompt (GRPO group size)
PROMPTS = [[5 + i, 20 + 3 * i, 7, 40 + i] for i in range(8)]


def params(i: int, max_new_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=1000 + i)


# --------------------------------------------------------------------------- #
# Processes
# --------------------------------------------------------------------------- #


def spawn(cmd: list[str], log_path: Path, timeout_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    """Start a server that prints ``ready http://HOST:PORT``; return it and the URL.

    Its output goes to a file (a pipe nobody reads after start-up could fill
    and stall it); the ready line is read back from there."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with open(log_path, "rb") as f:
            f.seek(start)
            m = re.search(rb"^ready (http://\S+)$", f.read(), re.MULTILINE)
        if m:
            return proc, m.group(1).decode()
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{' '.join(cmd)} did not start:\n{log_path.read_text(errors='replace')[-3000:]}")


def server_cmd(model_dir: str, port: int = 0, seed: int = 0) -> list[str]:
    return [sys.executable, "-m", "torchtitan_grpo.server", "--model", model_dir, "--port", str(port),
            "--seed", str(seed), "--num-threads", "1"]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def fault(url: str, mode: str = "ok", **kw) -> dict:
    """Set a fault server's mode (see tests/fault_server.py)."""
    req = urllib.request.Request(url + "/_fault", data=json.dumps({"mode": mode, **kw}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def fault_requests(url: str) -> int:
    with urllib.request.urlopen(url + "/_fault", timeout=10) as r:
        return json.loads(r.read())["generate_requests"]


class Fleet:
    """Two built-in servers (a, b) and a fault server in front of each (fa, fb)."""

    def __init__(self, model_dir: str, log_dir: Path):
        self.model_dir, self.log_dir = model_dir, log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        # Both model servers load at once (start-up is mostly imports).
        with ThreadPoolExecutor(2) as ex:
            futs = {name: ex.submit(spawn, server_cmd(self.model_dir, seed=k), self.log_dir / f"{name}.log")
                    for k, name in enumerate("ab")}
            for name, f in futs.items():
                self.procs[name], url = f.result()
                setattr(self, name, url)
        for name, upstream in (("fa", self.a), ("fb", self.b)):
            self.procs[name], url = spawn([sys.executable, "tests/fault_server.py", "--upstream", upstream],
                                          self.log_dir / f"{name}.log")
            setattr(self, name, url)

    def restart_b(self) -> None:
        """Start b again on its old port (after it was killed)."""
        self.procs["b"].wait(10)
        port = int(self.b.rsplit(":", 1)[1])
        self.procs["b"], _ = spawn(server_cmd(self.model_dir, port=port, seed=1), self.log_dir / "b.log")

    def stop(self) -> None:
        for p in self.procs.values():
            stop(p)


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    f = Fleet(tiny_model_dir, tmp_path_factory.mktemp("pool_logs"))
    try:
        f.start()
        yield f
    finally:
        f.stop()


@pytest.fixture(autouse=True)
def _faults_off(request):
    """Every test starts with well-behaved fault servers."""
    if "fleet" in request.fixturenames:
        f = request.getfixturevalue("fleet")
        fault(f.fa), fault(f.fb)
    yield


# --------------------------------------------------------------------------- #
# Reference and checks
# --------------------------------------------------------------------------- #


async def direct_groups(url: str, max_new_tokens: int = 8) -> list[list[list[int]]]:
    """Each prompt's group, asked of one server directly (no pool)."""
    async with aiohttp.ClientSession() as s:
        async def one(i: int, p: list[int]) -> list[list[int]]:
            async with s.post(url + "/generate", json=sglang.generate_request(p, N, params(i, max_new_tokens))) as r:
                return [c.token_ids for c in sglang.parse_generate(await r.json(), N, url)]

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))


@pytest.fixture(scope="module")
def reference(fleet) -> list[list[list[int]]]:
    return asyncio.run(direct_groups(fleet.a))


async def run_batch(pool: InferencePool, max_new_tokens: int = 8):
    return await asyncio.gather(*(pool.generate(p, N, params(i, max_new_tokens)) for i, p in enumerate(PROMPTS)))


def check_batch(groups, reference, never_from: tuple[str, ...] = ()) -> None:
    """Every prompt has exactly its own full group, from one replica."""
    assert len(groups) == len(PROMPTS)
    for i, g in enumerate(groups):
        assert len(g) == N, f"prompt {i}: {len(g)} samples"
        assert len({c.replica for c in g}) == 1, f"prompt {i}: group mixed from {[c.replica for c in g]}"
        assert g[0].replica not in never_from, f"prompt {i} answered by faulty {g[0].replica}"
        assert all(len(c.logprobs) == len(c.token_ids) and c.finish_reason in ("stop", "length") for c in g)
        assert [c.token_ids for c in g] == reference[i], f"prompt {i}: group differs from the reference"


def cfg(**kw) -> PoolConfig:
    """Fast health checks and back-off so that readmission takes well under a second."""
    base = dict(health_interval_s=0.1, health_timeout_s=2.0, backoff_s=0.2, backoff_max_s=1.0,
                request_timeout_s=30.0, slow_probe_interval_s=0.3, slow_hold_s=0.0)
    return PoolConfig(**(base | kw))


async def until(pred, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def assert_marked_down(pool: InferencePool, index: int, since_failure_s: float) -> None:
    """The replica went down; it is still down unless its 1 s back-off has
    already run out (only on a heavily loaded machine)."""
    r = pool.replicas[index]
    assert r.downs >= 1 and pool.metrics()[f"pool/replica{index}_downs"] >= 1
    if since_failure_s < 0.9:
        assert r.state == DOWN, (r.state, since_failure_s)


def served(pool: InferencePool, url: str) -> int:
    return next(r.served for r in pool.replicas if r.url == url)


def dispatched(pool: InferencePool, url: str) -> int:
    return next(r.dispatched for r in pool.replicas if r.url == url)


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #


def test_config_is_checked():
    with pytest.raises(ValueError, match="PoolConfig.backend"):
        PoolConfig(backend="tgi")
    with pytest.raises(ValueError, match="PoolConfig.max_retries"):
        PoolConfig(max_retries=0)
    with pytest.raises(ValueError, match="replica_file"):
        InferencePool([], PoolConfig())


def test_routes_across_fleet_with_metrics(fleet, reference):
    async def body():
        pool = InferencePool([fleet.a, fleet.b + "/"], cfg())
        await pool.start()
        try:
            check_batch(await run_batch(pool), reference)
            m = pool.metrics()
            # least-outstanding routing splits a concurrent batch evenly
            assert served(pool, fleet.a) == served(pool, fleet.b) == len(PROMPTS) // 2
            assert pool.states() == {fleet.a: HEALTHY, fleet.b: HEALTHY}
            assert m["pool/requests"] == len(PROMPTS) and m["pool/retries"] == 0 and m["pool/failures"] == 0
            assert m["pool/replicas_healthy"] == 2 and m["pool/replica1_state"] == STATE_CODES[HEALTHY]
            assert 0 < m["pool/latency_p50_s"] <= m["pool/latency_p99_s"]
            assert m["pool/outstanding"] == 0
        finally:
            await pool.close()

    asyncio.run(body())


@pytest.mark.parametrize("mode", ["http500", "bad_json", "malformed_count", "malformed_missing",
                                  "malformed_lengths", "drop", "hang"])
def test_faulty_replica_is_retried_elsewhere_then_readmitted(fleet, reference, mode):
    fault(fleet.fa, mode)
    before = fault_requests(fleet.fa)

    async def body():
        timeout = 2.0 if mode == "hang" else 30.0
        # A back-off of 1 s keeps it down until the asserts below have seen it.
        pool = InferencePool([fleet.fa, fleet.b], cfg(request_timeout_s=timeout, backoff_s=1.0))
        await pool.start()
        try:
            t0 = time.monotonic()
            check_batch(await run_batch(pool), reference, never_from=(fleet.fa,))
            assert fault_requests(fleet.fa) > before, "the faulty replica got no traffic"
            assert_marked_down(pool, 0, time.monotonic() - t0 - (timeout if mode == "hang" else 0.0))
            assert pool.states()[fleet.b] == HEALTHY
            m = pool.metrics()
            assert m["pool/replica0_failures"] >= 1 and m["pool/retries"] >= 1 and m["pool/failed_requests"] == 0
            kind = {"hang": "pool/timeouts", "http500": "pool/http_errors", "drop": "pool/connection_errors"}
            assert m[kind.get(mode, "pool/malformed")] >= 1

            fault(fleet.fa, "ok")
            await until(lambda: pool.states()[fleet.fa] == HEALTHY, what="readmission")
            check_batch(await run_batch(pool), reference)
            assert served(pool, fleet.fa) > 0
        finally:
            await pool.close()

    asyncio.run(body())


def test_refused_request_fails_without_blaming_replicas(fleet):
    """HTTP 400 is about the request: bounded retries, nobody marked down."""

    async def body():
        pool = InferencePool([fleet.a, fleet.b], cfg(max_retries=3))
        await pool.start()
        try:
            with pytest.raises(GenerationFailed, match="top_p"):
                await pool.generate(PROMPTS[0], N, SamplingParams(max_new_tokens=4, top_p=0.0))
            m = pool.metrics()
            assert m["pool/rejected"] == 3 and m["pool/failures"] == 0 and m["pool/failed_requests"] == 1
            assert pool.states() == {fleet.a: HEALTHY, fleet.b: HEALTHY}
        finally:
            await pool.close()

    asyncio.run(body())


@pytest.mark.parametrize("mode", ["abort", "http503"])
def test_aborted_group_is_regenerated_without_blaming_the_replica(fleet, reference, mode):
    async def body():
        # Two replicas: the aborted groups move to the other one.
        fault(fleet.fa, mode)
        pool = InferencePool([fleet.fa, fleet.b], cfg())
        await pool.start()
        try:
            check_batch(await run_batch(pool), reference, never_from=(fleet.fa,))
            m = pool.metrics()
            assert m["pool/aborts"] >= 1 and m["pool/failures"] == 0
            assert pool.states()[fleet.fa] == HEALTHY
        finally:
            await pool.close()
        # One replica, paused for the first 3 requests: the same replica is
        # asked again (after a short back-off) until it answers.
        fault(fleet.fa, mode, count=3)
        pool = InferencePool([fleet.fa], cfg())
        await pool.start()
        try:
            check_batch(await run_batch(pool), reference)
            assert pool.metrics()["pool/aborts"] == 3
        finally:
            await pool.close()

    asyncio.run(body())


def test_slow_replica_is_deprioritised_then_recovers(fleet, reference):
    # 2 s against the fast replica's tens of ms: slow by far more than slow_factor even on a loaded box
    fault(fleet.fa, "slow", delay_s=2.0)

    async def body():
        pool = InferencePool([fleet.fa, fleet.b], cfg(latency_window=4, slow_min_samples=2, slow_factor=2.0))
        await pool.start()
        try:
            check_batch(await run_batch(pool), reference)  # slow answers are still good answers
            assert pool.states()[fleet.fa] == SLOW and pool.metrics()["pool/replicas_slow"] == 1
            d_fa, d_b = dispatched(pool, fleet.fa), dispatched(pool, fleet.b)
            check_batch(await run_batch(pool), reference)
            # deprioritised: at most a probe and a spill-over, the rest to the fast one
            assert dispatched(pool, fleet.fa) - d_fa <= 2 and dispatched(pool, fleet.b) - d_b >= 6
            assert pool.metrics()["pool/failures"] == 0

            fault(fleet.fa, "ok")
            deadline = time.monotonic() + 15
            while pool.states()[fleet.fa] != HEALTHY:  # probes re-measure it
                assert time.monotonic() < deadline, "slow replica never recovered"
                assert pool.states()[fleet.fa] == SLOW
                check_batch(await run_batch(pool), reference)
                await asyncio.sleep(0.3)
        finally:
            await pool.close()

    asyncio.run(body())


def test_catching_up_needs_readmit(fleet, reference):
    def from_thread(fn, url):  # the weight pusher calls these from its own thread
        t = threading.Thread(target=fn, args=(url,))
        t.start()
        t.join()

    async def body():
        pool = InferencePool([fleet.a, fleet.b], cfg())
        await pool.start()
        try:
            from_thread(pool.eject, fleet.b)
            assert pool.states()[fleet.b] == CATCHING_UP
            check_batch(await run_batch(pool), reference, never_from=(fleet.b,))
            await asyncio.sleep(0.6)  # several passing health checks
            assert pool.states()[fleet.b] == CATCHING_UP
            assert pool.metrics()["pool/replicas_catching_up"] == 1
            from_thread(pool.readmit, fleet.b)
            assert pool.states()[fleet.b] == HEALTHY
            check_batch(await run_batch(pool), reference)
            assert served(pool, fleet.b) > 0

            # Nobody routable: requests wait for a replica to come back.
            from_thread(pool.eject, fleet.a)
            from_thread(pool.eject, fleet.b)
            batch = asyncio.ensure_future(run_batch(pool))
            await asyncio.sleep(0.3)
            assert not batch.done()
            threading.Timer(0.2, pool.readmit, args=(fleet.a,)).start()
            check_batch(await batch, reference, never_from=(fleet.b,))
            assert pool.metrics()["pool/waits"] == len(PROMPTS)
        finally:
            await pool.close()

        # ... but only for request_timeout_s.
        pool = InferencePool([fleet.a], cfg(request_timeout_s=0.5))
        await pool.start()
        try:
            pool.eject(fleet.a)
            t0 = time.monotonic()
            with pytest.raises(NoHealthyReplica, match="catching-up"):
                await pool.generate(PROMPTS[0], N, params(0))
            assert 0.4 < time.monotonic() - t0 < 10  # waited its request_timeout_s, not forever
        finally:
            await pool.close()

    asyncio.run(body())


def test_replica_file_joins_and_removes(fleet, reference, tmp_path):
    path = tmp_path / "replicas.txt"

    def write(*urls: str) -> None:  # atomically, as a launcher should
        tmp = tmp_path / "replicas.tmp"
        tmp.write_text("# written by the launcher\n" + "".join(u + "\n" for u in urls))
        os.replace(tmp, path)

    write(fleet.a)

    async def body():
        pool = InferencePool([], cfg(replica_file=str(path), replica_file_interval_s=0.1))
        await pool.start()
        try:
            check_batch(await run_batch(pool), reference)  # waits for the first health check
            write(fleet.a, fleet.b)
            await until(lambda: pool.states().get(fleet.b) == HEALTHY, what="b to join")
            check_batch(await run_batch(pool), reference)
            assert served(pool, fleet.b) > 0
            write(fleet.b)
            await until(lambda: pool.states()[fleet.a] == REMOVED, what="a to be removed")
            a_before = served(pool, fleet.a)
            check_batch(await run_batch(pool), reference)
            assert served(pool, fleet.a) == a_before
            assert pool.metrics()["pool/replicas"] == 1
        finally:
            await pool.close()

    asyncio.run(body())


def test_vllm_backend(fleet, reference):
    fault(fleet.fb, "malformed_lengths")

    async def body():
        pool = InferencePool([fleet.fa, fleet.fb], cfg(backend="vllm", model="tiny-qwen3", backoff_s=1.0))
        await pool.start()
        try:
            t0 = time.monotonic()
            groups = await run_batch(pool)
            check_batch(groups, reference, never_from=(fleet.fb,))
            assert_marked_down(pool, 1, time.monotonic() - t0)
            assert all(c.weight_versions == ["default"] for g in groups for c in g)
            assert pool.metrics()["pool/malformed"] >= 1
            fault(fleet.fb, "ok")
            await until(lambda: pool.states()[fleet.fb] == HEALTHY, what="readmission")
        finally:
            await pool.close()

    asyncio.run(body())


def test_sigkill_mid_batch_then_restart(fleet):
    """Kill -9 a real server while it generates; restart it on its port."""
    long = 48  # long enough that the kill lands mid-generation
    reference = asyncio.run(direct_groups(fleet.a, long))

    async def body():
        pool = InferencePool([fleet.a, fleet.b], cfg())
        await pool.start()
        try:
            batch = asyncio.ensure_future(run_batch(pool, long))
            async with aiohttp.ClientSession() as s:  # kill it once it is really generating
                for _ in range(1000):
                    async with s.get(fleet.b + "/get_load") as r:
                        if (await r.json())[0]["num_output_tokens"] > 0:
                            break
                    assert not batch.done(), "the batch finished before the kill"
                    await asyncio.sleep(0.005)
            in_flight = pool.replicas[1].outstanding
            os.kill(fleet.procs["b"].pid, signal.SIGKILL)
            check_batch(await batch, reference, never_from=(fleet.b,))
            assert in_flight > 0 and pool.states()[fleet.b] == DOWN
            m = pool.metrics()
            assert m["pool/retries"] >= 1 and m["pool/connection_errors"] >= 1 and m["pool/failed_requests"] == 0

            await asyncio.to_thread(fleet.restart_b)
            await until(lambda: pool.states()[fleet.b] == HEALTHY, timeout_s=20, what="the restarted replica")
            check_batch(await run_batch(pool, long), reference)
            assert served(pool, fleet.b) > 0
        finally:
            await pool.close()

    asyncio.run(body())


def test_hung_replica_marked_down_by_health_has_its_groups_resent(fleet, reference):
    """A replica that hangs mid-generation and then fails its health check:
    its groups in flight go to the other replica at once, long before their
    own timeout (300 s here, so a pass cannot come from it), and the pool
    tells the pusher (on_down)."""
    fault(fleet.fa, "hang")
    downs: list[str] = []

    async def body():
        pool = InferencePool([fleet.fa, fleet.b], cfg(request_timeout_s=300.0, backoff_s=1.0))
        pool.on_down = lambda url, reason: downs.append(url)
        await pool.start()
        try:
            batch = asyncio.ensure_future(run_batch(pool))
            # Some groups are stuck on fa before its health check starts failing.
            await until(lambda: pool.replicas[0].outstanding > 0, timeout_s=60, what="groups in flight on fa")
            fault(fleet.fa, "hang", health="fail")
            check_batch(await asyncio.wait_for(batch, 120), reference, never_from=(fleet.fa,))
            assert downs and downs[0] == fleet.fa
            m = pool.metrics()
            assert m["pool/resent"] >= 1 and m["pool/failed_requests"] == 0 and m["pool/timeouts"] == 0
            assert pool.replicas[0].outstanding == 0
        finally:
            await pool.close()

    asyncio.run(body())


def test_busy_fraction(fleet, reference):
    """pool/replica{i}_busy_frac: the share of time with a request outstanding,
    in [0, 1], and 0 for a replica that got nothing since the last call."""
    async def body():
        pool = InferencePool([fleet.a], cfg())
        await pool.start()
        try:
            pool.metrics()
            check_batch(await run_batch(pool), reference)
            busy = pool.metrics()["pool/replica0_busy_frac"]
            assert 0.0 < busy <= 1.0
            await asyncio.sleep(0.05)
            assert pool.metrics()["pool/replica0_busy_frac"] == 0.0
        finally:
            await pool.close()

    asyncio.run(body())


def test_slow_verdict_has_hysteresis():
    """A replica's slow state changes only once the new verdict has held for
    slow_hold_s: one flip of the medians does not flip it (nor log a line)."""
    pool = InferencePool(["http://127.0.0.1:9", "http://127.0.0.1:10"], cfg(slow_hold_s=0.3, slow_min_samples=2,
                                                                             latency_window=2))
    a, b = pool.replicas
    a.latencies.extend([0.1, 0.1])
    b.latencies.extend([1.0, 1.0])
    pool.fleet.update_slow()
    assert not b.slow  # the verdict "slow" has not held yet
    b.latencies.extend([0.1, 0.1])
    pool.fleet.update_slow()  # it went away again: nothing changes
    b.latencies.extend([1.0, 1.0])
    pool.fleet.update_slow()
    assert not b.slow
    time.sleep(0.35)
    pool.fleet.update_slow()  # held for slow_hold_s
    assert b.slow and not a.slow
