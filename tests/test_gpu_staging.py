"""``weight_sync.staging = "host"`` on GPUs: snapshots in pinned host memory,
uploaded bucket by bucket through each sender's two device buffers; and a
server on the trainer's own GPU, fed over gloo or CUDA IPC.

GPU machines only (the copies to and from pinned memory, the upload stream
and NCCL do not exist on CPU); runs are recorded in docs/GPU_RUNS.md. The
upload buffers' own logic is tested on CPU in tests/test_staging.py."""

import os

import pytest
import requests
import torch
from safetensors.torch import load_file

from torchtitan_grpo.aio import LoopThread
from torchtitan_grpo.fleet.launcher import ServerSpec, start_servers, stop_process
from torchtitan_grpo.weight_sync import buckets as bk
from torchtitan_grpo.weight_sync.gather import DirectPush
from torchtitan_grpo.weight_sync.pusher import Pusher, PushConfig

pytestmark = pytest.mark.gpu

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and torch.distributed.is_nccl_available()),
    reason="needs 2 CUDA GPUs and NCCL")


@pytest.fixture
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


def _staged_values(pusher: Pusher) -> dict[str, torch.Tensor]:
    staged = pusher.staging.latest
    out = {}
    for bucket, buf in zip(staged.plan, staged.buffers):
        for spec, t in zip(bucket, bk.unpack(buf, bucket)):
            out[spec.name] = t.clone()
    return out


@cuda
@pytest.mark.parametrize("fence", [True, False])
def test_next_optimizer_step_waits_for_the_copy_to_the_host(loop, fence):
    """DirectPush queues the copy to pinned memory beside the trainer's stream
    and returns; an optimizer step right after must not change what is
    copied. Without the step pre-hook (fence=False), the same calls at the
    same moment do change it: the copy is still running when the step is
    queued, so the hook is what keeps it whole (and this test can fail)."""
    dev = torch.device("cuda", 0)
    params = [torch.nn.Parameter(torch.randn(64 << 20, device=dev)) for _ in range(4)]  # 4 x 256 MiB fp32
    opt = torch.optim.SGD(params, lr=1.0)
    pusher = Pusher(loop, [], PushConfig(backend="nccl", staging="host", bucket_bytes=256 << 20), dev)
    assert pusher.stages_async
    dp = DirectPush([], None, pusher, sync=False, optimizers=opt)
    dp.tensors = lambda: {f"w{i}": p.detach() for i, p in enumerate(params)}
    if not fence:
        dp._hook.remove()
    try:
        for p in params:
            p.grad = torch.ones_like(p)
        # A first round does the lazy set-up (pinned buffers, the optimizer's
        # first step), which could otherwise outlast the copy on the host.
        dp.snapshot(1)
        opt.step()
        torch.cuda.synchronize()
        before = [p.detach().cpu() for p in params]
        dp.snapshot(2)
        opt.step()  # subtracts 1.0 from every element, on the trainer's stream
        torch.cuda.synchronize()
        assert pusher.staging.latest.buffers[0].is_pinned()
        staged = _staged_values(pusher)
        same = all(torch.equal(staged[f"w{i}"], before[i]) for i in range(len(params)))
        assert same == fence, "the copy saw the optimizer step" if fence else "the race did not show"
        assert torch.equal(params[0].detach().cpu(), before[0] - 1.0)
        m = dp.snapshot(3)  # reports the GPU time of version 2's copy
        assert m["time/push_host_copy_s"] > 1e-3, m  # 1 GiB to the host: milliseconds
    finally:
        dp.close()
        pusher.close()


def _weights(model_dir: str, fill: float) -> dict[str, torch.Tensor]:
    w = load_file(os.path.join(model_dir, "model.safetensors"))
    return {k: torch.full_like(v, fill, device="cuda:0") for k, v in sorted(w.items())}


@two_gpus
@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_host_staged_push_over_nccl(tmp_path, tiny_model_dir, loop, protocol):
    """Several buckets (so both upload buffers take turns, and bucket k+1
    uploads while k is sent) reach a built-in server on cuda:1 whole, version
    after version, through NCCL from pinned host memory."""
    (srv,) = start_servers([ServerSpec(tiny_model_dir, device="cuda:1")], str(tmp_path / "logs"), 180)
    dev = torch.device("cuda", 0)
    cfg = PushConfig(mode="sync", backend="nccl", protocol=protocol, staging="host", bucket_bytes=20_000,
                     packed_buffer_bytes=20_000, deadline_s=120)
    pusher = Pusher(loop, [srv.url], cfg, dev)
    try:
        pusher.connect(initial_version=0)
        names = list(_weights(tiny_model_dir, 0.0))
        for v in (1, 2, 3):
            pusher.push(_weights(tiny_model_dir, float(v)), version=v)
            for n in names:
                r = requests.get(srv.url + "/get_weights_by_name", params={"name": n, "truncate_size": 4}, timeout=10)
                r.raise_for_status()
                assert set(torch.tensor(r.json()).flatten().tolist()) == {float(v)}, (v, n)
        assert len(pusher.staging.plan) >= 3
        assert pusher.staging.latest.buffers[0].is_pinned()
        (r,) = pusher.replicas
        assert r.version == 3 and r.failures == 0, r.last_error
        assert r.uploader is not None and r.uploader.slots[0].device == dev
    finally:
        pusher.close()
        stop_process(srv.proc)


@cuda
@pytest.mark.parametrize("backend", ["gloo", "ipc"])
def test_push_to_a_server_on_the_trainers_own_gpu(tmp_path, tiny_model_dir, loop, backend):
    """One GPU for both (NCCL cannot join two processes on one GPU): the
    server shares cuda:0 and takes the weights over gloo (the snapshot goes
    to pinned host memory beside the next step, whatever ``staging`` says)
    or by CUDA IPC (it copies out of the trainer's staging buffers on the
    GPU). Either way the optimizer step queued right after an async push
    must not reach the replica under that push's version."""
    (srv,) = start_servers([ServerSpec(tiny_model_dir, device="cuda:0")], str(tmp_path / "logs"), 180)
    dev = torch.device("cuda", 0)
    params = {n: torch.nn.Parameter(w) for n, w in _weights(tiny_model_dir, 0.0).items()}
    opt = torch.optim.SGD(list(params.values()), lr=1.0)
    pusher = Pusher(loop, [srv.url], PushConfig(mode="async", backend=backend, bucket_bytes=20_000, deadline_s=120),
                    dev)
    assert pusher.stages_async == (backend == "gloo")
    dp = DirectPush([], None, pusher, sync=False, optimizers=opt)
    dp.tensors = lambda: {n: p.detach() for n, p in params.items()}
    try:
        pusher.connect(initial_version=0)
        for p in params.values():
            p.grad = torch.ones_like(p)
        for v in (1, 2, 3):
            opt.step()  # every weight is now -v
            dp.snapshot(v, wait=v < 3)
        opt.step()  # queued at once after version 3's copy: -4
        pusher.wait_for(3, timeout_s=120)
        buf = pusher.staging.latest.buffers[0]
        assert buf.is_pinned() if backend == "gloo" else buf.device == dev
        for n in params:
            r = requests.get(srv.url + "/get_weights_by_name", params={"name": n, "truncate_size": 4}, timeout=10)
            r.raise_for_status()
            assert set(torch.tensor(r.json()).flatten().tolist()) == {-3.0}, n
        (rep,) = pusher.replicas
        assert rep.version == 3 and rep.failures == 0, rep.last_error
    finally:
        dp.close()
        pusher.close()
        stop_process(srv.proc)
