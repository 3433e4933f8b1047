"""The trainer's side of the loop: distributed set-up, the policy model
(TorchTitan model + parallelisms + optimizer), and one GRPO optimizer step.

Kept free of HTTP and of the weight push so that ``grpo_train.py`` reads as
the algorithm and each piece can be tested on its own.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan_grpo import _titan  # noqa: F401
from torchtitan_grpo import loss as grpo_losses
from torchtitan_grpo import model as hf_model
from torchtitan_grpo import parallel
from torchtitan_grpo.rollout import offpolicy

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- distributed

@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_s: float = 600) -> Dist:
    """Join torchrun's default group (NCCL on GPUs, gloo on CPU); single
    process without torchrun works too."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if "MASTER_ADDR" in os.environ and not dist.is_initialized():
        from datetime import timedelta

        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return Dist(rank, world, local_rank, device)


def close_distributed() -> None:
    """Leave the default group together. A rank that tears gloo down while a
    peer is still busy (saving, exporting, pushing) can make that peer abort
    at exit ("terminate called without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def broadcast_object(obj, d: Dist):
    """Rank 0's ``obj`` on every rank (rollouts are produced on rank 0)."""
    if d.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=d.device if d.device.type == "cuda" else None)
    return box[0]


# --------------------------------------------------------------------- policy

@dataclass
class Policy:
    model: torch.nn.Module
    model_args: object
    adapter: object
    optimizers: object
    lr_schedulers: object
    parallel_dims: object
    max_norm: float
    reference: torch.nn.Module | None = None
    """Frozen initial weights for the KL penalty (only when grpo.kl_coef > 0)."""


def build_policy(job_config, hf_dir: str, d: Dist) -> Policy:
    """TorchTitan model initialised from an HF checkpoint, parallelised as the
    config says, with TorchTitan's optimizer and LR schedule."""
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers

    name = job_config.model.name
    hf_config = hf_model.load_hf_config(hf_dir)
    model_args = hf_model.model_args_from_hf(name, hf_config, max_seq_len=job_config.training.seq_len)
    dtype = torch.float32  # master weights; bf16 compute comes from FSDP mixed precision on GPUs
    model = hf_model.build_model(name, model_args, d.device, dtype)
    adapter = hf_model.state_dict_adapter(name, model_args, hf_dir)
    hf_model.load_hf_weights(model, adapter, hf_dir)

    # [parallelism] layout (FSDP / HSDP / DDP / TP); gradients are summed over
    # data-parallel ranks in every layout, see torchtitan_grpo.parallel.
    model, parallel_dims = parallel.parallelize(model, job_config, d.world_size, d.device)
    model.train()

    optimizers = build_optimizers([model], job_config.optimizer, parallel_dims)
    lr_schedulers = build_lr_schedulers(optimizers, job_config.lr_scheduler, job_config.training.steps)
    reference = offpolicy.build_reference(job_config, hf_dir, d) if job_config.grpo.kl_coef > 0 else None
    return Policy(model, model_args, adapter, optimizers, lr_schedulers, parallel_dims,
                  float(job_config.training.max_norm), reference)


def hf_weights(policy: Policy) -> dict[str, torch.Tensor]:
    """Full HF-named tensors of the current weights (a collective under FSDP/TP:
    every rank must call it)."""
    return hf_model.hf_state_dict(policy.model, policy.adapter)


# ------------------------------------------------------------------ one step

@dataclass
class Sample:
    """One completion with everything the loss needs (built on rank 0)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    rollout_logprobs: list[float]
    advantage: float
    reward: float
    finish_reason: str
    weight_versions: list[str]


def _pack(samples: list[Sample], pad_id: int, device: torch.device):
    """Right-padded tokens plus, at the positions that *predict* completion
    tokens, the mask, rollout logprobs and advantages."""
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    T = max(lengths)
    B = len(samples)
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T - 1)
    old = torch.zeros(B, T - 1)
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.completion_ids
        tokens[i, : len(seq)] = torch.tensor(seq)
        start = len(s.prompt_ids) - 1  # logits at position t predict token t+1
        n = len(s.completion_ids)
        mask[i, start : start + n] = 1.0
        old[i, start : start + n] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return tokens.to(device), mask.to(device), old.to(device), adv.to(device)


def train_step(policy: Policy, local: list[Sample], grpo_cfg, temperature: float, max_new_tokens: int,
               global_num_samples: int, global_num_tokens: int, pad_id: int, d: Dist) -> dict[str, float]:
    """Forward/backward over micro-batches of this rank's samples, then one
    optimizer step. Losses are normalised by global counts so gradients do not
    depend on how samples are split over ranks and micro-batches."""
    model = policy.model
    t0 = time.perf_counter()
    sums = {"loss": 0.0, "clip_fraction": 0.0, "lp_diff_max": 0.0, "entropy": 0.0, "tokens": 0.0}
    off_stats = offpolicy.OffPolicyStats(grpo_cfg.is_correction, policy.reference is not None)
    mbs = grpo_cfg.micro_batch_size
    # Ranks with fewer local samples still run the same number of forward/backward
    # passes (on an empty micro-batch), or FSDP's collectives would deadlock.
    n_micro = max(1, -(-len(local) // mbs))
    if d.world_size > 1:
        t = torch.tensor([n_micro], device=d.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        n_micro = int(t.item())
    for k in range(n_micro):
        chunk = local[k * mbs : (k + 1) * mbs]
        empty = not chunk
        if empty:  # a zero-weight pass keeps the collectives in step
            chunk = local[:1] or [Sample([pad_id, pad_id], [pad_id], [0.0], 0.0, 0.0, "length", [])]
        tokens, mask, old, adv = _pack(chunk, pad_id, d.device)
        if empty:
            mask = torch.zeros_like(mask)
        # sequence parallelism splits T evenly over TP ranks
        tokens, mask, old = parallel.pad_to_multiple(
            tokens, mask, old, parallel.seq_len_multiple(policy.parallel_dims), pad_id)
        logits = model(tokens)[:, :-1].float()
        logprobs = grpo_losses.token_logprobs(logits, tokens[:, 1:], temperature)
        ref = None
        if policy.reference is not None:
            ref = offpolicy.reference_logprobs(policy.reference, tokens, temperature)
        # "old" of the ratio and the IS weights: see grpo.is_correction
        ratio_old, is_w, is_m = offpolicy.importance_weights(logprobs, old, mask, grpo_cfg.is_correction,
                                                             grpo_cfg.is_cap)
        loss, m = grpo_losses.grpo_loss(
            logprobs, ratio_old, adv, mask, clip_low=grpo_cfg.clip_low, clip_high=grpo_cfg.clip_high,
            loss_agg=grpo_cfg.loss_agg, max_completion_len=max_new_tokens,
            num_sequences=global_num_samples, num_tokens=global_num_tokens,
            ref_logprobs=ref, kl_coef=grpo_cfg.kl_coef, kl_estimator=grpo_cfg.kl_estimator, is_weights=is_w)
        loss.backward()
        off_stats.add(mask, is_m, m)
        with torch.no_grad():
            ntok = float(mask.sum())
            sums["loss"] += float(loss)
            sums["clip_fraction"] += float(m["clip_fraction"]) * ntok
            sums["tokens"] += ntok
            if ntok:
                sums["lp_diff_max"] = max(sums["lp_diff_max"], float(((logprobs - old).abs() * mask).max()))
                sums["entropy"] += float(grpo_losses.entropy_from_logits(logits, mask, temperature=temperature)) * ntok
        del logits, logprobs, loss, ref

    grad_norm = _clip_grad_norm(policy)
    policy.optimizers.step()
    policy.lr_schedulers.step()
    policy.optimizers.zero_grad()

    stats = torch.tensor([sums["loss"], sums["clip_fraction"], sums["entropy"], sums["tokens"]], dtype=torch.float64)
    lp_max = torch.tensor([sums["lp_diff_max"]], dtype=torch.float64)
    if d.world_size > 1:
        stats, lp_max = stats.to(d.device), lp_max.to(d.device)
        # sums over data-parallel ranks only: TP ranks hold copies of the same numbers
        dp_group = parallel.data_parallel_group(policy.parallel_dims)
        if dp_group is not None:
            dist.all_reduce(stats, group=dp_group)
        dist.all_reduce(lp_max, op=dist.ReduceOp.MAX)
    off_metrics = off_stats.reduce(d.world_size, parallel.data_parallel_group(policy.parallel_dims), d.device)
    loss_sum, clip_sum, ent_sum, ntok = stats.tolist()
    return {
        "loss": loss_sum,  # local losses are already globally normalised: their sum is the batch loss
        "clip_fraction": clip_sum / max(ntok, 1.0),
        "entropy": ent_sum / max(ntok, 1.0),
        "grad_norm": grad_norm,
        "lr": policy.lr_schedulers.schedulers[0].get_last_lr()[0],
        "trainer_vs_rollout_logprob_max_abs_diff": float(lp_max.item()),
        "time/train_s": time.perf_counter() - t0,
    } | off_metrics


def _clip_grad_norm(policy: Policy) -> float:
    from torchtitan.distributed.utils import clip_grad_norm_

    params = [p for p in policy.model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = clip_grad_norm_(params, policy.max_norm, foreach=True,
                           pp_mesh=None, ep_enabled=False)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
