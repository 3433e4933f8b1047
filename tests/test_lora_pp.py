"""LoRA under pipeline and tensor parallelism (torchtitan_grpo.lora.pp, lora_tp): PP=2
and TP=2 each equal one process, on CPU over gloo with real torchrun ranks, in one launch.

Each rank builds, with ``trainer.build_policy``, a one-process LoRA policy
(the reference, its ``A`` drawn by ``init_adapters`` with the seed the PP
build uses) and a PP=2 LoRA policy (one stage per rank), and takes two GRPO
steps on each with the same batch. Compared over the stages, fp32, to 1e-6:
the losses, the adapters' gradients and weights, the merged HF-named weights
and the adapters that ``trainer_push``'s object (``PipelineLoraPush``) hands
rank 0's Pusher; every stage's frozen base stays bit-identical; each stage's
optimizer holds its adapters only. A DCP checkpoint of the stages restores
adapters and optimizer state into a fresh PP policy; ``checkpoint.export_hf``
writes every stage's merged weights and the whole peft adapter. In the same launch,
TP=2 (``tensor_parallel_degree``, :mod:`torchtitan_grpo.lora.tp`) against
the same reference: the adapters' placements, losses, gradients, adapters,
merged HF weights and both pushes within 1e-6, the base bit-identical and
frozen (the optimizer holds the adapters only), and a DCP checkpoint of the
TP shards restores adapters and optimizer state into a fresh TP policy. Helpers come from
tests/test_lora_sharded.py (configs, batch, training loop, recorder).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402

import torchtitan_grpo  # noqa: E402,F401  (before torchtitan)
from tests.test_lora_sharded import SEED, _base, _cfg, _maxdiff, _Recorder, _train  # noqa: E402
from tests.test_lora_sharded import _main as sharded_main, check_resumed, rank_results, resume_check, save_every_rank  # noqa: E402

WORLD = 2
TOL = 1e-6  # fp32 on CPU
# lr 1e-2 (test_lora_sharded's) puts the adapters 9.5e-7 from one process here: the pipeline's padded
# micro-batches round differently (gradients 1.3e-7 apart), which Adam's first steps scale by lr / eps
LR = ("--optimizer.lr", "2e-3")


def _stages(local: dict) -> dict:
    """Every stage's ``local`` dict united (a collective)."""
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def _worker(model_dir: str, out_dir: str) -> dict:
    """Every check's numbers on this rank (a collective: both ranks run it)."""
    import torch.distributed as dist

    from torchtitan_grpo.lora import adapters as lora, sharded as lora_sharded
    from torchtitan_grpo.train import trainer
    from torchtitan_grpo.train.checkpoint import export_hf
    from torchtitan_grpo.lora.peft import peft_adapter_tensors
    from torchtitan_grpo.weight_sync.gather import trainer_push

    rank = dist.get_rank()
    device = torch.device("cpu")
    res: dict = {}

    # the one-process reference (A reseeded as the PP build draws it)
    one = trainer.Dist(rank, 1, rank, device)
    cfg1 = _cfg(model_dir, *LR)
    ref = trainer.build_policy(cfg1, model_dir, one)
    lora_sharded.init_adapters(ref.model, SEED)
    ref_base = _base(ref)
    ref_out = _train(ref, cfg1, one, 0, 1)
    ref_hf = trainer.hf_weights(ref)
    ref_peft = peft_adapter_tensors(ref.model, ref.adapter)

    # PP=2: one stage per rank, the whole batch through the pipeline
    d = trainer.Dist(rank, WORLD, rank, device)
    cfg = _cfg(model_dir, *LR, "--parallelism.pipeline_parallel_degree", "2",
               "--job.dump_folder", out_dir, "--checkpoint.enable", "--checkpoint.interval", "1")
    pol = trainer.build_policy(cfg, model_dir, d)
    adapters = lora.adapted_modules(pol.model)
    trained = [p for g in pol.optimizers.optimizers[0].param_groups for p in g["params"]]
    res["n_stage_adapters"] = len(adapters)
    res["optimizer_holds_adapters_only"] = (
        {id(p) for p in trained} == {id(p) for m in adapters.values() for p in (m.lora_A, m.lora_B)})
    base0 = _base(pol)
    res["start_diff"] = _maxdiff(_stages(base0), ref_base)
    got = _train(pol, cfg, d, 0, 1)
    res["losses"] = (ref_out["losses"], got["losses"])
    res["loss_diff"] = max(abs(a - b) for a, b in zip(*res["losses"]))
    res["grad_diff"] = _maxdiff(ref_out["grads"], _stages(got["grads"]))
    res["adapter_diff"] = _maxdiff(ref_out["adapters"], _stages(got["adapters"]))
    res["b_moved"] = min(float(v.abs().max()) for k, v in got["adapters"].items() if k.endswith("lora_B"))
    res["base_changed"] = _maxdiff(base0, _base(pol))

    # the push: trainer_push's object; every stage merges its own, rank 0's Pusher gets the whole model
    for only in (False, True):
        rec = _Recorder() if rank == 0 else None
        ws = SimpleNamespace(mode="sync", lora_push="adapter" if only else "merged")
        with trainer_push(pol.model_parts, pol.adapter, pol.parallel_dims, device, rec, ws) as push:
            res["push_kind"] = type(push).__name__
            push.snapshot(5, wait=True)
            push.snapshot(6, wait=True)  # the planned transfers again
        if rec is not None:
            want = ref_peft if only else ref_hf
            res[f"push_diff_{'adapter' if only else 'merged'}"] = max(_maxdiff(want, rec.pushed[v]) for v in (5, 6))
    res["merged_differs_from_base"] = _maxdiff(ref_hf, ref.adapter.to_hf(ref_base))

    # checkpoint.hf_export under PP: every stage's merged weights and adapters, written by rank 0
    exp = export_hf(pol, model_dir, os.path.join(out_dir, "export"), d)
    if rank == 0:
        from safetensors.torch import load_file

        written = load_file(os.path.join(exp, "model.safetensors"))
        res["export_missing"] = sorted(ref_hf.keys() - written.keys() - {"lm_head.weight"})  # tied: written once
        res["export_diff"] = _maxdiff({k: ref_hf[k] for k in written}, written)
        res["export_peft_diff"] = _maxdiff(ref_peft, load_file(os.path.join(exp, "lora_adapter",
                                                                            "adapter_model.safetensors")))

    # DCP: save the stages, a fresh PP policy resumes adapters and optimizer state
    resumed, fresh = resume_check(cfg, pol, model_dir, d)
    res.update(resumed)
    res["resumed_next_loss"] = (_train(pol, cfg, d, 0, 1, 1)["losses"][0], _train(fresh, cfg, d, 0, 1, 1)["losses"][0])
    res |= _tp(model_dir, os.path.join(out_dir, "tp"), ref_base, ref_out, ref_hf, ref_peft)
    return res


def _tp(model_dir: str, out_dir: str, ref_base: dict, ref_out: dict, ref_hf: dict, ref_peft: dict,
        *extra: str) -> dict:
    """TP=2 (torchtitan_grpo.lora.tp) against the same one-process reference, in the same launch, and
    its DCP save-and-resume under ``out_dir`` (``extra``: more [parallelism] keys, e.g. FSDP x TP on four
    ranks by hand)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    from torchtitan_grpo.lora import adapters as lora
    from torchtitan_grpo.train import trainer
    from torchtitan_grpo.distributed.parallel import data_parallel_rank_and_degree
    from torchtitan_grpo.weight_sync.gather import trainer_push

    rank, device = dist.get_rank(), torch.device("cpu")
    d = trainer.Dist(rank, dist.get_world_size(), rank, device)
    cfg = _cfg(model_dir, *LR, "--parallelism.tensor_parallel_degree", "2", *extra,
               "--job.dump_folder", out_dir, "--checkpoint.enable", "--checkpoint.interval", "1")
    pol = trainer.build_policy(cfg, model_dir, d)
    mods = lora.adapted_modules(pol.model)
    want = {"col": (Shard(0), Replicate(), Shard(0)), "row": (Shard(1), Shard(1), Replicate())}
    res: dict = {"tp_placements": {k: (m.weight.placements[-1], m.lora_A.placements[-1], m.lora_B.placements[-1])
                                   for k, m in mods.items()}}  # the TP mesh dim is the last
    res["tp_want"] = {k: want["row" if k.endswith(("wo", "w2")) else "col"] for k in mods}
    trained = [p for g in pol.optimizers.optimizers[0].param_groups for p in g["params"]]
    res["tp_optimizer_holds_adapters_only"] = (  # SequenceParallel's norms stay frozen
        {id(p) for p in trained} == {id(p) for m in mods.values() for p in (m.lora_A, m.lora_B)})
    dp_rank, dp_degree = data_parallel_rank_and_degree(pol.parallel_dims)
    base0 = _base(pol)
    res["tp_start_diff"] = _maxdiff(base0, ref_base)
    got = _train(pol, cfg, d, dp_rank, dp_degree)
    res["tp_losses"] = (ref_out["losses"], got["losses"])
    res["tp_loss_diff"] = max(abs(a - b) for a, b in zip(*res["tp_losses"]))
    res["tp_grad_diff"] = _maxdiff(ref_out["grads"], got["grads"])
    res["tp_adapter_diff"] = _maxdiff(ref_out["adapters"], got["adapters"])
    res["tp_base_changed"] = _maxdiff(base0, _base(pol))
    res["tp_hf_diff"] = _maxdiff(ref_hf, trainer.hf_weights(pol))
    for only in (False, True):
        rec = _Recorder() if rank == 0 else None
        ws = SimpleNamespace(mode="sync", lora_push="adapter" if only else "merged")
        with trainer_push(pol.model_parts, pol.adapter, pol.parallel_dims, device, rec, ws) as push:
            res["tp_push_kind"] = type(push).__name__
            push.snapshot(5, wait=True)
        if rec is not None:
            res[f"tp_push_diff_{'adapter' if only else 'merged'}"] = _maxdiff(ref_peft if only else ref_hf,
                                                                               rec.pushed[5])

    # DCP: save the TP shards, a fresh TP policy resumes adapters and optimizer state
    resumed, fresh = resume_check(cfg, pol, model_dir, d)
    res |= {f"tp_{k}": v for k, v in resumed.items()}
    res["tp_resumed_next_loss"] = (_train(pol, cfg, d, dp_rank, dp_degree, 1)["losses"][0],
                                   _train(fresh, cfg, d, dp_rank, dp_degree, 1)["losses"][0])
    return res


def rank_models(root: str) -> dict[str, str]:
    """The checkpoint of :func:`run_ranks`: the demo's tiny Qwen3 (tests/multirank.py's ``qwen3``)."""
    return {}


def run_ranks(out_dir: str, model_dirs: dict[str, str]) -> None:
    """In an initialised 2-rank gloo group: :func:`_worker`, every rank's results in rank 0's ``results.pt``
    (tests/multirank.py's protocol for a file whose cases can ride on a shared launch)."""
    save_every_rank(_worker(model_dirs["qwen3"], os.path.join(out_dir, "dump")), out_dir)


# ------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def results(request, tmp_path_factory) -> list[dict]:
    return rank_results(request, tmp_path_factory, __file__)


def test_pp_lora_equals_one_process(results):
    for r in results:
        assert r["n_stage_adapters"] > 0 and r["optimizer_holds_adapters_only"]
        assert r["start_diff"] == 0.0  # the stages together hold the reference's base
        l_ref, l_got = r["losses"]
        assert l_ref[0] != l_ref[1]  # the first step changed the model
        assert r["loss_diff"] <= TOL, r["losses"]
        assert r["grad_diff"] <= TOL and r["adapter_diff"] <= TOL, (r["grad_diff"], r["adapter_diff"])
        assert r["b_moved"] > 1e-4  # every B of the stage trained off zero
        assert r["base_changed"] == 0.0  # the frozen base is bit-identical


def test_pp_lora_push_merged_and_adapter(results):
    r = results[0]
    assert r["push_kind"] == "PipelineLoraPush"
    assert r["merged_differs_from_base"] > 1e-4  # the merge is not the base
    assert r["push_diff_merged"] <= TOL and r["push_diff_adapter"] <= TOL


def test_pp_lora_hf_export_merges_every_stage(results):
    r = results[0]
    assert r["export_missing"] == []
    assert r["export_diff"] <= TOL and r["export_peft_diff"] <= TOL, (r["export_diff"], r["export_peft_diff"])


def test_pp_lora_checkpoint_resumes_adapters_and_optimizer(results):
    check_resumed(results, TOL)


def test_tp_lora_equals_one_process(results):
    """TP=2 (lora_tp): the adapters placed like their weights, two steps as one process, the base frozen."""
    for r in results:
        assert r["tp_placements"] == r["tp_want"]
        assert r["tp_optimizer_holds_adapters_only"]
        assert r["tp_start_diff"] == 0.0 and r["tp_base_changed"] == 0.0
        assert r["tp_losses"][1][0] != r["tp_losses"][1][1]
        assert r["tp_loss_diff"] <= TOL, r["tp_losses"]
        assert r["tp_grad_diff"] <= TOL and r["tp_adapter_diff"] <= TOL, (r["tp_grad_diff"], r["tp_adapter_diff"])
        assert r["tp_hf_diff"] <= TOL  # hf_weights: the merge of the gathered shards
    assert results[0]["tp_push_kind"] == "ShardedLoraPush"
    assert results[0]["tp_push_diff_merged"] <= TOL and results[0]["tp_push_diff_adapter"] <= TOL


def test_tp_lora_checkpoint_resumes_adapters_and_optimizer(results):
    """TP=2: the resumed shards (model and AdamW state) are the saved ones bit for bit; the next step agrees."""
    check_resumed(results, TOL, "tp_")


if __name__ == "__main__":
    sharded_main(sys.argv[1], sys.argv[2], run_ranks, gpus=False)
