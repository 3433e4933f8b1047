"""One GRPO step gives the same numbers in every parallel layout
(torchtitan_grpo.distributed.parallel), on CPU over gloo with real torchrun ranks (the
same file runs on GPUs over NCCL, one GPU per rank, where launches needing
more GPUs than there are skip).

A fixed batch (tokens, masks, advantages, rollout log-probs; uneven lengths
and an odd sample count, so DP ranks get different numbers of samples and TP
needs padding) goes through micro-batched forward/backward with the GRPO loss
normalised by *global* counts, TorchTitan's grad-norm clipping and one AdamW
step. Each layout is compared with a single process on: the batch loss, the
grad norm, every full gradient (Adam's first step hides a gradient scale,
clipping too, so the gradients are compared directly), every parameter after
the step, and the HF-named tensors that would be pushed to the servers.

Models (tiny, fp32): qwen3 untied, qwen3 tied (``tie_word_embeddings``) and
llama3. Layouts: FSDP dp_shard=2, TP=2, DDP dp_replicate=2 and PP=2 (1F1B)
in one 2-rank launch; HSDP 2x2, FSDP 2 x TP 2, PP 2 x FSDP 2 (GPipe) and
PP 2 x TP 2 (1F1B) in one 4-rank launch.

Pipeline layouts run the trainer itself (``trainer.build_policy`` and
``trainer.train_step``: the GRPO loss goes through the pipeline schedule on
the last stage), so besides the numbers above every rank's step metrics are
compared with a single-process ``train_step``; stage tensors are gathered
from all stages by their FQNs.

Run as a script to print the measured table (docs/PARITY.md)::

    python tests/test_parallel_parity.py                      # fp32, as the tests
    python tests/test_parallel_parity.py --dtype bfloat16     # bf16 compute

``--dtype bfloat16`` measures the same table with every layout and the single
process computing in bf16 (fp32 master weights, gradients, optimizer and
loss; see :func:`_bf16_compute`). It reports, it asserts nothing: bf16 is far
from the tests' 1e-5, which stay fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import subprocess
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
# fp32 means fp32 on GPUs too (the same file runs there over NCCL)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

TOL = 1e-5
DTYPES = ("float32", "bfloat16")  # compute dtype of the table; the tests run float32
PAD = 0
MICRO_BATCH = 2
MAX_NORM = 1.0
MODELS = ("qwen3", "qwen3_tied", "llama3")
MAX_NEW_TOKENS = 8
# name -> (dp_replicate, dp_shard, tp[, pp]); the product is the launch's world size
LAYOUTS = {
    "fsdp": (1, 2, 1),
    "tp": (1, 1, 2),
    "ddp": (2, 1, 1),
    "pp": (1, 1, 1, 2),
    "hsdp": (2, 2, 1),
    "fsdp_tp": (1, 2, 2),
    "pp_fsdp": (1, 2, 1, 2),
    "pp_tp": (1, 1, 2, 2),
}
PP_SCHEDULES = {"pp": "1F1B", "pp_fsdp": "GPipe", "pp_tp": "1F1B"}
# pp_fsdp: 3 rows per micro-batch, so the DP rank with 3 samples pads one row
PP_MICRO_BATCH = {"pp_fsdp": 3}
LAUNCHES = {2: ("fsdp", "tp", "ddp", "pp"), 4: ("hsdp", "fsdp_tp", "pp_fsdp", "pp_tp")}
EMPTY_RANK_LAYOUT = "pp_fsdp"  # also steps once with a DP rank that has no samples
CHECKPOINT_LAYOUT = "pp"  # also saves and resumes a checkpoint of the stages
if torch.cuda.is_available():  # one GPU per rank
    LAUNCHES = {n: names for n, names in LAUNCHES.items() if n <= torch.cuda.device_count()}


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


# --------------------------------------------------------------- fixtures


def write_models(root: str) -> dict[str, str]:
    """Tiny qwen3 (untied and tied) and llama3 HF checkpoints under ``root``."""
    from torchtitan_grpo.models.demo_assets import TinyQwen3, ensure_tiny_qwen3, write_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    dirs = {
        "qwen3": ensure_tiny_qwen3(os.path.join(root, "qwen3")),
        "qwen3_tied": ensure_tiny_qwen3(
            os.path.join(root, "qwen3_tied"), TinyQwen3(tie_word_embeddings=True, seed=1)
        ),
    }
    llama = os.path.join(root, "llama3")
    if not os.path.exists(os.path.join(llama, "config.json")):
        config = LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=1,
            pad_token_id=0,
        )
        torch.manual_seed(2)
        model = LlamaForCausalLM(config)
        with torch.no_grad():  # norms away from 1 so a mix-up cannot hide
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
        model.save_pretrained(llama, safe_serialization=True)
        write_tokenizer(llama)
    dirs["llama3"] = llama
    return dirs


def fixed_batch():
    """Seven samples with uneven prompt/completion lengths, drawn from a fixed seed."""
    from torchtitan_grpo.train.trainer import Sample

    g = torch.Generator().manual_seed(1234)
    samples = []
    for i in range(7):
        n_prompt = 3 + i % 4
        n_completion = 2 + (3 * i) % 6
        ids = torch.randint(2, 97, (n_prompt + n_completion,), generator=g).tolist()
        # near the untrained model's log-probs (~ -log 128) so some ratios clip
        old = (-math.log(128) + 0.3 * torch.randn(n_completion, generator=g)).tolist()
        samples.append(Sample(ids[:n_prompt], ids[n_prompt:], old, 0.0, 0.0, "stop", []))
    adv = torch.randn(len(samples), generator=g)
    adv = (adv - adv.mean()) / adv.std()
    for s, a in zip(samples, adv.tolist()):
        s.advantage = a
    return samples


def _pp_degree(layout: tuple[int, ...]) -> int:
    return layout[3] if len(layout) > 3 else 1


def job_config(model_name: str, layout: tuple[int, ...], extra: tuple[str, ...] = (), dtype: str = "float32"):
    from torchtitan.config import ConfigManager

    dp_replicate, dp_shard, tp = layout[:3]
    if dtype == "bfloat16":  # the table's bf16 mode: FSDP computes in bf16 (see _bf16_compute)
        mixed_precision = "bfloat16"
    else:
        # CPU: TorchTitan's bf16 default on purpose, parallelize must switch
        # FSDP to fp32 there (bf16 compute would miss TOL by orders of magnitude)
        mixed_precision = "float32" if torch.cuda.is_available() else "bfloat16"
    return ConfigManager().parse_args([
        "--model.name", "qwen3" if model_name.startswith("qwen3") else model_name,
        "--parallelism.data_parallel_replicate_degree", str(dp_replicate),
        "--parallelism.data_parallel_shard_degree", str(dp_shard),
        "--parallelism.tensor_parallel_degree", str(tp),
        "--parallelism.pipeline_parallel_degree", str(_pp_degree(layout)),
        "--training.seq_len", "64",
        "--training.max_norm", str(MAX_NORM),
        "--training.mixed_precision_param", mixed_precision,
        "--optimizer.name", "AdamW",
        "--optimizer.lr", "1e-2",
        "--optimizer.weight_decay", "0.1",
        # Adam's first step is lr * g / (|g| + eps): with the default eps=1e-8
        # a gradient entry of ~1e-8 (float noise level) moves its weight by
        # O(lr), whatever its last bits are. eps=1e-4 keeps the step
        # layout-independent to ~1e-6 and still scale-sensitive.
        "--optimizer.eps", "1e-4",
        "--optimizer.implementation", "for-loop",
        "--activation_checkpoint.mode", "none",
        *extra,
    ])


def step_job_config(model_name: str, layout_name: str, dtype: str = "float32"):
    """``job_config`` plus our ``[grpo]`` section, for ``trainer.build_policy``
    and ``trainer.train_step`` (the pipeline layouts and their reference)."""
    extra = [
        "--job.custom_config_module", "torchtitan_grpo.config.job_config",
        "--grpo.micro_batch_size", str(PP_MICRO_BATCH.get(layout_name, MICRO_BATCH)),
        "--grpo.is_correction", "none",  # the ratio against the rollout logprobs, as run_case
        "--lr_scheduler.warmup_steps", "1",  # the full lr at the first step, as run_case
    ]
    if layout_name in PP_SCHEDULES:
        extra += ["--parallelism.pipeline_parallel_schedule", PP_SCHEDULES[layout_name]]
    layout = LAYOUTS.get(layout_name, (1, 1, 1))
    return job_config(model_name, layout, tuple(extra), dtype)


# ------------------------------------------------------------- bf16 compute
#
# How TorchTitan 0.2.2 gets bf16 compute from training.mixed_precision_param
# depends on the layout: layouts with FSDP (FSDP, HSDP, FSDP x TP, PP x FSDP)
# through fully_shard's MixedPrecisionPolicy (bf16 copies of the parameters
# for forward and backward, gradients reduced and kept in fp32), DDP and a
# single device through torch.autocast (its train loop's maybe_enable_amp),
# TP or PP without FSDP not at all (fp32, with a warning). Our trainer calls
# no maybe_enable_amp, so outside FSDP it computes in fp32.
#
# A table that mixed those schemes would measure the schemes, not the
# layouts: autocast keeps norms, softmax and the residual stream in fp32
# where FSDP's bf16 parameters make them bf16, a difference of the size of
# the layouts' own bf16 noise. So in bf16 mode every layout without FSDP,
# and the single process, computes as FSDP's mixed precision does: each
# forward runs on bf16 copies of the fp32 parameters (a tied weight cast
# once, as FSDP unshards it once), whose gradients flow back into the fp32
# parameters' .grad (:func:`_cast_parameters_in_forward`). The master
# weights, the gradient reductions, clipping, AdamW and the loss (on
# ``logits.float()``) stay fp32 everywhere.


@contextlib.contextmanager
def _bf16_fsdp_kept(dtype: str, device: torch.device):
    """bf16 mode on CPU: keep FSDP's ``mixed_precision_param`` as configured.

    ``parallel.apply_layout`` turns it to fp32 on CPU (for the fp32 tests,
    and since bf16 is slow there); the bf16 table runs on CPU too (gloo) and
    needs FSDP in bf16 as on GPUs. A no-op in fp32 mode and on GPUs.
    """
    if dtype == "float32" or device.type != "cpu":
        yield
        return
    from torchtitan_grpo.distributed import parallel

    original = parallel._job_config_for

    def keep_param_dtype(job_config, parallel_dims, device):
        cfg = original(job_config, parallel_dims, device)
        cfg.training.mixed_precision_param = job_config.training.mixed_precision_param
        return cfg

    parallel._job_config_for = keep_param_dtype
    try:
        yield
    finally:
        parallel._job_config_for = original


def _cast_parameters_in_forward(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every forward of ``module`` runs on ``dtype`` copies of its parameters.

    A forward pre-hook puts a cast of each parameter in its modules' slots
    (one cast per parameter object, so a tied weight stays one tensor); the
    forward hook puts the parameters back. The casts are differentiable: the
    gradient reaches each parameter's AccumulateGrad as fp32, where DDP's
    reducer and TP's gradient hooks wait. The slots are replaced in place, so
    the parameters keep their order (clipping and pushes iterate it).
    Registered after the layout's own hooks: DDP's pre-hook, which collects
    the parameters on first use, runs before the swap.
    """
    slots = [(m, name) for m in module.modules() for name, p in m._parameters.items() if p is not None]
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []

    def cast(_module, _args):
        copies: dict[int, torch.Tensor] = {}
        for m, name in slots:
            p = m._parameters[name]
            if id(p) not in copies:
                copies[id(p)] = p.to(dtype)
            swapped.append((m, name, p))
            m._parameters[name] = copies[id(p)]

    def restore(_module, _args, _output):
        while swapped:
            m, name, p = swapped.pop()
            m._parameters[name] = p

    module.register_forward_pre_hook(cast)
    module.register_forward_hook(restore)


def _bf16_compute(module: torch.nn.Module, dtype: str, parallel_dims) -> None:
    """In bf16 mode, give a layout without FSDP FSDP's mixed-precision compute
    (section comment above); FSDP layouts have it from mixed_precision_param."""
    if dtype == "float32" or (parallel_dims is not None and parallel_dims.fsdp_enabled):
        return
    _cast_parameters_in_forward(module, getattr(torch, dtype))


# ------------------------------------------------------------ one GRPO step


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    t = t.full_tensor() if isinstance(t, DTensor) else t
    return t.detach().to("cpu", copy=True)


def run_case(model_dir: str, model_name: str, layout: tuple[int, int, int], world_size: int,
             dtype: str = "float32") -> dict:
    """Build, parallelise, run one GRPO step; full tensors of what matters.

    A collective under a layout: every rank calls it; all ranks return the
    same dict. ``dtype``: the compute dtype (the table's bf16 mode).
    """
    import torch.distributed as dist

    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan_grpo.models import hf_bridge as hf_model
    from torchtitan_grpo.distributed import parallel
    from torchtitan_grpo.train.loss import grpo_loss, token_logprobs
    from torchtitan_grpo.train.trainer import _pack

    device = _device()
    cfg = job_config(model_name, layout, dtype=dtype)
    name = cfg.model.name
    args = hf_model.model_args_from_hf(name, hf_model.load_hf_config(model_dir), max_seq_len=64)
    model = hf_model.build_model(name, args, device)
    adapter = hf_model.state_dict_adapter(name, args, model_dir)
    hf_model.load_hf_weights(model, adapter, model_dir)
    with _bf16_fsdp_kept(dtype, device):
        model, pdims = parallel.parallelize(model, cfg, world_size, device)
    _bf16_compute(model, dtype, pdims)
    model.train()
    optimizers = build_optimizers([model], cfg.optimizer, pdims)
    before = {n: _full(p) for n, p in model.named_parameters()}

    batch = fixed_batch()
    n_samples = len(batch)
    n_tokens = sum(len(s.completion_ids) for s in batch)
    dp_rank, dp_degree = parallel.data_parallel_rank_and_degree(pdims)
    local = batch[dp_rank::dp_degree]
    multiple = parallel.seq_len_multiple(pdims)

    n_micro = torch.tensor([max(1, -(-len(local) // MICRO_BATCH))], device=device)
    if world_size > 1:
        dist.all_reduce(n_micro, op=dist.ReduceOp.MAX)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for k in range(int(n_micro)):
        chunk = local[k * MICRO_BATCH : (k + 1) * MICRO_BATCH]
        tokens, mask, old, adv = _pack(chunk or local[:1], PAD, device)
        if not chunk:  # keeps the collectives in step, adds nothing
            mask = torch.zeros_like(mask)
        tokens, mask, old = parallel.pad_to_multiple(tokens, mask, old, multiple, PAD)
        logits = model(tokens)[:, :-1].float()
        logprobs = token_logprobs(logits, tokens[:, 1:])
        loss, _ = grpo_loss(logprobs, old, adv, mask, num_sequences=n_samples, num_tokens=n_tokens)
        loss.backward()
        loss_sum += loss.detach().double()
    group = parallel.data_parallel_group(pdims)
    if group is not None:
        dist.all_reduce(loss_sum, group=group)

    params = dict(model.named_parameters())
    grads = {n: _full(p.grad) for n, p in params.items()}
    norm = clip_grad_norm_([p for p in params.values() if p.grad is not None], MAX_NORM, foreach=True)
    norm = _full(norm)
    optimizers.step()
    optimizers.zero_grad()
    after = {n: _full(p) for n, p in params.items()}
    return {
        "loss": float(loss_sum),
        "grad_norm": float(norm),
        "grads": grads,
        "params": after,
        "moved": max_diff(before, after),
        "pushed": {k: v.to("cpu", copy=True) for k, v in hf_model.hf_state_dict(model, adapter).items()},
        "tied": parallel._is_tied(model),
    }


def _gathered(policy, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full tensors (parameters, or their gradients) of every stage, by FQN.

    A collective: within a stage ``full_tensor`` gathers FSDP/TP shards, then
    the stages' dicts are exchanged over the world. The last stage's copy of
    a tied embedding must equal the first stage's and is dropped (the single
    process names that parameter once).
    """
    local = {n: _full(p.grad if grads else p) for n, p in policy.model.named_parameters()
             if not grads or p.grad is not None}
    if policy.pipeline is None:
        return local
    merged = _over_stages(local)
    if policy.pipeline.tied:
        mirror = merged.pop("output.weight")
        assert torch.equal(mirror, merged["tok_embeddings.weight"]), "tied copies differ between stages"
    return merged


def _gathered_hf(policy) -> dict[str, torch.Tensor]:
    """What a weight push sends: each rank's ``hf_state_dict`` of its own
    module (under PP: its stage, whose FQNs the adapter maps as for the whole
    model), united over the stages. A collective."""
    from torchtitan_grpo.models import hf_bridge as hf_model

    pushed = hf_model.hf_state_dict(policy.model, policy.adapter)
    local = {k: v.detach().to("cpu", copy=True) for k, v in pushed.items()}
    return local if policy.pipeline is None else _over_stages(local)


def _over_stages(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's ``local`` dict united (under PP: all stages' tensors)."""
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def run_step_case(model_dir: str, model_name: str, layout_name: str, world_size: int,
                  dtype: str = "float32") -> dict:
    """``trainer.build_policy`` + one ``trainer.train_step`` on the fixed batch.

    The pipeline layouts, and (``layout_name="single"``, one process) their
    reference for the step metrics. Returns what ``run_case`` does plus every
    rank's metrics (``metrics``: a list indexed by rank). A collective.
    """
    import torch.distributed as dist

    from torchtitan_grpo.distributed import parallel
    from torchtitan_grpo.train import trainer

    device = _device()
    cfg = step_job_config(model_name, layout_name, dtype)
    rank = dist.get_rank() if world_size > 1 else 0
    d = trainer.Dist(rank, world_size, int(os.environ.get("LOCAL_RANK", "0")), device)
    with _bf16_fsdp_kept(dtype, device):
        policy = trainer.build_policy(cfg, model_dir, d)
    _bf16_compute(policy.model, dtype, policy.parallel_dims)  # under PP: this rank's stage
    before = _gathered(policy)

    batch = fixed_batch()
    n_tokens = sum(len(s.completion_ids) for s in batch)
    dp_rank, dp_degree = parallel.data_parallel_rank_and_degree(policy.parallel_dims)
    grads: dict[str, torch.Tensor] = {}
    clip = trainer._clip_grad_norm

    def snapshot_then_clip(p):  # the gradients as clipping sees them
        grads.update(_gathered(p, grads=True))
        return clip(p)

    trainer._clip_grad_norm = snapshot_then_clip
    try:
        metrics = trainer.train_step(policy, batch[dp_rank::dp_degree], cfg.grpo, 1.0, MAX_NEW_TOKENS,
                                     len(batch), n_tokens, PAD, d)
    finally:
        trainer._clip_grad_norm = clip
    after = _gathered(policy)
    every = [metrics]
    if world_size > 1:
        every = [None] * world_size
        dist.all_gather_object(every, metrics)
    tied = policy.pipeline.tied if policy.pipeline is not None else parallel._is_tied(policy.model)
    return {
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "grads": grads,
        "params": after,
        "moved": max_diff(before, after),
        "pushed": _gathered_hf(policy),
        "tied": tied,
        "metrics": every,
    }


def run_empty_rank_step(model_dir: str, model_name: str, layout_name: str, world_size: int) -> list[dict]:
    """One ``train_step`` on one sample, on DP rank 0: the other DP ranks have
    none and every rank steps padding-only micro-batches (a pipeline needs at
    least one per stage). Returns every rank's metrics."""
    import torch.distributed as dist

    from torchtitan_grpo.distributed import parallel
    from torchtitan_grpo.train import trainer

    cfg = step_job_config(model_name, layout_name)
    d = trainer.Dist(dist.get_rank(), world_size, int(os.environ.get("LOCAL_RANK", "0")), _device())
    policy = trainer.build_policy(cfg, model_dir, d)
    batch = fixed_batch()[:1]
    dp_rank, _ = parallel.data_parallel_rank_and_degree(policy.parallel_dims)
    local = batch if dp_rank == 0 else []
    metrics = trainer.train_step(policy, local, cfg.grpo, 1.0, MAX_NEW_TOKENS, len(batch),
                                 sum(len(s.completion_ids) for s in batch), PAD, d)
    every = [None] * world_size
    dist.all_gather_object(every, metrics)
    return every


def _exported_mismatches(policy, model_dir: str, out_dir: str, d) -> dict:
    """``export_hf`` of the policy against the stages' united HF tensors:
    rank 0 reports how many tensors the export holds (``n_export``) and the
    names missing, extra or unequal (``bad_export``). A collective."""
    from safetensors.torch import load_file

    from torchtitan_grpo.train.checkpoint import export_hf

    export_hf(policy, model_dir, out_dir, d)
    expected = _gathered_hf(policy)
    if not d.is_main:
        return {}
    got = load_file(os.path.join(out_dir, "model.safetensors"))
    bad = sorted((got.keys() ^ expected.keys()) | {k for k in got.keys() & expected.keys()
                                                     if not torch.equal(got[k], expected[k])})
    return {"n_export": len(got), "bad_export": bad}


def run_checkpoint_roundtrip(model_dir: str, model_name: str, layout_name: str, world_size: int,
                             dump: str) -> dict:
    """Save after one ``train_step`` through our ``Checkpointer`` (TorchTitan's
    CheckpointManager over ``policy.model_parts``), load into a fresh policy.
    Returns, for this rank's stage tensors and optimizer tensors, how many
    were saved (``n_*``) and the names of those that came back unequal
    (``bad_*``). A collective."""
    import torch.distributed as dist

    from torchtitan_grpo.distributed import parallel
    from torchtitan_grpo.train import trainer
    from torchtitan_grpo.train.checkpoint import Checkpointer

    cfg = step_job_config(model_name, layout_name)
    cfg.job.dump_folder, cfg.checkpoint.enable, cfg.checkpoint.interval = dump, True, 1
    d = trainer.Dist(dist.get_rank(), world_size, int(os.environ.get("LOCAL_RANK", "0")), _device())
    policy = trainer.build_policy(cfg, model_dir, d)
    ckpt = Checkpointer(cfg, policy, d)
    batch = fixed_batch()
    dp_rank, dp_degree = parallel.data_parallel_rank_and_degree(policy.parallel_dims)
    trainer.train_step(policy, batch[dp_rank::dp_degree], cfg.grpo, 1.0, MAX_NEW_TOKENS, len(batch),
                       sum(len(s.completion_ids) for s in batch), PAD, d)
    ckpt.save(1, weight_version=1)
    ckpt.close()
    exported = _exported_mismatches(policy, model_dir, os.path.join(dump, "hf"), d)

    def tensors(p) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        model = {k: _full(v) for k, v in p.model.state_dict().items()}
        optim = {k: _full(v) for k, v in p.optimizers.state_dict().items() if torch.is_tensor(v)}
        return model, optim

    saved = tensors(policy)
    fresh = trainer.build_policy(cfg, model_dir, d)
    ckpt = Checkpointer(cfg, fresh, d)
    resumed = ckpt.load()
    loaded = tensors(fresh)
    ckpt.close()
    out = {"step": resumed.step if resumed else None, **exported}
    for kind, a, b in zip(("model", "optim"), saved, loaded):
        out[f"n_{kind}"] = len(a)
        out[f"bad_{kind}"] = sorted(k for k in a if k not in b or not torch.equal(a[k], b[k]))
    return out


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for k in a:
        assert a[k].shape == b[k].shape, (k, a[k].shape, b[k].shape)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def compare(ref: dict, got: dict) -> dict[str, float]:
    return {
        "loss": abs(got["loss"] - ref["loss"]),
        "grad_norm": abs(got["grad_norm"] - ref["grad_norm"]),
        "grads": max_diff(ref["grads"], got["grads"]),
        "params": max_diff(ref["params"], got["params"]),
        "pushed": max_diff(ref["pushed"], got["pushed"]),
    }


# ---------------------------------------------------------------- workers


def _worker(out_dir: str, model_dirs: dict[str, str], layouts: list[str], dtype: str = "float32") -> None:
    """Under torchrun: every (model, layout) of this launch, results to out_dir.

    In bf16 mode (the table only) the checks that no table column reads (a
    rank without samples, the checkpoint round trip) are left out.
    """
    import torch.distributed as dist
    from datetime import timedelta

    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=300))
    try:
        run_layouts(out_dir, model_dirs, layouts, dtype)
        dist.barrier()  # leave together: a peer gone early can abort this rank at exit
    finally:
        dist.destroy_process_group()


def run_layouts(out_dir: str, model_dirs: dict[str, str], layouts: list[str], dtype: str = "float32") -> None:
    """:func:`_worker`'s cases in a process group already started (also run
    by tests/multirank.py, in one launch with test_gather's cases)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    for layout in layouts:
        for model_name in MODELS:
            t0 = time.perf_counter()
            if layout in PP_SCHEDULES:  # the trainer's own pipeline step
                result = run_step_case(model_dirs[model_name], model_name, layout, world, dtype)
            else:
                result = run_case(model_dirs[model_name], model_name, LAYOUTS[layout], world, dtype)
            result["seconds"] = time.perf_counter() - t0
            if rank == 0:
                torch.save(result, os.path.join(out_dir, f"{model_name}-{layout}.pt"))
        if dtype != "float32":
            continue
        if layout == EMPTY_RANK_LAYOUT:
            every = run_empty_rank_step(model_dirs["qwen3"], "qwen3", layout, world)
            if rank == 0:
                torch.save(every, os.path.join(out_dir, f"empty-rank-{layout}.pt"))
        if layout == CHECKPOINT_LAYOUT:
            dump = os.path.join(out_dir, f"dump-{layout}")
            result = run_checkpoint_roundtrip(model_dirs["qwen3_tied"], "qwen3_tied", layout, world, dump)
            every = [None] * world
            dist.all_gather_object(every, result)
            if rank == 0:
                torch.save(every, os.path.join(out_dir, f"checkpoint-{layout}.pt"))


def launch(nproc: int, out_dir: str, model_dirs: dict[str, str], timeout: float = 600,
           dtype: str = "float32") -> str:
    """torchrun ``nproc`` ranks over this file's worker; returns the log."""
    return run_torchrun(nproc, [os.path.abspath(__file__), "worker", "--out", out_dir,
                                "--layouts", ",".join(LAUNCHES[nproc]), "--dtype", dtype,
                                *[f"--model={k}={v}" for k, v in model_dirs.items()]], timeout)


def run_torchrun(nproc: int, script_args: list[str], timeout: float) -> str:
    """``torchrun --standalone`` with ``nproc`` ranks over ``script_args`` (the
    script and its flags), one OpenMP thread each; returns the log, raises
    with its tail on a non-zero exit."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *script_args]
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    # PYTHONFAULTHANDLER: a rank that dies on a signal (SIGSEGV in a C++
    # library) prints its Python stack, not only torchrun's exit code.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, TOKENIZERS_PARALLELISM="false",
               PYTHONFAULTHANDLER="1")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    log = r.stdout + r.stderr
    if r.returncode != 0:
        fault = log.find("Fatal Python error")  # a crashed rank's own stack, wherever the tail cuts
        head = f"{log[fault:fault + 4000]}\n[...]\n" if 0 <= fault < len(log) - 6000 else ""
        raise RuntimeError(f"torchrun x{nproc} failed (rc={r.returncode}):\n{head}{log[-6000:]}")
    return log


# ------------------------------------------------------------------ tests


def test_pad_to_multiple_only_appends_masked_positions():
    from torchtitan_grpo.distributed.parallel import pad_to_multiple
    from torchtitan_grpo.train.trainer import _pack

    tokens, mask, old, _ = _pack(fixed_batch()[:3], PAD, torch.device("cpu"))
    assert tokens.shape[1] % 2 == 1  # the fixture needs padding under TP=2
    t2, m2, o2 = pad_to_multiple(tokens, mask, old, 2, PAD)
    assert t2.shape[1] == tokens.shape[1] + 1 and m2.shape[1] == t2.shape[1] - 1
    assert torch.equal(t2[:, : tokens.shape[1]], tokens) and bool((t2[:, -1] == PAD).all())
    assert torch.equal(m2[:, : mask.shape[1]], mask) and float(m2[:, -1].abs().sum()) == 0.0
    assert torch.equal(o2[:, : old.shape[1]], old)
    assert pad_to_multiple(t2, m2, o2, 2, PAD)[0] is t2  # already a multiple: untouched


@pytest.mark.parametrize("key", ["expert_tensor_parallel_degree"])  # CP: test_context_parallel
def test_unsupported_parallelisms_are_rejected(key):
    from torchtitan_grpo.distributed.parallel import build_parallel_dims

    cfg = job_config("qwen3", (1, 1, 1))
    setattr(cfg.parallelism, key, 2)
    with pytest.raises(NotImplementedError, match=key):
        build_parallel_dims(cfg, 2, "cpu")


@pytest.mark.parametrize("setting, error, names", [
    ({"parallelism.pipeline_parallel_schedule": "Interleaved1F1B"}, ValueError,
     ["parallelism.pipeline_parallel_schedule"]),
    ({"parallelism.pipeline_parallel_schedule_csv": "schedule.csv"}, ValueError,
     ["parallelism.pipeline_parallel_schedule_csv"]),
    ({"grpo.kl_coef": 0.1}, NotImplementedError, ["grpo.kl_coef", "parallelism.pipeline_parallel_degree"]),
    ({"parallelism.data_parallel_replicate_degree": 2}, NotImplementedError,
     ["parallelism.data_parallel_replicate_degree", "parallelism.pipeline_parallel_degree"]),
    ({"parallelism.pipeline_parallel_layers_per_stage": 1}, ValueError,
     ["parallelism.pipeline_parallel_layers_per_stage"]),
    ({"parallelism.module_fqns_per_model_part": [["tok_embeddings", "layers.1"], ["layers.0", "norm", "output"]]},
     ValueError, ["parallelism.module_fqns_per_model_part"]),
])
def test_unsupported_pipeline_settings_are_rejected(setting, error, names):
    """PP settings the trainer cannot run fail at start-up naming their keys."""
    from torchtitan_grpo.distributed.pipeline import check_config, stage_module_names

    cfg = step_job_config("qwen3", "pp")
    for key, value in setting.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    with pytest.raises(error) as e:
        check_config(cfg, 2)  # what build_parallel_dims runs first
        stage_module_names(cfg, 2)  # checked when the stages are built
    for name in names:
        assert name in str(e.value), (name, str(e.value))


def test_build_parallel_dims_checks_pipeline_settings():
    from torchtitan_grpo.distributed.parallel import build_parallel_dims

    cfg = step_job_config("qwen3", "pp")
    cfg.parallelism.pipeline_parallel_schedule = "ZBVZeroBubble"
    with pytest.raises(ValueError, match="parallelism.pipeline_parallel_schedule"):
        build_parallel_dims(cfg, 2, "cpu")


def test_one_gpu_trains_in_the_configured_precision():
    """TorchTitan's rule: autocast to training.mixed_precision_param on one
    device or DDP on a GPU; FSDP does its own; TP / PP without FSDP, CPU and
    "float32" stay float32 (no autocast)."""
    from types import SimpleNamespace

    from torchtitan_grpo.distributed.parallel import build_parallel_dims, mixed_precision

    cfg = job_config("qwen3", (1, 1, 1))
    one = build_parallel_dims(cfg, 1, "cpu")
    assert not one.fsdp_enabled and not one.tp_enabled and not one.pp_enabled
    amp = mixed_precision(cfg, one, "cuda:0")
    assert isinstance(amp, torch.autocast) and amp.device == "cuda", amp
    assert amp.fast_dtype == torch.bfloat16 and cfg.training.mixed_precision_param == "bfloat16"
    ddp = SimpleNamespace(fsdp_enabled=False, tp_enabled=False, pp_enabled=False)
    assert isinstance(mixed_precision(cfg, ddp, "cuda:0"), torch.autocast)
    for dims in (SimpleNamespace(fsdp_enabled=True, tp_enabled=False, pp_enabled=False),
                 SimpleNamespace(fsdp_enabled=False, tp_enabled=True, pp_enabled=False),
                 SimpleNamespace(fsdp_enabled=False, tp_enabled=False, pp_enabled=True)):
        assert not isinstance(mixed_precision(cfg, dims, "cuda:0"), torch.autocast), dims
    assert not isinstance(mixed_precision(cfg, one, "cpu"), torch.autocast)
    cfg.training.mixed_precision_param = "float32"
    assert not isinstance(mixed_precision(cfg, one, "cuda:0"), torch.autocast)


def test_parallelize_refuses_pipeline_layouts():
    from torchtitan_grpo.distributed.parallel import parallelize

    with pytest.raises(ValueError, match="pipeline_parallel_degree"):
        parallelize(torch.nn.Linear(2, 2), job_config("qwen3", LAYOUTS["pp"]), 2, "cpu")


def test_stage_split_keeps_fqns(tmp_path):
    """Each stage holds its modules under the whole model's FQNs, and the
    stages together hold every parameter once (twice for a tied embedding:
    once per end of the pipeline)."""
    from torchtitan_grpo.models import hf_bridge as hf_model
    from torchtitan_grpo.distributed.pipeline import split_stage, stage_module_names

    model_dirs = write_models(str(tmp_path))
    for model_name in MODELS:
        cfg = step_job_config(model_name, "pp")
        args = hf_model.model_args_from_hf(cfg.model.name, hf_model.load_hf_config(model_dirs[model_name]), 64)
        whole = dict(hf_model.build_model(cfg.model.name, args, "cpu").named_parameters())
        names = stage_module_names(cfg, args.n_layers)
        assert names == [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
        seen = []
        for keep in names:
            stage = split_stage(hf_model.build_model(cfg.model.name, args, "cpu"), keep)
            params = dict(stage.named_parameters())
            assert all(any(n == k or n.startswith(k + ".") for k in keep) for n in params), sorted(params)
            seen += list(params)
        tied = model_name == "qwen3_tied"
        assert sorted(seen) == sorted(list(whole) + (["output.weight"] if tied else [])), model_name


def test_bucketed_seq_len():
    from torchtitan_grpo.distributed.pipeline import bucketed_seq_len

    assert bucketed_seq_len(5, 64) == 8  # buckets of 64 / 8
    assert bucketed_seq_len(8, 64) == 8 and bucketed_seq_len(9, 64) == 16
    assert bucketed_seq_len(9, 64, multiple=3) == 9  # bucket 9: a multiple of the TP degree
    assert bucketed_seq_len(63, 100) == 65  # 13-token buckets
    assert bucketed_seq_len(57, 60, multiple=4) == 60  # capped at seq_len (64 would not fit)...
    assert bucketed_seq_len(57, 60, multiple=7) == 70  # ...unless TP cannot split seq_len evenly
    assert bucketed_seq_len(100, 100) == 100


def test_cpu_sdpa_strategy_is_registered_once():
    from torch.distributed.tensor import DTensor
    from torchtitan_grpo.distributed.parallel import register_cpu_sdpa_sharding

    register_cpu_sdpa_sharding()
    assert register_cpu_sdpa_sharding() is False  # already there: left alone
    funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in funcs
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default in funcs


@pytest.fixture(scope="module")
def parity(multirank_launched):
    """Single-process references, and the results of both launches: those
    run once per session with test_gather's cases (tests/multirank.py: each
    rank's start-up is paid once for both files), the same cases that
    ``launch`` runs."""
    launched = multirank_launched
    model_dirs = launched.model_dirs
    refs = {m: run_case(model_dirs[m], m, (1, 1, 1), 1) for m in MODELS}
    ref_steps = {m: run_step_case(model_dirs[m], m, "single", 1) for m in MODELS}
    return refs, launched.parity, launched.failed("parity"), ref_steps


def _launched(parity, layout: str, name: str):
    _, out, errors, _ = parity
    nproc = next((n for n, names in LAUNCHES.items() if layout in names), None)
    if nproc is None:
        pytest.skip(f"{layout} needs more GPUs than this machine has")
    if nproc in errors:
        pytest.fail(errors[nproc])
    return torch.load(out / name, weights_only=False)


def _result(parity, model_name: str, layout: str) -> tuple[dict, dict]:
    return parity[0][model_name], _launched(parity, layout, f"{model_name}-{layout}.pt")


def test_reference_step_is_not_trivial(parity):
    """The comparisons below mean something: every model's batch has a grad
    norm above the clip threshold, gradients far above TOL, and the step
    moves the weights by far more than TOL."""
    for model_name, ref in parity[0].items():
        assert ref["grad_norm"] > MAX_NORM, model_name
        assert max(float(g.abs().max()) for g in ref["grads"].values()) > 1e3 * TOL, model_name
        assert ref["moved"] > 1e3 * TOL, model_name
        assert ref["tied"] == (model_name == "qwen3_tied")
        metrics = parity[3][model_name]["metrics"][0]
        assert 0 < metrics["clip_fraction"] < 1 and metrics["entropy"] > 1, (model_name, metrics)


@pytest.mark.parametrize("model_name", MODELS)
def test_trainer_step_matches_reference_step(parity, model_name):
    """``train_step`` in one process is the computation of ``run_case``: the
    reference of the pipeline layouts' metrics is the reference of the rest."""
    diffs = compare(parity[0][model_name], parity[3][model_name])
    assert max(diffs.values()) < TOL, diffs


_METRICS = ("loss", "grad_norm", "clip_fraction", "entropy", "trainer_vs_rollout_logprob_max_abs_diff")


@pytest.mark.parametrize("layout", list(PP_SCHEDULES))
@pytest.mark.parametrize("model_name", MODELS)
def test_pipeline_metrics_on_every_rank(parity, model_name, layout):
    """Every rank (rank 0 is on the first stage, the loss on the last) reports
    the single process's step metrics."""
    got = _launched(parity, layout, f"{model_name}-{layout}.pt")["metrics"]
    ref = parity[3][model_name]["metrics"][0]
    assert len(got) == math.prod(LAYOUTS[layout])
    for rank, metrics in enumerate(got):
        diffs = {k: abs(metrics[k] - ref[k]) for k in _METRICS}
        assert max(diffs.values()) < TOL * max(1.0, ref["grad_norm"]), (rank, diffs)


def test_pipeline_checkpoint_resumes_every_stage(parity):
    """TorchTitan's CheckpointManager over the stages (``policy.model_parts``):
    each rank saves and loads its own stage's tensors and optimizer state; the
    HF export holds every stage's weights."""
    every = _launched(parity, CHECKPOINT_LAYOUT, f"checkpoint-{CHECKPOINT_LAYOUT}.pt")
    for rank, result in enumerate(every):
        assert result["step"] == 1, (rank, result)
        assert result["n_model"] > 5 and result["n_optim"] > 5, (rank, result)
        assert not result["bad_model"] and not result["bad_optim"], (rank, result)
    # export_hf gathers every stage: embeddings, 2 layers x 11 tensors, final
    # norm (tied: no lm_head.weight), equal to the stages' own HF tensors
    assert every[0]["n_export"] == 1 + 2 * 11 + 1 and not every[0]["bad_export"], every[0]


def test_pipeline_rank_without_samples(parity):
    """A DP rank with no samples steps padding micro-batches in step with the
    others (no deadlock), and every rank reports the same finite metrics."""
    every = _launched(parity, EMPTY_RANK_LAYOUT, f"empty-rank-{EMPTY_RANK_LAYOUT}.pt")
    assert len(every) == math.prod(LAYOUTS[EMPTY_RANK_LAYOUT])
    for metrics in every:
        assert all(math.isfinite(metrics[k]) for k in _METRICS), metrics
        assert {k: metrics[k] for k in _METRICS} == {k: every[0][k] for k in _METRICS}
    assert every[0]["grad_norm"] > 0 and every[0]["loss"] != 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model_name", MODELS)
def test_layout_matches_single_process(parity, model_name, layout):
    ref, got = _result(parity, model_name, layout)
    diffs = compare(ref, got)
    assert diffs["loss"] < TOL, diffs
    assert diffs["grad_norm"] < TOL * max(1.0, ref["grad_norm"]), diffs
    assert diffs["grads"] < TOL, diffs
    assert diffs["params"] < TOL, diffs
    assert diffs["pushed"] < TOL, diffs
    assert got["tied"] == ref["tied"]  # TP/FSDP kept one shared weight


# ------------------------------------------------------------------ table


def _metric_diff(ref_step: dict, got: dict) -> str:
    """Largest difference of any rank's step metrics from the single process's."""
    if "metrics" not in got:
        return "-"
    ref = ref_step["metrics"][0]
    return f"{max(abs(m[k] - ref[k]) for m in got['metrics'] for k in _METRICS):.1e}"


def table(dtype: str = "float32") -> str:
    """The parity table (docs/PARITY.md), its first line naming the compute dtype."""
    import tempfile

    where = f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}, nccl" if torch.cuda.is_available() \
        else "cpu, gloo"
    master = "" if dtype == "float32" else "; master weights, gradients, clipping, AdamW and loss in float32"
    rows = [f"compute dtype: {dtype}{master} ({where}; every layout and the single process)", "",
            "| layout | model | ranks | loss | grad norm | max abs grad diff | "
            "max abs param diff after AdamW step | max abs pushed weight diff | "
            "max abs step-metric diff, every rank | s/case |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as root:
        model_dirs = write_models(os.path.join(root, "models"))
        refs, ref_steps = {}, {}
        for m in MODELS:
            t0 = time.perf_counter()
            refs[m] = run_case(model_dirs[m], m, (1, 1, 1), 1, dtype)
            seconds = time.perf_counter() - t0
            ref_steps[m] = run_step_case(model_dirs[m], m, "single", 1, dtype)
            r = refs[m]
            rows.append(f"| single | {m} | 1 | {r['loss']:.9f} | {r['grad_norm']:.7f} | - | - | - | - | "
                        f"{seconds:.2f} |")
        out = os.path.join(root, "results")
        os.makedirs(out)
        for nproc in LAUNCHES:
            launch(nproc, out, model_dirs, dtype=dtype)
            for layout in LAUNCHES[nproc]:
                for m in MODELS:
                    got = torch.load(os.path.join(out, f"{m}-{layout}.pt"), weights_only=False)
                    d = compare(refs[m], got)
                    name = f"{layout} {LAYOUTS[layout]} {PP_SCHEDULES.get(layout, '')}".rstrip()
                    rows.append(
                        f"| {name} | {m} | {nproc} | {got['loss']:.9f} | "
                        f"{got['grad_norm']:.7f} | {d['grads']:.1e} | {d['params']:.1e} | "
                        f"{d['pushed']:.1e} | {_metric_diff(ref_steps[m], got)} | {got['seconds']:.2f} |")
    return "\n".join(rows)


def _main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", nargs="?", default="table", choices=["table", "worker"])
    p.add_argument("--out")
    p.add_argument("--layouts", default="")
    p.add_argument("--model", action="append", default=[])
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="compute dtype of every layout and the single process (master weights stay fp32)")
    a = p.parse_args(argv)
    if a.mode == "worker":
        dirs = dict(m.split("=", 1) for m in a.model)
        _worker(a.out, dirs, [x for x in a.layouts.split(",") if x], a.dtype)
    else:
        print(table(a.dtype))


if __name__ == "__main__":
    _main(sys.argv[1:])
