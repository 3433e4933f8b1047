"""``Pusher.close`` tears down what it set up on the replicas: a trainer
restarted against long-lived servers (a resumed SLURM job) connects a new
Pusher to the same replicas, and a real SGLang refuses a second weight group
of the same name, as a vLLM does a second transfer engine, until the first
is destroyed. A replica it cannot reach is skipped, never raised on."""

import logging

import pytest
import requests
import torch
from safetensors.torch import load_file

from torchtitan_grpo.aio import LoopThread
from torchtitan_grpo.net import free_port
from torchtitan_grpo.weight_sync.pusher import Pusher, PushConfig

pytestmark = pytest.mark.slow


@pytest.fixture
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


def _weights(model_dir: str, fill: float) -> dict[str, torch.Tensor]:
    w = load_file(f"{model_dir}/model.safetensors")
    return {k: torch.full_like(v, fill) for k, v in sorted(w.items())}


def _served(url: str, protocol: str) -> str:
    if protocol == "vllm":
        return requests.get(url + "/weight_info", timeout=10).json()["weight_version"]
    return requests.get(url + "/model_info", timeout=10).json()["weight_version"]


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_closed_pusher_leaves_the_replica_to_the_next_one(server, model_dir, loop, protocol, caplog):
    """Pusher A pushes and closes (one of its replicas never came up: skipped,
    one log line naming it); pusher B then joins the same server, which
    refused B's group while A's was still open there, and pushes."""
    cfg = PushConfig(mode="sync", protocol=protocol, bucket_bytes=4 << 20, deadline_s=30, init_timeout_s=30,
                     reconnect_interval_s=0.2)
    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there
    a = Pusher(loop, [server], cfg, torch.device("cpu"))
    try:
        a.connect(initial_version=0)
        assert a.add_replica(dead)  # joins in the background: never does
        a.push(_weights(model_dir, 1.0), version=1)
        assert _served(server, protocol) == "1"
    finally:
        with caplog.at_level(logging.INFO, logger="torchtitan_grpo.weight_sync.pusher"):
            a.close()  # must not raise on the dead replica
    lines = [r.getMessage() for r in caplog.records if r.name == "torchtitan_grpo.weight_sync.pusher"
             and "closed" in r.getMessage()]
    assert len(lines) == 1 and dead in lines[0] and "1 of 2" in lines[0], lines

    b = Pusher(loop, [server], cfg, torch.device("cpu"))
    try:
        b.connect(initial_version=1)  # refused with "already exists" while A's group stays open
        b.push(_weights(model_dir, 2.0), version=2)
        assert _served(server, protocol) == "2"
    finally:
        b.close()


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_pusher_takes_over_from_one_that_never_closed(server, model_dir, loop, protocol, caplog):
    """Pusher A pushes and is abandoned without ``close`` (a trainer killed by
    SIGKILL or the OOM killer leaves its group on the server); pusher B, the
    restarted trainer, is refused at first, closes what A left and joins."""
    cfg = PushConfig(mode="sync", protocol=protocol, bucket_bytes=4 << 20, deadline_s=30, init_timeout_s=30,
                     reconnect_interval_s=0.2)
    a = Pusher(loop, [server], cfg, torch.device("cpu"))
    b = Pusher(loop, [server], cfg, torch.device("cpu"))
    try:
        a.connect(initial_version=0)
        a.push(_weights(model_dir, 3.0), version=1)
        with caplog.at_level(logging.INFO, logger="torchtitan_grpo.weight_sync.pusher"):
            b.connect(initial_version=1)
        assert any("refused to join" in r.getMessage() for r in caplog.records), "B joined without a refusal"
        b.push(_weights(model_dir, 4.0), version=2)
        assert _served(server, protocol) == "2"
    finally:
        b.close()
        a.close()
