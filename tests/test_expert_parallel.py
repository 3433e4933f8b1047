"""Expert parallelism (torchtitan_grpo.distributed.expert_parallel) on CPU over gloo.

A tiny Qwen3-MoE (HF checkpoint, 2 layers x 4 experts, top-2, routing far
from uniform; built through the project's bridge, ``qwen3_moe``) takes one GRPO
forward/backward in one torchrun launch of 2 ranks as ``ep_fsdp``: EP 2
borrowed from dp_shard 2 (dense weights FSDP over 2 ranks, each rank its own
samples; experts split 2 + 2 over ep, their efsdp is 1, the only EP layout 2
ranks allow: EP borrowing TP ranks is refused, its router gradients are wrong
in TorchTitan 0.2.2).

It is compared with one process: the GRPO loss, every full gradient and
the grad norm (fp32, <= 1e-6), and what the sidecar gather delivers for a
push (``ShardGatherer``: expert shards gathered, named per expert by the
adapter), bit for bit against the single process's HF state dict. Experts
sharded by FSDP too (efsdp > 1) need 4 ranks (dp_shard 4, ep 2) and are not
launched here.

Run ``python tests/test_expert_parallel.py worker --out DIR --model DIR``
under torchrun for the launch alone.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402

import torchtitan_grpo  # noqa: E402,F401  (before torchtitan)

torch.set_num_threads(1)

TOL = 1e-6
NUM_EXPERTS = 4
# name -> (dp_replicate, dp_shard, tp); expert_parallel_degree 2 in each
LAYOUTS = {"ep_fsdp": (1, 2, 1)}
EP = 2


def tiny_moe_args():
    """TorchTitan qwen3 MoE args for the checks on meta: every layer MoE, softmax top-2 with
    normalised weights (Qwen3-MoE's router), no shared expert, no
    load-balancing bias (off in RL)."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    return Qwen3ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128, vocab_size=128,
        max_seq_len=64, eos_id=1, moe_enabled=True, moe_inter_dim=32,
        moe_args=MoEArgs(num_experts=NUM_EXPERTS, num_shared_experts=0, top_k=2, score_func="softmax",
                         route_norm=True, score_before_experts=False, load_balance_coeff=None,
                         use_grouped_mm=False),
    )


def write_checkpoint(out_dir: str) -> str:
    """A tiny HF ``Qwen3MoeForCausalLM`` (demo_assets, 4 experts, top 2),
    loaded through the project's bridge (``model.build_model`` ->
    ``qwen3_moe``) by every case.

    The router gates are drawn large so each token's top-2 experts are far
    apart from the rest (a route flipped by float noise between layouts would
    change the gradients by O(1), not by 1e-7), the experts larger than HF's
    init so their gradients stand well above TOL; norms away from 1."""
    from safetensors.torch import load_file, save_file

    from torchtitan_grpo.models.demo_assets import TinyQwen3Moe, write_tiny_qwen3

    write_tiny_qwen3(out_dir, TinyQwen3Moe(num_experts=NUM_EXPERTS, num_experts_per_tok=2, moe_intermediate_size=32))
    path = os.path.join(out_dir, "model.safetensors")
    state = load_file(path)
    g = torch.Generator().manual_seed(0)
    for name, t in state.items():
        if name.endswith("mlp.gate.weight"):
            state[name] = torch.randn(t.shape, generator=g)
        elif ".mlp.experts." in name:
            state[name] = 0.05 * torch.randn(t.shape, generator=g)
        elif "norm" in name:
            state[name] = torch.empty(t.shape).uniform_(0.5, 1.5, generator=g)
        elif name == "model.embed_tokens.weight":  # O(1) rows, as TorchTitan's init (0.02 makes RMSNorm's grads huge)
            state[name] = torch.randn(t.shape, generator=g)
    save_file(state, path, metadata={"format": "pt"})
    return out_dir


def _config(layout: tuple[int, int, int], ep: int):
    from tests.rank_cases import job_config

    return job_config("qwen3", layout, ("--parallelism.expert_parallel_degree", str(ep)))


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().to("cpu", copy=True)


def _pushed(model, adapter, pdims, world_size: int) -> tuple[dict, dict]:
    """What a weight push sends, and how the gather classified each parameter:
    one process exports its HF state dict; several go through the sidecar
    gather (``ShardGatherer``, sync) to rank 0."""
    from torchtitan_grpo.models import hf_bridge as hf_model
    from torchtitan_grpo.weight_sync.gather import ShardGatherer

    if world_size == 1:
        return {k: v.detach().clone() for k, v in hf_model.hf_state_dict(model, adapter).items()}, {}
    got: dict[str, torch.Tensor] = {}

    def deliver(tensors, version, wait):
        got.update({k: v.detach().to("cpu", copy=True) for k, v in tensors.items()})
        return {}

    with ShardGatherer([model], adapter, pdims, torch.device("cpu"), deliver, num_slots=1, sync=True) as g:
        kinds = {p.names[0]: p.kind for p in g.params}
        g.snapshot(0)
    return got, kinds


def run_case(model_dir: str, layout: tuple[int, int, int], ep: int, world_size: int) -> dict:
    """Build, parallelise, load the checkpoint, push it, then one GRPO
    forward/backward on the fixed batch; full tensors of what matters. A
    collective under a layout (every rank calls it)."""
    import torch.distributed as dist

    from torchtitan.distributed.utils import clip_grad_norm_
    from tests.rank_cases import MAX_NORM, MICRO_BATCH, PAD, fixed_batch
    from torchtitan_grpo.models import hf_bridge as hf_model
    from torchtitan_grpo.distributed import parallel
    from torchtitan_grpo.train.loss import grpo_loss, token_logprobs
    from torchtitan_grpo.train.trainer import _pack

    device = torch.device("cpu")
    cfg = _config(layout, ep)
    args = hf_model.model_args_from_hf("qwen3", hf_model.load_hf_config(model_dir), max_seq_len=64)
    model = hf_model.build_model("qwen3", args, device)
    adapter = hf_model.state_dict_adapter("qwen3", args, model_dir)
    model, pdims = parallel.parallelize(model, cfg, world_size, device)
    hf_model.load_hf_weights(model, adapter, model_dir)
    pushed, kinds = _pushed(model, adapter, pdims, world_size)
    model.train()

    batch = fixed_batch()
    n_samples, n_tokens = len(batch), sum(len(s.completion_ids) for s in batch)
    dp_rank, dp_degree = parallel.data_parallel_rank_and_degree(pdims)
    local = batch[dp_rank::dp_degree]
    n_micro = torch.tensor([max(1, -(-len(local) // MICRO_BATCH))])
    if world_size > 1:  # the all-to-alls need every rank in every micro-batch
        dist.all_reduce(n_micro, op=dist.ReduceOp.MAX)
    loss_sum = torch.zeros((), dtype=torch.float64)
    for k in range(int(n_micro)):
        chunk = local[k * MICRO_BATCH : (k + 1) * MICRO_BATCH]
        tokens, mask, old, adv = _pack(chunk or local[:1], PAD, device)
        if not chunk:
            mask = torch.zeros_like(mask)
        tokens, mask, old = parallel.pad_to_multiple(tokens, mask, old, parallel.seq_len_multiple(pdims), PAD)
        logprobs = token_logprobs(model(tokens)[:, :-1].float(), tokens[:, 1:])
        loss, _ = grpo_loss(logprobs, old, adv, mask, num_sequences=n_samples, num_tokens=n_tokens)
        loss.backward()
        loss_sum += loss.detach().double()
    group = parallel.data_parallel_group(pdims)
    if group is not None:
        dist.all_reduce(loss_sum, group=group)
    params = dict(model.named_parameters())
    grads = {n: _full(p.grad) for n, p in params.items()}
    norm = clip_grad_norm_(list(params.values()), MAX_NORM, foreach=True, ep_enabled=pdims.ep_enabled)
    return {"loss": float(loss_sum), "grad_norm": float(_full(norm)), "grads": grads, "pushed": pushed,
            "kinds": kinds, "ep": pdims.ep}


# ---------------------------------------------------------------- worker


def rank_models(root: str) -> dict[str, str]:
    """The checkpoint of :func:`run_ranks` (tests/multirank.py writes it before its launch)."""
    return {"moe": write_checkpoint(os.path.join(root, "moe"))}


def run_ranks(out_dir: str, model_dirs: dict[str, str]) -> None:
    """In an initialised 2-rank gloo group: every layout's case, rank 0 saves it."""
    import torch.distributed as dist

    for name, layout in LAYOUTS.items():
        t0 = time.perf_counter()
        result = run_case(model_dirs["moe"], layout, EP, dist.get_world_size())
        result["seconds"] = time.perf_counter() - t0
        if dist.get_rank() == 0:
            torch.save(result, os.path.join(out_dir, f"{name}.pt"))
    dist.barrier()


def _worker(out_dir: str, model_dir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    try:
        run_ranks(out_dir, {"moe": model_dir})
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """The single process's case, and both layouts' from 2 ranks: on CPU from
    the suite's shared 2-rank launch (tests/multirank.py), else from one
    torchrun x2 of this file's own."""
    from tests.rank_cases import run_torchrun

    error = None
    if not torch.cuda.is_available():
        shared = request.getfixturevalue("multirank_launched")
        model_dir = shared.model_dirs["moe"]
        try:
            out = shared.extra("test_expert_parallel")
        except pytest.fail.Exception as e:  # reported by every test that reads the launch
            out, error = None, str(e)
    else:
        root = tmp_path_factory.mktemp("expert_parallel")
        model_dir = write_checkpoint(str(root / "moe"))
        out = root / "results"
        out.mkdir()
        try:
            run_torchrun(2, [os.path.abspath(__file__), "worker", "--out", str(out), "--model", model_dir], 600)
        except RuntimeError as e:  # reported by every test that reads the launch
            error = str(e)
    ref = run_case(model_dir, (1, 1, 1), 1, 1)
    return ref, out, error


def _result(launched, layout: str) -> dict:
    _, out, error = launched
    if error is not None:
        pytest.fail(error)
    return torch.load(out / f"{layout}.pt", weights_only=False)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_reference_is_not_trivial(launched):
    """Gradients far above TOL, every expert of every layer trained (routes
    reach all of them, each expert's gradient > 100 x TOL), and per-expert
    HF names in the push."""
    ref = launched[0]
    assert ref["grad_norm"] > 1e3 * TOL
    for name, g in ref["grads"].items():
        if "moe.experts" in name:
            per_expert = g.flatten(1).abs().amax(1)
            assert per_expert.shape == (NUM_EXPERTS,) and bool((per_expert > 1e2 * TOL).all()), (name, per_expert)
    experts = [k for k in ref["pushed"] if ".mlp.experts." in k]
    assert len(experts) == 2 * NUM_EXPERTS * 3, experts


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ep_step_matches_single_process(launched, layout):
    ref, got = launched[0], _result(launched, layout)
    assert got["ep"] == EP
    assert abs(got["loss"] - ref["loss"]) <= TOL, (got["loss"], ref["loss"])
    assert abs(got["grad_norm"] - ref["grad_norm"]) <= TOL * max(1.0, ref["grad_norm"])
    assert _max_diff(ref["grads"], got["grads"]) <= TOL


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ep_push_is_bit_equal(launched, layout):
    """The gather delivers the single process's HF state dict exactly, under
    HF's per-expert names, experts gathered on the flat path over ep."""
    ref, got = launched[0], _result(launched, layout)
    assert sorted(got["pushed"]) == sorted(ref["pushed"])
    bad = [k for k, v in ref["pushed"].items() if not torch.equal(v, got["pushed"][k])]
    assert not bad, bad
    experts = {k: v for k, v in got["kinds"].items() if "moe.experts" in k}
    assert len(experts) == 2 * 3 and set(experts.values()) == {"flat"}, experts


# ------------------------------------------------------------ no launch


@pytest.mark.parametrize("setting, key", [
    ({"expert_tensor_parallel_degree": 2}, "expert_tensor_parallel_degree"),
    ({"pipeline_parallel_degree": 2}, "pipeline_parallel_degree"),
    ({"data_parallel_shard_degree": 1, "data_parallel_replicate_degree": 2}, "expert_parallel_degree"),
    ({"context_parallel_degree": 2}, "context_parallel_degree"),
    ({"data_parallel_shard_degree": 1, "tensor_parallel_degree": 2}, "tensor_parallel_degree"),
])
def test_unsupported_ep_combinations_are_refused(setting, key):
    from torchtitan_grpo.distributed.parallel import build_parallel_dims

    cfg = _config((1, 2, 1), EP)
    for name, value in setting.items():
        setattr(cfg.parallelism, name, value)
    with pytest.raises((ValueError, NotImplementedError), match=f"parallelism.{key}"):
        build_parallel_dims(cfg, 2, "cpu")


def test_ep_is_refused_for_a_dense_model_and_uneven_experts():
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    from torchtitan_grpo.distributed.expert_parallel import check_model
    from torchtitan_grpo.models.hf_bridge import _classes

    with torch.device("meta"):
        dense = _classes("qwen3", Qwen3ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
                                                 hidden_dim=128, vocab_size=128))[0](
            Qwen3ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128, vocab_size=128))
        moe = _classes("qwen3", tiny_moe_args())[0](tiny_moe_args())
    with pytest.raises(ValueError, match="parallelism.expert_parallel_degree=2: the model has no MoE"):
        check_model(dense, 2)
    with pytest.raises(ValueError, match="parallelism.expert_parallel_degree=8 must divide the number of experts"):
        check_model(moe, 8)
    check_model(moe, 4)
    check_model(dense, 1)
    # Qwen3-MoE weights the experts' outputs: TorchTitan's MoE TP gets its router gradient wrong
    with pytest.raises(NotImplementedError, match="parallelism.tensor_parallel_degree=2"):
        check_model(moe, 1, tp=2)
    check_model(dense, 1, tp=2)


def _permute_indices_loop(counts: list[int], experts: int, ranks: int, max_len: int, align: int):
    """The permutation written as the definition: expert by expert, rank by rank."""
    starts = [sum(counts[:i]) for i in range(len(counts))]
    out, sizes = [-1] * max_len, []
    pos = 0
    for e in range(experts):
        w = pos
        for r in range(ranks):
            i = r * experts + e
            out[w : w + counts[i]] = range(starts[i], starts[i] + counts[i])
            w += counts[i]
        size = -(-max(sum(counts[r * experts + e] for r in range(ranks)), align) // align) * align
        sizes.append(size)
        pos += size
    return out, sizes


def test_cpu_permutation_matches_its_definition():
    from torchtitan_grpo.distributed.expert_parallel import permute_indices

    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        ranks, experts = (int(torch.randint(1, 4, (1,), generator=g)) for _ in range(2))
        counts = torch.randint(0, 12, (ranks * experts,), generator=g)
        counts[torch.rand(ranks * experts, generator=g) < 0.3] = 0  # experts without tokens get padding only
        max_len = -(-(int(counts.sum()) + experts * 8) // 8) * 8
        idx, sizes, offsets = permute_indices(counts, experts, ranks, max_len, 8)
        want, want_sizes = _permute_indices_loop(counts.tolist(), experts, ranks, max_len, 8)
        assert idx.dtype == torch.int32 and idx.tolist() == want and sizes.tolist() == want_sizes
        assert offsets.tolist() == torch.tensor(want_sizes).cumsum(0).tolist()


def test_integer_histc_counts_as_histc_does():
    from torchtitan_grpo.distributed.expert_parallel import IntegerHistc

    x = torch.tensor([[0, 3], [1, 3], [3, 2], [7, -1]])
    want = torch.histc(x.float(), bins=4, min=0, max=4)  # 7 and -1 are out of range
    with IntegerHistc():
        got = torch.histc(x, bins=4, min=0, max=4)
        auto = torch.histc(x, bins=2)  # min == max: the data's range, max in the last bin
    assert got.dtype == torch.int64 and got.tolist() == want.long().tolist() == [1, 1, 1, 3]
    assert auto.tolist() == torch.histc(x.float(), bins=2).long().tolist()
    with pytest.raises(RuntimeError, match="histogram_cpu"):  # what the mode is for
        torch.histc(x, bins=4, min=0, max=4)


def test_30b_a3b_push_names_and_buckets(capsys):
    """Qwen3-30B-A3B's shapes (48 layers x 128 experts) on meta: the gather's
    full tensors named by the adapter give 48 x 128 x 3 = 18,432 per-expert
    tensors, each a view of its grouped weight, and the bucket plans take
    them all. Prints the host time of naming and planning."""
    from torchtitan.models.qwen3 import qwen3_args

    from torchtitan_grpo.models import hf_bridge as hf_model
    from torchtitan_grpo.weight_sync import buckets as bk

    args = qwen3_args["30B-A3B"]
    with torch.device("meta"):
        model = hf_model._classes("qwen3", args)[0](args)
    full = {k: torch.empty(v.shape, dtype=torch.bfloat16, device="meta") for k, v in model.state_dict().items()}
    adapter = hf_model.state_dict_adapter("qwen3", args, None)
    t0 = time.perf_counter()
    hf = adapter.to_hf(full)
    named = time.perf_counter() - t0
    specs = [bk.TensorSpec.from_checked(k, v.dtype, tuple(v.shape)) for k, v in hf.items()]
    buckets = bk.plan_buckets(specs, 1 << 30)
    chunks = bk.plan_packed_chunks(specs, 1 << 30)
    planned = time.perf_counter() - t0 - named
    experts = [k for k in hf if ".mlp.experts." in k]
    assert len(experts) == 48 * 128 * 3
    assert hf["model.layers.47.mlp.experts.127.down_proj.weight"].shape == (2048, 768)
    assert sum(map(len, buckets)) == sum(map(len, chunks)) == len(specs) == len(hf)
    total = bk.packed_nbytes(specs)
    assert 55e9 < total < 65e9, total  # ~30.5 B parameters in bf16
    with capsys.disabled():
        print(f"\n30B-A3B push names: {len(hf)} tensors ({len(experts)} experts), {total / 1e9:.1f} GB bf16; "
              f"naming {named * 1e3:.0f} ms, specs + plans {planned * 1e3:.0f} ms, {len(buckets)} buckets of 1 GiB")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["worker"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", required=True)
    a = ap.parse_args()
    _worker(a.out, a.model)
