"""The broadcast fan-out (``weight_sync.fanout = "broadcast"``) over real gloo
groups and real built-in server processes: one group over the trainer and
every replica, each bucket sent once by the trainer; a frozen replica is
dropped and the others still get the version; it catches up on its own group
and re-enters; a replica that joins later enters at a version boundary."""

import os
import signal
import threading

import pytest
import requests
import torch
from safetensors.torch import load_file

from torchtitan_grpo.aio import LoopThread
from torchtitan_grpo.fleet.launcher import ServerSpec, start_servers, stop_process
from torchtitan_grpo.weight_sync import group as group_mod
from torchtitan_grpo.weight_sync.fanout import BroadcastFanout
from torchtitan_grpo.weight_sync.pusher import Pusher, PushConfig
from tests.test_pusher import _version, _wait

pytestmark = pytest.mark.slow


def _weights(model_dir: str, seed: int) -> dict[str, torch.Tensor]:
    """Random tensors of the model's HF names and shapes (a version's bytes)."""
    g = torch.Generator().manual_seed(seed)
    w = load_file(os.path.join(model_dir, "model.safetensors"))
    return {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in sorted(w.items())}


def _served(url: str, name: str) -> torch.Tensor:
    r = requests.get(url + "/get_weights_by_name", params={"name": name, "truncate_size": 1 << 30}, timeout=30)
    r.raise_for_status()
    return torch.tensor(r.json(), dtype=torch.float32)


def _serves_exactly(url: str, w: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(_served(url, n), t.reshape(_served(url, n).shape)) for n, t in w.items())


@pytest.fixture
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture
def trainer_sends(monkeypatch):
    """Every broadcast the trainer (rank 0, this process) posts, by group name."""
    sent: dict[str, int] = {}
    lock = threading.Lock()
    for attr in ("broadcast", "post_broadcast"):
        orig = getattr(group_mod.WeightGroup, attr)

        def counted(self, tensor, *a, _orig=orig, **k):
            if self.rank == 0:
                with lock:
                    sent[self.group_name] = sent.get(self.group_name, 0) + 1
            return _orig(self, tensor, *a, **k)

        monkeypatch.setattr(group_mod.WeightGroup, attr, counted)
    return sent


def _servers(tmp_path, model_dir, n):
    specs = [ServerSpec(model_dir, extra_args=["--weight-group-timeout", "30"]) for _ in range(n)]
    return start_servers(specs, str(tmp_path / "logs"), 120)


def _cfg(**kw) -> PushConfig:
    return PushConfig(**{"mode": "sync", "bucket_bytes": 1 << 16, "fanout": "broadcast", **kw})


def test_three_replicas_get_bit_equal_weights_and_each_bucket_leaves_the_trainer_once(
        tmp_path, tiny_model_dir, loop, trainer_sends):
    servers = _servers(tmp_path, tiny_model_dir, 3)
    pusher = Pusher(loop, [s.url for s in servers], _cfg(deadline_s=60), torch.device("cpu"))
    try:
        assert isinstance(pusher.transport, BroadcastFanout)
        pusher.connect(initial_version=0)
        for v in (1, 2):
            w = _weights(tiny_model_dir, v)
            pusher.push(w, version=v)
            for s in servers:
                assert _version(s.url) == str(v) and _serves_exactly(s.url, w), s.url
        n_buckets = len(pusher.staging.plan)
        assert n_buckets > 1
        st = pusher.transport.stats
        assert (st.rounds, st.broadcasts, st.reforms, st.point_to_point) == (2, 2 * n_buckets, 1, 0)
        # counted where the bytes leave: one broadcast per bucket per version, none per replica
        assert trainer_sends == {"grpo_fanout_1": 2 * n_buckets}, trainer_sends
        assert pusher.transport.group.world_size == 4
    finally:
        pusher.close()
        for s in servers:
            stop_process(s.proc)


def test_a_frozen_replica_is_dropped_catches_up_alone_and_re_enters_with_a_late_joiner(
        tmp_path, tiny_model_dir, loop, trainer_sends):
    a, b, c, late = _servers(tmp_path, tiny_model_dir, 4)
    ejected, readmitted = [], []
    pusher = Pusher(loop, [a.url, b.url, c.url], _cfg(deadline_s=20, init_timeout_s=20, reconnect_interval_s=0.5),
                    torch.device("cpu"), on_eject=ejected.append, on_readmit=readmitted.append)
    stopped = False
    try:
        pusher.connect(initial_version=0)
        pusher.push(_weights(tiny_model_dir, 1), version=1)
        fan = pusher.transport
        assert fan.group.members == [a.url, b.url, c.url]
        os.kill(c.proc.pid, signal.SIGSTOP)
        stopped = True
        w2 = _weights(tiny_model_dir, 2)
        pusher.push(w2, version=2)  # sync: returns once every admitted replica serves it
        for s in (a, b):
            assert _version(s.url) == "2" and _serves_exactly(s.url, w2), s.url
        assert ejected == [c.url] and fan.stats.dropped == 1
        assert "dropped from the broadcast group" in pusher.status()[2]["eject_reason"]
        assert fan.group.members == [a.url, b.url] and fan.group.name == "grpo_fanout_2"
        os.kill(c.proc.pid, signal.SIGCONT)
        stopped = False
        _wait(lambda: readmitted == [c.url], 120, "the frozen replica's catch-up")
        assert _version(c.url) == "2" and _serves_exactly(c.url, w2)
        assert fan.stats.point_to_point == 1 and trainer_sends.get("weight_update_group", 0) > 0
        # A replica joining now gets its first version over its own group ...
        assert pusher.add_replica(late.url)
        _wait(lambda: readmitted == [c.url, late.url], 120, "the late replica's first version")
        assert _version(late.url) == "2" and fan.stats.point_to_point == 2
        # ... and both enter the shared group at the next version boundary.
        w3 = _weights(tiny_model_dir, 3)
        pusher.push(w3, version=3)
        assert fan.group.members == [a.url, b.url, c.url, late.url]
        for s in (a, b, c, late):
            assert _version(s.url) == "3" and _serves_exactly(s.url, w3), s.url
        assert fan.stats.point_to_point == 2
    finally:
        if stopped:
            os.kill(c.proc.pid, signal.SIGCONT)
        pusher.close()
        for s in (a, b, c, late):
            stop_process(s.proc)


@pytest.mark.parametrize("args", [["--weight_sync.transport", "disk"], ["--weight_sync.transport", "ipc"]])
def test_broadcast_fanout_without_a_weight_group_is_refused(tiny_model_dir, args):
    import os

    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.config.checks import ConfigError

    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train_configs", "demo_cpu.toml")
    with pytest.raises(ConfigError, match="weight_sync.fanout"):
        parse_config(["--job.config_file", demo, "--model.hf_assets_path", tiny_model_dir,
                      "--weight_sync.fanout", "broadcast", *args])
