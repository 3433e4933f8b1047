"""The sidecar's gather of full HF-named weights from a sharded trainer.

Under torchrun (gloo, 2 and 4 ranks) for FSDP, TP, DDP, PP, HSDP, FSDP+TP,
PP+FSDP and PP+TP, with the trainer built as grpo_train builds it: version 1 equals the
HF checkpoint (so every layout loads it exactly), and what rank 0 delivers
equals the trainer's own export of the same version, bit for bit, even though
the trainer takes a GRPO step (its own FSDP/TP/PP collectives, weights changed
in place) while the gather is in flight; the gather's process groups are none
of the trainer's.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (dp_replicate, dp_shard, tp, pp) per layout, launched with as many ranks as they need
LAYOUTS = {"fsdp": (1, 2, 1, 1), "tp": (1, 1, 2, 1), "ddp": (2, 1, 1, 1), "pp": (1, 1, 1, 2),
           "hsdp": (2, 2, 1, 1), "fsdp_tp": (1, 2, 2, 1), "pp_fsdp": (1, 2, 1, 2), "pp_tp": (1, 1, 2, 2)}
LAUNCHES = {2: ("fsdp", "tp", "ddp", "pp"), 4: ("hsdp", "fsdp_tp", "pp_fsdp", "pp_tp")}
MODELS = ("qwen3", "qwen3_tied", "llama3")


def _config(model_dir: str, model_name: str, layout: tuple[int, int, int, int], dump: str):
    from torchtitan_grpo.config.parse import parse_config

    dp_replicate, dp_shard, tp, pp = layout
    return parse_config([
        "--model.name", "qwen3" if model_name.startswith("qwen3") else model_name,
        "--model.hf_assets_path", model_dir, "--job.dump_folder", dump,
        "--parallelism.data_parallel_replicate_degree", str(dp_replicate),
        "--parallelism.data_parallel_shard_degree", str(dp_shard),
        "--parallelism.tensor_parallel_degree", str(tp),
        "--parallelism.pipeline_parallel_degree", str(pp),
        "--training.seq_len", "64", "--training.mixed_precision_param", "float32",
        "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "1", "--optimizer.implementation", "for-loop",
    ])


def _device() -> torch.device:
    """One GPU per rank where there are GPUs (NCCL), else CPU (gloo)."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}


def _groups(mesh) -> set[str]:
    return {mesh.get_group(i).group_name for i in range(mesh.ndim) if mesh.size(i) > 1}


def _through_pusher(device: torch.device, staging: str, delivered: dict, overlapped: threading.Event):
    """A ``deliver`` into a Pusher without replicas, as rank 0 of grpo_train
    has it: each version is copied into its staging buffers (pinned host
    memory, asynchronously, with staging "host" on a GPU) and kept there;
    ``read_back`` returns what a sender would have sent."""
    from torchtitan_grpo.aio import LoopThread
    from torchtitan_grpo.weight_sync import buckets as bk
    from torchtitan_grpo.weight_sync.pusher import Pusher, PushConfig

    loop = LoopThread()
    pusher = Pusher(loop, [], PushConfig(backend="nccl" if device.type == "cuda" else "gloo", staging=staging,
                                         bucket_bytes=1 << 16, num_staging_buffers=3), device)
    staged = {}

    def deliver(tensors, version, wait):
        if version == 1:
            overlapped.wait(timeout=30)
        m = pusher.push(tensors, version, wait=False)
        staged[version] = pusher.staging.latest
        staged[version].users += 1  # no sender takes it: keep this version's buffer
        return m

    def read_back() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for version, st in staged.items():
            delivered[version] = {spec.name: t.to("cpu", copy=True) for bucket, buf in zip(st.plan, st.buffers)
                                  for spec, t in zip(bucket, bk.unpack(buf, bucket))}
        pusher.close()
        loop.close()

    return deliver, read_back


def run_case(model_dir: str, model_name: str, layout: tuple[int, int, int, int], dump: str,
             staging: str = "") -> dict | None:
    """The trainer as grpo_train builds it (meta, layout, then the checkpoint),
    three versions through a ShardGatherer of two slots (version 3 reuses
    version 1's slot while version 2 may still be gathered); rank 0 returns
    what it saw (with ``staging``: what rank 0's Pusher staged to be sent)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tests.rank_cases import _gathered_hf, fixed_batch
    from torchtitan_grpo.distributed import parallel
    from torchtitan_grpo.train.trainer import Dist, build_policy, train_step
    from torchtitan_grpo.weight_sync.gather import ShardGatherer

    device = _device()
    d = Dist(dist.get_rank(), dist.get_world_size(), device.index or 0, device)
    cfg = _config(model_dir, model_name, layout, dump)
    policy = build_policy(cfg, model_dir, d)

    delivered: dict[int, dict] = {}
    overlapped = threading.Event()

    def deliver(tensors, version, wait):
        if version == 1:  # hold version 1 until the trainer has moved on
            overlapped.wait(timeout=30)
        delivered[version] = _cpu(tensors)
        return {"push/bytes": float(sum(t.nbytes for t in tensors.values()))}

    read_back = None
    if staging and d.is_main:
        deliver, read_back = _through_pusher(device, staging, delivered, overlapped)
    dtype = torch.bfloat16 if model_name == "llama3" else None  # the cast happens in the snapshot
    gatherer = ShardGatherer(policy.model_parts, policy.adapter, policy.parallel_dims, device,
                             deliver if d.is_main else None, dtype=dtype, num_slots=2)
    expected = {1: _gathered_hf(policy)}  # the trainer's own export, stages united
    gatherer.snapshot(1)

    # The trainer goes on while version 1 is gathered: a GRPO step with its
    # own FSDP/TP/PP collectives, which changes the weights in place.
    batch = fixed_batch()
    dp_rank, dp_degree = parallel.data_parallel_rank_and_degree(policy.parallel_dims)
    train_step(policy, batch[dp_rank::dp_degree], cfg.grpo, 1.0, 8, global_num_samples=len(batch),
               global_num_tokens=sum(len(s.completion_ids) for s in batch), pad_id=0, d=d)
    overlapped.set()
    expected[2] = _gathered_hf(policy)
    gatherer.snapshot(2)
    # Another step while version 2 is gathered, then version 3 into version
    # 1's slot: the trainer may rewrite it only once the sidecar has copied
    # version 1 out of it (on GPUs the slot's ``released`` event).
    train_step(policy, batch[dp_rank::dp_degree], cfg.grpo, 1.0, 8, global_num_samples=len(batch),
               global_num_tokens=sum(len(s.completion_ids) for s in batch), pad_id=0, d=d)
    expected[3] = _gathered_hf(policy)
    metrics = gatherer.snapshot(3, wait=True)
    gatherer.close()
    if read_back is not None:
        read_back()

    trainer_groups, own_groups = set(), set()
    for part in policy.model_parts:
        for p in part.state_dict(keep_vars=True).values():
            if isinstance(p, DTensor):
                trainer_groups |= _groups(p.device_mesh)
    for key in ("dense", "dataloading", "world"):
        own_groups |= _groups(gatherer.meshes[key])
    default = dist.group.WORLD.group_name
    if not d.is_main:
        return None
    kinds = sorted({p.kind for p in gatherer.params})
    return {"delivered": delivered, "expected": expected, "dtype": dtype, "metrics": metrics, "kinds": kinds,
            "shared_groups": sorted(own_groups & (trainer_groups | {default})),
            "checkpoint": load_file(os.path.join(model_dir, "model.safetensors"))}


def _worker(out_dir: str, model_dirs: dict[str, str], layouts: list[str], staging: str = "",
            staged_layouts: list[str] = ()) -> None:
    """Every (layout, model) of ``layouts`` to ``out_dir``; then, in the same
    launch (one torchrun start less), every ``staged_layouts`` one again
    through rank 0's Pusher (staging "host") to ``out_dir/staged``."""
    import torch.distributed as dist

    # A hang (run 33 met one on 2 GPUs that seven reruns did not) leaves every
    # thread's stack in the rank's stderr instead of only a timeout.
    dump_s = float(os.environ.get("GRPO_TEST_DUMP_S", "240"))  # 0: none
    if dump_s > 0:
        faulthandler.dump_traceback_later(dump_s, repeat=True)
    torch.set_num_threads(1)
    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    try:
        run_layouts(out_dir, model_dirs, layouts, staging, staged_layouts)
        dist.barrier()
    finally:
        faulthandler.cancel_dump_traceback_later()
        dist.destroy_process_group()


def run_layouts(out_dir: str, model_dirs: dict[str, str], layouts: list[str], staging: str = "",
                staged_layouts: list[str] = ()) -> None:
    """:func:`_worker`'s cases in a process group already started (also run
    by tests/multirank.py, in one launch with test_parallel_parity's cases)."""
    runs = [(layout, staging, out_dir) for layout in layouts]
    runs += [(layout, "host", os.path.join(out_dir, "staged")) for layout in staged_layouts]
    for layout, how, out in runs:
        os.makedirs(out, exist_ok=True)
        for model_name in MODELS:
            result = run_case(model_dirs[model_name], model_name, LAYOUTS[layout],
                              os.path.join(out, f"dump-{model_name}-{layout}"), how)
            if result is not None:
                torch.save(result, os.path.join(out, f"{model_name}-{layout}.pt"))


# fsdp and tp once more through rank 0's Pusher (staging "host": on CPU, its
# plain host buffers), in the 2-rank launch
STAGED = {2: ("fsdp", "tp")}


@pytest.fixture(scope="module")
def gathered(multirank_launched):
    """The results of ``LAUNCHES`` and ``STAGED``: run once per session with
    test_parallel_parity's cases (tests/multirank.py: each rank's start-up
    is paid once for both files), the same cases that ``_worker`` runs."""
    failed = multirank_launched.failed("gather")
    for nproc in LAUNCHES:
        assert nproc not in failed, failed[nproc]
    return multirank_launched.gather


@pytest.fixture(scope="module")
def staged_by_pusher(gathered):
    """fsdp and tp through rank 0's Pusher, from the same launch as ``gathered``."""
    return gathered / "staged"


@pytest.mark.slow
@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gathered_versions_equal_the_trainers_export(gathered, layout, model_name):
    r = torch.load(gathered / f"{model_name}-{layout}.pt")
    assert sorted(r["delivered"]) == [1, 2, 3]
    assert r["shared_groups"] == [], "the gather used the trainer's process groups"
    # one sharded dim: the flat fast path; FSDP+TP (two) falls back to DTensor
    assert r["kinds"] == {"fsdp": ["flat"], "hsdp": ["flat"], "tp": ["flat", "whole"], "ddp": ["whole"],
                          "pp": ["whole"], "pp_fsdp": ["flat"], "pp_tp": ["flat", "whole"],
                          "fsdp_tp": ["dtensor", "flat"]}[layout], r["kinds"]
    # version 1 is the checkpoint itself: the trainer loaded it exactly under this layout
    ckpt = {k: v for k, v in r["checkpoint"].items() if not (model_name == "qwen3_tied" and k == "lm_head.weight")}
    assert r["expected"][1].keys() == ckpt.keys()
    assert all(torch.equal(r["expected"][1][k], ckpt[k]) for k in ckpt), "the checkpoint was not loaded exactly"
    for v in (2, 3):
        moved = max(float((r["expected"][v][k] - r["expected"][v - 1][k]).abs().max()) for k in r["expected"][1])
        assert moved > 1e-3, "consecutive versions must differ for the check to mean anything"
    for version in (1, 2, 3):
        got, want = r["delivered"][version], r["expected"][version]
        assert got.keys() == want.keys()
        for k in want:
            w = want[k] if r["dtype"] is None else want[k].to(r["dtype"])
            assert got[k].dtype == w.dtype, k
            assert torch.equal(got[k], w), f"version {version}: {k} differs"
    if model_name == "qwen3_tied":  # HF loaders re-tie it from the embedding
        assert "lm_head.weight" not in r["delivered"][1]
    assert r["metrics"]["push/bytes"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("layout", STAGED[2])
def test_what_rank0s_pusher_stages_equals_the_trainers_export(staged_by_pusher, layout, model_name):
    """The gathered tensors as rank 0's Pusher staged them (its bucket layout,
    read back), for the same checks."""
    test_gathered_versions_equal_the_trainers_export(staged_by_pusher, layout, model_name)


# ------------------------------------------------- one process, plain tensors


class _Identity:
    def to_hf(self, tensors):
        return dict(tensors)


@pytest.fixture()
def one_rank(tmp_path):
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _one_rank_gatherer(deliver, num_slots: int):
    from types import SimpleNamespace

    from torchtitan_grpo.weight_sync.gather import ShardGatherer

    model = torch.nn.Linear(4, 3)
    dims = SimpleNamespace(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1)
    return model, ShardGatherer([model], _Identity(), dims, torch.device("cpu"), deliver, num_slots=num_slots)


def test_snapshot_is_a_copy_and_a_busy_slot_is_waited_for(one_rank):
    """Version 1's delivery is held until the trainer has gone on: the first
    snapshot returns without waiting for it, the trainer's next step changes
    the weights meanwhile, and the second snapshot (one slot) returns only
    after version 1's delivery let the slot go."""
    delivered = {}
    order: list[str] = []
    gate = threading.Event()
    released: list[bool] = []

    def deliver(tensors, version, wait):
        if version == 1:
            released.append(gate.wait(60))  # False: nobody let it go (a hang guard only)
        delivered[version] = _cpu(tensors)
        order.append(f"delivered {version}")
        return {}

    model, g = _one_rank_gatherer(deliver, num_slots=1)
    before = _cpu(model.state_dict())
    g.snapshot(1)
    order.append("snapshot 1 returned")
    with torch.no_grad():
        model.weight.add_(1.0)  # the trainer's next step, while version 1 is being delivered
    # Let version 1 go a little later, from another thread: the second
    # snapshot has started waiting for the slot by then, or the slot is free
    # by then; either way it returns only after version 1 was delivered.
    threading.Timer(0.2, gate.set).start()
    g.snapshot(2)
    order.append("snapshot 2 returned")
    g.close()
    assert released == [True]  # the first snapshot did not wait for its delivery
    assert order.index("snapshot 1 returned") < order.index("delivered 1") < order.index("snapshot 2 returned")
    assert torch.equal(delivered[1]["weight"], before["weight"])
    assert torch.equal(delivered[2]["weight"], before["weight"] + 1.0)


def test_a_failed_delivery_is_raised_on_the_next_snapshot(one_rank):
    def deliver(tensors, version, wait):
        raise ValueError("every replica has been ejected")

    _, g = _one_rank_gatherer(deliver, num_slots=2)
    g.snapshot(1)  # async: the failure happens on the sidecar thread...
    deadline = time.monotonic() + 30
    while g.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="weight gather failed on rank 0: every replica has been ejected"):
        g.snapshot(2)  # ...and reaches the trainer at its next call
    with pytest.raises(RuntimeError, match="every replica"):
        g.close()

    _, g = _one_rank_gatherer(deliver, num_slots=2)
    with pytest.raises(RuntimeError, match="every replica"):
        g.snapshot(1, wait=True)  # sync: at once


def _check(out_dir: str) -> int:
    """The test's assertions over a worker's results (for GPU runs): PASS/FAIL per case."""
    from pathlib import Path

    failed = 0
    for f in sorted(Path(out_dir).glob("*.pt")):
        model_name, layout = f.stem.rsplit("-", 1)
        try:
            test_gathered_versions_equal_the_trainers_export(Path(out_dir), layout, model_name)
            print(f"PASS gather {layout} {model_name}")
        except AssertionError as e:
            failed += 1
            print(f"FAIL gather {layout} {model_name}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", default="")
    ap.add_argument("--model", action="append", default=[])
    ap.add_argument("--check", action="store_true", help="check the results in --out and print PASS/FAIL")
    ap.add_argument("--staging", default="", choices=["", "device", "host"],
                    help="deliver into rank 0's Pusher with this weight_sync.staging and check what it staged")
    ap.add_argument("--staged-layouts", default="",
                    help="after --layouts, run these again through rank 0's Pusher (staging host) to OUT/staged")
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    if a.check:
        sys.exit(_check(a.out))
    _worker(a.out, dict(m.split("=", 1) for m in a.model), a.layouts.split(","), a.staging,
            [x for x in a.staged_layouts.split(",") if x])
