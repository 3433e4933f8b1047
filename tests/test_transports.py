"""The Pusher's transports (no servers): which one a config picks, that a new
transport is one class plus one entry in ``TRANSPORTS`` and then gets the
whole life cycle (connect, tag, send, abort at an ejection, reset and
connect again, readmission), and that the weight push imports nothing of the
inference side."""

import ast
import asyncio
import pathlib
import time

import pytest
import torch

from torchtitan_grpo.aio import LoopThread
from torchtitan_grpo.weight_sync import buckets as bk
from torchtitan_grpo.weight_sync.builtin_push import BuiltinSGLangPush, BuiltinVLLMPush
from torchtitan_grpo.weight_sync.control import PushError
from torchtitan_grpo.weight_sync.disk_push import DiskPush
from torchtitan_grpo.weight_sync.ipc_push import IpcPush
from torchtitan_grpo.weight_sync.pusher import TRANSPORTS, PushConfig, Pusher, make_transport
from torchtitan_grpo.weight_sync.transport import Replica, Transport
from torchtitan_grpo.weight_sync.vllm_ipc_push import VLLMIpcPush

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "torchtitan_grpo"


@pytest.fixture
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.mark.parametrize("backend,protocol,cls", [
    ("gloo", "sglang", BuiltinSGLangPush), ("nccl", "sglang", BuiltinSGLangPush),
    ("gloo", "vllm", BuiltinVLLMPush), ("nccl", "vllm", BuiltinVLLMPush),
    ("ipc", "sglang", IpcPush), ("ipc", "vllm", VLLMIpcPush), ("disk", "sglang", DiskPush),
])
def test_the_backend_or_the_protocol_over_a_group_picks_the_transport(backend, protocol, cls):
    t = make_transport(PushConfig(backend=backend, protocol=protocol), torch.device("cpu"))
    assert type(t) is cls
    assert t.reads_host_memory is (backend in ("gloo", "disk"))


def test_an_unknown_transport_is_named():
    with pytest.raises(ValueError, match=r"no weight-push transport 'rdma'.*known: sglang, vllm, ipc, disk"):
        make_transport(PushConfig(backend="rdma"), torch.device("cpu"))


class Recording(Transport):
    """A transport of its own: it "sends" by reading the staging buffers."""

    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        self.calls: list[tuple] = []
        self.received: dict[str, tuple[int, dict[str, torch.Tensor]]] = {}
        self.refuse: set[str] = set()

    async def start(self):  # no HTTP session: nothing here talks HTTP
        self.calls.append(("start",))

    async def healthy(self, r):
        return True

    async def connect(self, r):
        self.calls.append(("connect", r.url))

    async def reset(self, r):
        self.calls.append(("reset", r.url))

    async def tag(self, replicas, version):
        self.calls.append(("tag", tuple(r.url for r in replicas), version))

    async def send(self, r: Replica, staged):
        await asyncio.get_running_loop().run_in_executor(None, staged.await_written)
        if r.url in self.refuse:
            raise PushError(f"{r.url} refused version {staged.version}")
        got = {s.name: t for bucket, buf in zip(staged.plan, staged.buffers)
               for s, t in zip(bucket, bk.unpack(buf, bucket, copy=True))}
        self.received[r.url] = (staged.version, got)

    def abort(self, r):
        self.calls.append(("abort", r.url))

    async def close(self, replicas):
        self.calls.append(("close",))


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_new_transport_is_one_entry_and_gets_the_whole_life_cycle(loop, monkeypatch):
    monkeypatch.setitem(TRANSPORTS, "recording", Recording)
    ejected, readmitted = [], []
    pusher = Pusher(loop, ["http://a", "http://b/"], PushConfig(mode="sync", backend="recording", bucket_bytes=64,
                                                               reconnect_interval_s=0.05, deadline_s=10),
                    torch.device("cpu"), on_eject=ejected.append, on_readmit=readmitted.append)
    t = pusher.transport
    assert isinstance(t, Recording)
    tensors = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}
    try:
        pusher.connect(initial_version=0)
        assert t.calls == [("start",), ("connect", "http://a"), ("connect", "http://b"),
                           ("tag", ("http://a", "http://b"), 0)]
        pusher.push(tensors, version=1)  # sync: returns once both have it
        for url in ("http://a", "http://b"):
            version, got = t.received[url]
            assert version == 1 and all(torch.equal(got[n], x) for n, x in tensors.items())

        t.refuse.add("http://b")  # b fails version 2: ejected, a still gets it
        pusher.push({k: v + 1 for k, v in tensors.items()}, version=2)
        assert ejected == ["http://b"] and ("abort", "http://b") in t.calls
        assert t.received["http://a"][0] == 2 and t.received["http://b"][0] == 1
        assert "refused version 2" in pusher.status()[1]["eject_reason"]

        t.refuse.clear()  # b recovers: reset, connect, the newest version, then readmission
        pusher.push({k: v + 3 for k, v in tensors.items()}, version=3)
        _wait(lambda: readmitted == ["http://b"], 10, "b's readmission")
        assert t.received["http://b"][0] == 3
        rejoin = t.calls[t.calls.index(("abort", "http://b")):]
        assert rejoin[:3] == [("abort", "http://b"), ("reset", "http://b"), ("connect", "http://b")], rejoin
    finally:
        pusher.close()
    assert t.calls[-1] == ("close",)


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_the_weight_push_sits_below_inference_and_its_files_stay_small():
    for path in sorted((PACKAGE / "weight_sync").glob("*.py")) + sorted((PACKAGE / "protocol").glob("*.py")):
        up = sorted(m for m in _imports(path) if m.startswith(("torchtitan_grpo.fleet", "torchtitan_grpo.server")))
        assert not up, f"{path.name} imports {up}"
        assert len(path.read_text().splitlines()) <= 600, path.name


def test_parallel_does_not_import_pipeline():
    """pipeline builds on parallel; what both need is in pipeline_config, below both."""
    assert "torchtitan_grpo.distributed.pipeline" not in _imports(PACKAGE / "distributed/parallel.py")
    assert "torchtitan_grpo.distributed.parallel" in _imports(PACKAGE / "distributed/pipeline.py")
