"""LoRA on two trainer ranks (torchtitan_grpo.lora.sharded): FSDP2 equals one
process, on CPU over gloo with real torchrun ranks, in one launch.

Each rank builds, with ``trainer.build_policy``, a one-process LoRA policy
(the reference; its ``A`` drawn by ``init_adapters`` with the same seed as
the sharded build draws it) and an FSDP2 (dp_shard=2) LoRA policy, and takes
two GRPO steps on each with the same batch (split over the FSDP ranks,
losses normalised by global counts). Compared, fp32, to 1e-6: the losses,
the adapters' gradients (as clipping sees them) and weights, the merged
HF-named weights (``hf_weights``) and what the push sends (merged and
adapter-only); the frozen base stays bit-identical; the optimizer holds the
adapters only. A DCP checkpoint of the FSDP2 policy restores its adapters and
their optimizer state into a fresh one, and the peft export of the sharded
adapters equals the reference's. ``lora.base_dtype = "bfloat16"`` stores the
adapted weights in bf16 (adapters float32) and still trains, under FSDP2's
float32 compute and under its bf16 mixed precision (one step each).

With two GPUs the same launch runs over NCCL, one GPU per rank
(scripts/device_lora_sharded.sh), at the GPU parity tests' 1e-5.
"""

from __future__ import annotations

import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402

import torchtitan_grpo  # noqa: E402,F401  (before torchtitan)

DEMO = os.path.join(ROOT, "train_configs", "demo_cpu.toml")
WORLD = 2
ON_GPUS = torch.cuda.device_count() >= WORLD  # one GPU per rank over NCCL, else CPU over gloo
# fp32 on CPU: 3e-7 seen; GPUs: cuBLAS picks kernels by batch shape (test_parallel_parity's 1e-5)
TOL = 1e-5 if ON_GPUS else 1e-6
torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on GPUs too
torch.backends.cudnn.allow_tf32 = False
SEED = 7  # grpo.seed: the adapters' A


def _cfg(model_dir: str, *extra: str):
    from torchtitan_grpo.config.parse import parse_config

    return parse_config(["--job.config_file", DEMO, "--model.hf_assets_path", model_dir,
                         "--lora.enable", "--lora.rank", "4", "--lora.alpha", "8", "--grpo.seed", str(SEED),
                         "--grpo.micro_batch_size", "2", "--grpo.is_correction", "none",
                         "--optimizer.lr", "1e-2", "--optimizer.eps", "1e-4", "--lr_scheduler.warmup_steps", "1",
                         *extra])


def _batch():
    from torchtitan_grpo.train.sample import Sample

    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(6):
        n_prompt, n_completion = 3 + i % 3, 2 + (2 * i) % 5
        ids = torch.randint(2, 97, (n_prompt + n_completion,), generator=g).tolist()
        out.append(Sample(ids[:n_prompt], ids[n_prompt:], [-math.log(128)] * n_completion, (-1.0) ** i * (1 + i / 5),
                          0.0, "stop", ["0"]))
    return out


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


class _Recorder:
    """Stands in for rank 0's Pusher: keeps what it is given."""

    def __init__(self):
        self.pushed: dict[int, dict[str, torch.Tensor]] = {}

    def push(self, tensors, version, wait):
        self.pushed[version] = {k: v.detach().clone() for k, v in tensors.items()}
        return {"push/bytes": float(sum(v.numel() * v.element_size() for v in tensors.values()))}


def _train(policy, cfg, d, dp_rank: int, dp_degree: int, steps: int = 2) -> dict:
    """``steps`` GRPO steps; losses, the last step's adapter gradients, adapters after."""
    from torchtitan_grpo.lora import adapters as lora
    from torchtitan_grpo.train import trainer

    batch = _batch()
    ntok = sum(len(s.completion_ids) for s in batch)
    grads: dict[str, torch.Tensor] = {}
    clip = trainer._clip_grad_norm

    def snapshot_then_clip(p):
        grads.update({n: _whole(q.grad) for n, q in p.model.named_parameters() if q.grad is not None})
        return clip(p)

    trainer._clip_grad_norm = snapshot_then_clip
    try:
        losses = [trainer.train_step(policy, batch[dp_rank::dp_degree], cfg.grpo, 1.0, 8, len(batch), ntok, 0,
                                     d)["loss"] for _ in range(steps)]
    finally:
        trainer._clip_grad_norm = clip
    adapters = {f"{k}.{n}": _whole(getattr(m, n)) for k, m in lora.adapted_modules(policy.model).items()
                for n in ("lora_A", "lora_B")}
    return {"losses": losses, "grads": grads, "adapters": adapters}


def _base(policy) -> dict[str, torch.Tensor]:
    return {k: _whole(v) for k, v in policy.model.state_dict().items() if not k.endswith(("lora_A", "lora_B"))}


def _maxdiff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _worker(model_dir: str, out_dir: str) -> dict:
    """Every check's numbers on this rank (a collective: both ranks run it)."""
    import torch.distributed as dist

    from torchtitan_grpo.lora import adapters as lora, sharded as lora_sharded
    from torchtitan_grpo.train import trainer
    from torchtitan_grpo.lora.peft import peft_adapter_tensors
    from torchtitan_grpo.distributed.parallel import data_parallel_rank_and_degree

    rank = dist.get_rank()
    device = torch.device("cuda", rank) if ON_GPUS else torch.device("cpu")
    res: dict = {}

    # the one-process reference (A reseeded as the sharded build draws it)
    one = trainer.Dist(rank, 1, rank, device)
    cfg1 = _cfg(model_dir)
    ref = trainer.build_policy(cfg1, model_dir, one)
    lora_sharded.init_adapters(ref.model, SEED)
    ref_base = _base(ref)
    ref_out = _train(ref, cfg1, one, 0, 1)
    ref_hf = trainer.hf_weights(ref)
    ref_peft = peft_adapter_tensors(ref.model, ref.adapter)

    # FSDP2 over the two ranks
    d = trainer.Dist(rank, WORLD, rank, device)
    cfg = _cfg(model_dir, "--parallelism.data_parallel_shard_degree", "2",
               "--job.dump_folder", out_dir, "--checkpoint.enable", "--checkpoint.interval", "1")
    pol = trainer.build_policy(cfg, model_dir, d)
    adapters = lora.adapted_modules(pol.model)
    trained = [p for g in pol.optimizers.optimizers[0].param_groups for p in g["params"]]
    res["optimizer_holds_adapters_only"] = (
        {id(p) for p in trained} == {id(p) for m in adapters.values() for p in (m.lora_A, m.lora_B)})
    res["sharded"] = all(type(m.lora_A).__name__ == "DTensor" for m in adapters.values())
    base0 = _base(pol)
    res["start_equals_reference_start"] = _maxdiff(base0, ref_base)
    dp_rank, dp_degree = data_parallel_rank_and_degree(pol.parallel_dims)
    got = _train(pol, cfg, d, dp_rank, dp_degree)
    res["losses"] = (ref_out["losses"], got["losses"])
    res["loss_diff"] = max(abs(a - b) for a, b in zip(*res["losses"]))
    res["grad_diff"] = _maxdiff(ref_out["grads"], got["grads"])
    res["adapter_diff"] = _maxdiff(ref_out["adapters"], got["adapters"])
    res["b_moved"] = min(float(v.abs().max()) for k, v in got["adapters"].items() if k.endswith("lora_B"))
    res["base_changed"] = _maxdiff(base0, _base(pol))
    hf = trainer.hf_weights(pol)
    res["hf_diff"] = _maxdiff(ref_hf, hf)
    res["hf_differs_from_base"] = _maxdiff(hf, pol.adapter.to_hf(base0))
    res["peft_diff"] = _maxdiff(ref_peft, peft_adapter_tensors(pol.model, pol.adapter))  # after the gather above

    # the push: every rank gathers, rank 0's Pusher gets the tensors
    for only in (False, True):
        rec = _Recorder() if rank == 0 else None
        with lora_sharded.ShardedLoraPush(pol.model_parts, pol.adapter, rec, sync=True, adapter_only=only) as push:
            push.snapshot(5, wait=True)
        if rec is not None:
            res[f"push_diff_{'adapter' if only else 'merged'}"] = _maxdiff(ref_peft if only else ref_hf, rec.pushed[5])

    # DCP: save, then a fresh policy resumes the adapters and their optimizer state
    resumed, fresh = resume_check(cfg, pol, model_dir, d)
    res.update(resumed)
    res["resumed_next_loss"] = (_train(pol, cfg, d, dp_rank, dp_degree, 1)["losses"][0],
                                _train(fresh, cfg, d, dp_rank, dp_degree, 1)["losses"][0])

    # lora.base_dtype = "bfloat16": FSDP2 in float32, then in bf16 mixed precision
    from tests.rank_cases import _bf16_fsdp_kept

    for mp in ("float32", "bfloat16"):
        cfg_bf = _cfg(model_dir, "--parallelism.data_parallel_shard_degree", "2", "--lora.base_dtype", "bfloat16",
                      "--training.mixed_precision_param", mp)
        with _bf16_fsdp_kept(mp, device):
            bf = trainer.build_policy(cfg_bf, model_dir, d)
        mods = lora.adapted_modules(bf.model).values()
        res[f"bf16_{mp}_dtypes"] = sorted({(str(m.weight.dtype), str(m.lora_A.dtype), str(m.lora_B.dtype))
                                           for m in mods})
        out = _train(bf, cfg_bf, d, dp_rank, dp_degree, steps=1)
        res[f"bf16_{mp}_losses"] = out["losses"]
        res[f"bf16_{mp}_b_moved"] = min(float(v.abs().max()) for k, v in out["adapters"].items()
                                        if k.endswith("lora_B"))
        res[f"bf16_{mp}_hf_dtype"] = sorted({str(v.dtype) for v in trainer.hf_weights(bf).values()})
    return res


def rank_models(root: str) -> dict[str, str]:
    """The checkpoint of :func:`run_ranks`: the demo's tiny Qwen3 (tests/multirank.py's ``qwen3``)."""
    return {}


def resume_check(cfg, pol, model_dir: str, d) -> tuple[dict, object]:
    """A DCP save of ``pol`` at step 2, a fresh policy built and resumed from it:
    the resumed step and the max differences of the model and optimizer states,
    and the resumed policy."""
    from torchtitan_grpo.train import trainer
    from torchtitan_grpo.train.checkpoint import Checkpointer

    ckpt = Checkpointer(cfg, pol, d)
    ckpt.save(2, weight_version=2)
    ckpt.close()
    saved_opt = {k: _whole(v) for k, v in pol.optimizers.state_dict().items() if torch.is_tensor(v)}
    fresh = trainer.build_policy(cfg, model_dir, d)
    ckpt = Checkpointer(cfg, fresh, d)
    resumed = ckpt.load()
    ckpt.close()
    loaded_opt = {k: _whole(v) for k, v in fresh.optimizers.state_dict().items() if torch.is_tensor(v)}
    return {"resumed_step": resumed.step if resumed else None,
            "resumed_model_diff": _maxdiff({k: _whole(v) for k, v in pol.model.state_dict().items()},
                                           {k: _whole(v) for k, v in fresh.model.state_dict().items()}),
            "n_opt": len(saved_opt), "resumed_opt_diff": _maxdiff(saved_opt, loaded_opt)}, fresh


def save_every_rank(res, out_dir: str) -> None:
    """Every rank's ``res`` in rank 0's ``results.pt`` (a list by rank); the ranks leave together."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, res)
    if dist.get_rank() == 0:
        torch.save(every, os.path.join(out_dir, "results.pt"))
    dist.barrier()


def run_ranks(out_dir: str, model_dirs: dict[str, str]) -> None:
    """In an initialised 2-rank group: :func:`_worker`, every rank's results in rank 0's ``results.pt``."""
    save_every_rank(_worker(model_dirs["qwen3"], os.path.join(out_dir, "dump")), out_dir)


def _main(model_dir: str, out_dir: str, run=None, gpus: bool = ON_GPUS) -> None:
    """A torchrun worker: the group (NCCL on GPUs), ``run`` (this file's
    :func:`run_ranks` unless given) on the tiny model, the group closed."""
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    if gpus:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if gpus else "gloo", timeout=timedelta(seconds=120))
    try:
        (run or run_ranks)(out_dir, {"qwen3": model_dir})
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ tests


def rank_results(request, tmp_path_factory, script: str) -> list[dict]:
    """Both ranks' results of ``script`` (this file or test_lora_pp.py, whose
    ``run_ranks`` save them alike): on CPU from the suite's shared 2-rank
    launch (tests/multirank.py), else from one 2-rank torchrun of the file's own."""
    from tests.rank_cases import run_torchrun

    stem = os.path.splitext(os.path.basename(script))[0]
    if not torch.cuda.is_available():
        out = str(request.getfixturevalue("multirank_launched").extra(stem))
    else:
        out = str(tmp_path_factory.mktemp(stem))
        run_torchrun(WORLD, [os.path.abspath(script), request.getfixturevalue("tiny_model_dir"), out],
                     timeout=300)  # a hang guard only
    return torch.load(os.path.join(out, "results.pt"), weights_only=False)


@pytest.fixture(scope="module")
def results(request, tmp_path_factory) -> list[dict]:
    return rank_results(request, tmp_path_factory, __file__)


def test_fsdp2_lora_equals_one_process(results):
    for r in results:
        assert r["sharded"] and r["optimizer_holds_adapters_only"]
        assert r["start_equals_reference_start"] == 0.0  # the same base on both
        l_ref, l_got = r["losses"]
        assert l_ref[0] != l_ref[1]  # the first step changed the model
        assert r["loss_diff"] <= TOL, r["losses"]
        assert r["grad_diff"] <= TOL and r["adapter_diff"] <= TOL, (r["grad_diff"], r["adapter_diff"])
        assert r["b_moved"] > 1e-4  # every B trained off zero
        assert r["base_changed"] == 0.0  # the frozen base is bit-identical
        assert r["hf_diff"] <= TOL and r["hf_differs_from_base"] > 1e-4
        assert r["peft_diff"] <= TOL


def test_fsdp2_lora_push_merged_and_adapter(results):
    r = results[0]
    assert r["push_diff_merged"] <= TOL and r["push_diff_adapter"] <= TOL


def check_resumed(results: list[dict], tol: float, prefix: str = "") -> None:
    """Every rank's ``resume_check`` figures (keys under ``prefix``): resumed at
    step 2 with optimizer state, model and AdamW state bit-exact, the next loss
    within ``tol``."""
    for r in results:
        assert r[prefix + "resumed_step"] == 2 and r[prefix + "n_opt"] > 0
        assert r[prefix + "resumed_model_diff"] == 0.0 and r[prefix + "resumed_opt_diff"] == 0.0
        a, b = r[prefix + "resumed_next_loss"]
        assert abs(a - b) <= tol, (a, b)


def test_fsdp2_lora_checkpoint_resumes_adapters_and_optimizer(results):
    check_resumed(results, TOL)


@pytest.mark.parametrize("mp", ["float32", "bfloat16"])
def test_bf16_base_trains_under_fsdp2(results, mp):
    for r in results:
        assert r[f"bf16_{mp}_dtypes"] == [("torch.bfloat16", "torch.float32", "torch.float32")]
        losses = r[f"bf16_{mp}_losses"]
        assert all(math.isfinite(x) for x in losses)
        assert r[f"bf16_{mp}_b_moved"] > 1e-4  # one step trained every B off zero
        assert r[f"bf16_{mp}_hf_dtype"] == ["torch.float32"]  # merged in the adapters' dtype


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
