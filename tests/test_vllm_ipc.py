"""vLLM's IPC weight transfer (``weight_sync.transport = "ipc"`` with the vLLM
protocol) and the vLLM releases the push speaks (0.26 and 0.33), on CPU:

* the handle encoding against what vLLM 0.26's receiver does with it
  (``packed_tensor.packed_ipc_consumer``: split by ``tensor_sizes``, view each
  piece as its dtype, clone), and the restricted unpickling on our side;
* the Pusher against a stand-in vLLM 0.26 / 0.33 server written from those
  releases' route and dataclass definitions (it refuses a key its release's
  dataclass would refuse, a finish body 0.26 would not read, ...);
* the Pusher against the built-in server's vLLM routes, which take the same
  IPC bodies with a shared-memory handle.
"""

from __future__ import annotations

import base64
import inspect
import json
import logging
import pickle
import socket

import pytest
import requests
import torch
from aiohttp import web
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from torchtitan_grpo.aio import LoopThread
from torchtitan_grpo.protocol import vllm
from torchtitan_grpo.weight_sync import buckets as bk
from torchtitan_grpo.weight_sync import ipc, vllm_ipc
from torchtitan_grpo.weight_sync.ipc import IpcFormatError
from torchtitan_grpo.weight_sync.pusher import PushConfig, Pusher, make_transport
from torchtitan_grpo.weight_sync.transport import Replica
from torchtitan_grpo.weight_sync.vllm_ipc_push import VLLMIpcPush
from torchtitan_grpo.weight_sync.control import PushError
from torchtitan_grpo.weight_sync.vllm_push import VLLMPush, refuse_unaligned

torch.set_num_threads(1)
CPU = torch.device("cpu")
MIXED = {"model.embed.weight": torch.randn(5, 3).to(torch.bfloat16),  # 30 B: the next offset is 2 mod 4
         "model.norm.weight": torch.randn(7),
         "model.odd.weight": torch.randn(3).to(torch.bfloat16),
         "lm_head.weight": torch.randn(4, 4)}


def vllm_026_unpack(buf: torch.Tensor, info: dict) -> dict[str, torch.Tensor]:
    """What vLLM 0.26's packed IPC consumer does with a buffer it mapped (facts
    from vllm/distributed/weight_transfer/packed_tensor.py: keep the first
    sum(tensor_sizes) bytes, split by tensor_sizes, ``.contiguous().view(dtype)
    .view(*shape)`` each piece, clone)."""
    sizes = info["tensor_sizes"]
    pieces = buf[:sum(sizes)].split(sizes)
    return {n: p.contiguous().view(getattr(torch, d)).view(*s).clone()
            for n, d, s, p in zip(info["names"], info["dtype_names"], info["shapes"], pieces)}


def _staged(plan: list[list[bk.TensorSpec]], tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    bufs = [torch.empty(bk.packed_nbytes(b), dtype=torch.uint8).share_memory_() for b in plan]
    for b, buf in zip(plan, bufs):
        buf.copy_(bk.pack([tensors[s.name] for s in b]))
    return bufs


# --------------------------------------------------------------------------- #
# Handles and bodies
# --------------------------------------------------------------------------- #


def test_buffers_are_laid_out_so_that_vllm_026_can_view_every_tensor():
    ipc.share_cpu_memory()
    specs = [bk.TensorSpec.of(n, t) for n, t in MIXED.items()]
    push = VLLMIpcPush(PushConfig(backend="ipc", protocol="vllm", packed_buffer_bytes=64), CPU)
    plan = push.plan(specs)
    assert len(plan) > 1 and sorted(s.name for b in plan for s in b) == sorted(MIXED)
    for b, buf in zip(plan, _staged(plan, MIXED)):
        info = json.loads(push._body(b, buf))["update_info"]
        assert set(info) <= vllm.IPC_UPDATE_INFO_KEYS and info["packed"] is True
        assert info["dtype_names"] == [bk.dtype_name(s.dtype) for s in b]  # bare: "bfloat16"
        assert info["tensor_sizes"] == [s.nbytes for s in b]
        got = vllm_026_unpack(buf, info)
        assert all(torch.equal(got[n], MIXED[n]) for n in got)
    # The order kept (vLLM's NCCL chunking) puts float32 at an odd offset, which 0.26 cannot view:
    kept = bk.plan_packed_chunks(specs, 1 << 20)
    (buf,) = _staged(kept, MIXED)
    info = {"names": [s.name for s in kept[0]], "dtype_names": [bk.dtype_name(s.dtype) for s in kept[0]],
            "shapes": [list(s.shape) for s in kept[0]], "tensor_sizes": [s.nbytes for s in kept[0]]}
    with pytest.raises(RuntimeError, match="divisible"):
        vllm_026_unpack(buf, info)
    # so the NCCL transport, which must keep the order its chunks are cut in,
    # refuses such a version to a real vLLM before sending a byte
    with pytest.raises(PushError, match=r"model\.norm\.weight \(float32\) would sit at byte 30.*weight_sync\.dtype"):
        refuse_unaligned(kept, "http://a")
    refuse_unaligned(plan, "http://a")


def test_handles_round_trip_and_nothing_else_is_unpickled():
    ipc.share_cpu_memory()
    buf = torch.arange(12, dtype=torch.uint8).share_memory_()
    text = vllm_ipc.encode_handles({vllm_ipc.CPU_KEY: vllm_ipc.share(buf)})
    opened = vllm_ipc.open_buffer(vllm_ipc.decode_handles(text)[vllm_ipc.CPU_KEY], CPU)
    assert torch.equal(opened, buf)
    buf[0] = 99  # the same memory, not a copy
    assert opened[0] == 99
    evil = base64.b64encode(pickle.dumps({"cpu": (print, ("hi",))})).decode()
    with pytest.raises(IpcFormatError, match="builtins.print"):
        vllm_ipc.decode_handles(evil)
    with pytest.raises(IpcFormatError, match="shared-memory tensor handle"):
        vllm_ipc.open_buffer((torch.Tensor, 1, 2), CPU)
    with pytest.raises(ValueError, match="share_memory_"):
        vllm_ipc.share(torch.zeros(3, dtype=torch.uint8))


def test_the_cuda_handle_is_what_vllm_026_rebuilds(monkeypatch):
    """vLLM 0.26 keys a handle by ``str(get_device_properties(i).uuid)``, sets
    ``args[6]`` to its device index and calls ``rebuild_cuda_tensor(*args)``;
    the pickle it loads with plain ``pickle.loads``."""
    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert len(params) == vllm_ipc.CUDA_ARGS and params[vllm_ipc.DEVICE_ARG] == "storage_device"

    class Props:
        uuid = "GPU-1234"

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    assert vllm_ipc.device_key(torch.device("cuda", 0)) == "GPU-1234"
    # the shape of reduce_tensor's CUDA arguments (no CUDA here to make real ones)
    args = (torch.Tensor, torch.Size([8]), (1,), 0, torch.storage.TypedStorage, torch.uint8, 0, b"h" * 64, 8, 0,
            False, b"ref", 0, b"e" * 64, True)
    text = vllm_ipc.encode_handles({"GPU-1234": args})
    assert pickle.loads(base64.b64decode(text)) == {"GPU-1234": args}  # what vLLM does with it
    assert vllm_ipc.decode_handles(text) == {"GPU-1234": args}  # what the built-in server does
    with pytest.raises(IpcFormatError, match="shared-memory"):
        vllm_ipc.open_buffer(args, CPU)


def test_host_staging_is_refused_and_ipc_picks_by_protocol():
    assert type(make_transport(PushConfig(backend="ipc", protocol="vllm"), CPU)) is VLLMIpcPush
    with pytest.raises(ValueError, match=r"weight_sync\.staging = 'host'.*device memory"):
        make_transport(PushConfig(backend="ipc", protocol="vllm", staging="host"), CPU)


# --------------------------------------------------------------------------- #
# Dialects
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("version,release,known", [
    ("0.26.0", "0.26", True), ("0.33.0", "0.33", True), ("0.26.1rc2", "0.26", True),
    ("0.27.0", "0.26", False), ("0.31.0", "0.33", False), ("0.40.0", "0.33", False), ("1.2.0", "0.33", False),
    ("0.20.0", "0.26", False), ("nightly", "0.33", False),
])
def test_the_nearest_known_release_is_spoken(version, release, known):
    d, k = vllm.nearest_dialect(version)
    assert (d.release, k) == (release, known)


def test_nccl_bodies_follow_each_release():
    """0.26's NCCLWeightTransferInitInfo has the rendezvous only (packing keys
    there are a TypeError), its update info carries the packing, and its
    finish reads no body; 0.33 the other way round."""
    push = VLLMPush(PushConfig(backend="nccl", protocol="vllm", packed_buffer_bytes=4096), CPU)
    plan = push.plan([bk.TensorSpec.of(n, t) for n, t in MIXED.items()])
    r26, r33 = Replica("http://a", world_size=3, dialect=vllm.V0_26), Replica("http://b", world_size=3)
    init26, init33 = push.init_request(r26, 5)[1]["init_info"], push.init_request(r33, 5)[1]["init_info"]
    assert set(init26) == vllm.INIT_INFO_KEYS_0_26 and set(init33) <= vllm.INIT_INFO_KEYS
    assert not set(init33) <= vllm.INIT_INFO_KEYS_0_26  # 0.33's body would fail on 0.26
    up26 = push.update_body(r26, plan)["update_info"]
    assert set(up26) == vllm.UPDATE_INFO_KEYS_0_26
    assert up26["packed"] is True and up26["packed_buffer_size_bytes"] == 4096
    up33 = json.loads(push.update_body(r33, plan))["update_info"]
    assert set(up33) == vllm.UPDATE_INFO_KEYS and init33["packed"] is True
    assert up26["names"] == up33["names"] == [s.name for c in plan for s in c]
    assert vllm.finish_weight_update_request("3", vllm.V0_26) is None
    assert vllm.finish_weight_update_request("3", vllm.V0_33) == {"weight_version": "3"}
    with pytest.raises(ValueError, match="0.26 has no nccl_unique_id_b64"):
        vllm.init_weight_transfer_request(2, nccl_unique_id_b64="QUJD", dialect=vllm.V0_26)


class FakeVLLM:
    """A vLLM server of one release with the IPC engine, as far as the push
    sees it (routes of vllm/entrypoints/serve/dev/rlhf/api_router.py in 0.26,
    the RL router in 0.33): it checks each body as that release's dataclasses
    would and unpacks each buffer as 0.26's consumer does."""

    def __init__(self, release: str):
        self.release, self.dialect = release, vllm.nearest_dialect(release)[0]
        self.calls: list[str] = []
        self.active = False
        self.loaded: dict[str, torch.Tensor] = {}
        self.version: str | None = None
        self.errors: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()
        for path, answer in (("/version", {"version": self.release}), ("/get_world_size", {"world_size": 1}),
                             ("/health", {})):
            app.router.add_get(path, self.answer(answer))
        for path in ("/init_weight_transfer_engine", "/pause", "/resume", "/start_weight_update",
                     "/update_weights", "/finish_weight_update"):
            app.router.add_post(path, self.handle)
        if self.dialect.has_shutdown:
            app.router.add_post("/shutdown_weight_transfer_engine", self.handle)
        return app

    @staticmethod
    def answer(body: dict):
        async def get(q: web.Request) -> web.Response:
            return web.json_response(body)
        return get

    async def handle(self, q: web.Request) -> web.Response:
        path, raw = q.path, await q.read()
        self.calls.append(path + (f"?mode={q.query['mode']}" if "mode" in q.query else ""))
        body = json.loads(raw) if raw else None
        try:
            if path == "/init_weight_transfer_engine":
                assert set(body["init_info"]) <= vllm.IPC_INIT_INFO_KEYS, body
            elif path == "/start_weight_update":
                assert not self.active, "start while a round is open"
                self.active = True
            elif path == "/update_weights":
                assert self.active, "update outside a round"
                info = body["update_info"]
                assert set(info) <= vllm.IPC_UPDATE_INFO_KEYS and info["packed"] is True, info
                handles = vllm_ipc.decode_handles(info["ipc_handles_pickled"])
                self.loaded |= vllm_026_unpack(vllm_ipc.open_buffer(handles[vllm_ipc.CPU_KEY], CPU), info)
            elif path == "/finish_weight_update":
                # vLLM 0.26 answers 500 "finish_weight_update called without a matching start" (run 128)
                assert self.active, "finish without a matching start"
                if self.dialect.finish_takes_version:
                    self.version = body["weight_version"]
                else:
                    assert body is None, f"0.26 reads no finish body, got {body}"
                self.active = False
            elif path == "/shutdown_weight_transfer_engine":
                self.active = False
        except Exception as e:  # noqa: BLE001 - a refusal, reported as vLLM would
            self.errors.append(f"{path}: {e}")
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response({"message": "ok"})


@pytest.fixture
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


def _serve(loop: LoopThread, fake: FakeVLLM) -> tuple[str, web.AppRunner]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def start():
        runner = web.AppRunner(fake.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    return f"http://127.0.0.1:{port}", loop.run(start())


@pytest.mark.parametrize("release", ["0.26.0", "0.33.0", "0.29.0"])
def test_ipc_push_speaks_the_release_of_the_server(release, loop, caplog):
    fake = FakeVLLM(release)
    url, runner = _serve(loop, fake)
    pusher = Pusher(LoopThread(), [url], PushConfig(mode="sync", backend="ipc", protocol="vllm",
                                                    packed_buffer_bytes=64, pause_mode="abort"), CPU)
    try:
        with caplog.at_level(logging.WARNING):
            pusher.connect(initial_version=0)
        assert ("not a release we know" in caplog.text) is (release == "0.29.0")
        for v in (1, 2):
            pusher.push({n: t + v for n, t in MIXED.items()}, version=v)
            assert not fake.errors, fake.errors
            assert all(torch.equal(fake.loaded[n], t + v) for n, t in MIXED.items())
        assert pusher.replicas[0].version == 2  # the trainer's record: the only one on 0.26
        assert fake.version == ("2" if release == "0.33.0" else None)
        n = len(pusher.staging.plan)
        assert n > 1 and fake.calls[:3 + n + 2] == ["/init_weight_transfer_engine", "/pause?mode=abort",
                                                     "/start_weight_update", *["/update_weights"] * n,
                                                     "/finish_weight_update", "/resume"]
        before = len(fake.calls)
    finally:
        pusher.close()
        pusher.loop.close()
        loop.run(runner.cleanup())
    # closing leaves nothing open: 0.33 shuts its engine down; 0.26 has no such route, and no
    # round is open, so it is only resumed (a finish without a start is a 500 there)
    assert fake.calls[before:] == (["/shutdown_weight_transfer_engine", "/resume"] if release == "0.33.0"
                                   else ["/resume"])
    assert not fake.errors, fake.errors


# --------------------------------------------------------------------------- #
# The built-in server's vLLM routes
# --------------------------------------------------------------------------- #


def _weights(url: str, name: str) -> torch.Tensor:
    r = requests.get(url + "/get_weights_by_name", params={"name": name, "truncate_size": 1 << 20}, timeout=30)
    r.raise_for_status()
    return torch.tensor(r.json())


def test_ipc_push_into_the_built_in_server(server, model_dir, loop):
    from safetensors.torch import load_file

    original = load_file(f"{model_dir}/model.safetensors")
    names = sorted(original)[:3]
    pusher = Pusher(loop, [server], PushConfig(mode="sync", backend="ipc", protocol="vllm",
                                               packed_buffer_bytes=2048, init_timeout_s=30), CPU)
    try:
        pusher.connect(initial_version=0)
        for v in (1, 2):
            new = {n: torch.full_like(original[n], float(v)) for n in names}
            pusher.push(new, version=v)
            assert requests.get(server + vllm.WEIGHT_INFO, timeout=10).json() == {"weight_version": str(v)}
            assert all(torch.equal(_weights(server, n), new[n]) for n in names)
        assert pusher.staging.latest.buffers[0].is_shared()

        # the server refuses, naming the field, before loading anything
        post = lambda body: requests.post(server + vllm.UPDATE_WEIGHTS, json=body, timeout=30)  # noqa: E731
        requests.post(server + vllm.START_WEIGHT_UPDATE, timeout=10)
        evil = base64.b64encode(pickle.dumps({"cpu": (print, ("hi",))})).decode()
        body = vllm.ipc_update_weights_request([names[0]], ["float32"], [list(original[names[0]].shape)],
                                               [original[names[0]].numel() * 4], evil)
        err = post(body).json()["error"]
        assert err["param"] == "update_info.ipc_handles_pickled" and "builtins.print" in err["message"], err
        body["update_info"]["tensor_sizes"] = [3]
        assert post(body).json()["error"]["param"] == "update_info.tensor_sizes[0]"
        body["update_info"]["packed"] = False
        assert post(body).json()["error"]["param"] == "update_info.packed"
        assert requests.post(server + vllm.FINISH_WEIGHT_UPDATE, json={}, timeout=10).status_code == 400
    finally:
        pusher.close()
    assert requests.post(server + vllm.SHUTDOWN_WEIGHT_TRANSFER, timeout=30).status_code == 200
