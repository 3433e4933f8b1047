"""The trainer's side of the loop: distributed set-up, the policy model
(TorchTitan model + parallelisms + optimizer), and one GRPO optimizer step.

Kept free of HTTP and of the weight push so that ``grpo_train.py`` reads as
the algorithm and each piece can be tested on its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from torchtitan_grpo import _titan  # noqa: F401
from torchtitan_grpo.lora import adapters as lora, sharded as lora_sharded
from torchtitan_grpo.train import policy as policy_model
from torchtitan_grpo.train import loss as grpo_losses
from torchtitan_grpo.models import hf_bridge as hf_model
from torchtitan_grpo.train import cp_step, moe_step, packing
from torchtitan_grpo.distributed import parallel
from torchtitan_grpo.distributed import pipeline as pipeline_parallel
from torchtitan_grpo.train import token_logprobs
from torchtitan_grpo.train import importance as offpolicy
from torchtitan_grpo.train.sample import Sample

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
    """This rank's module: the whole (parallelised) model, or under PP this
    rank's pipeline stage."""
    model_args: object
    adapter: object
    optimizers: object
    lr_schedulers: object
    parallel_dims: object
    max_norm: float
    reference: torch.nn.Module | None = None
    """Frozen initial weights for the KL penalty (only when grpo.kl_coef > 0)."""
    model_parts: list[torch.nn.Module] = field(default_factory=list)
    """This rank's modules, as TorchTitan's optimizer and checkpointer take
    them: ``[model]`` (one stage per PP rank)."""
    pipeline: pipeline_parallel.StagePipeline | None = None
    """This rank's stage and schedules under PP (pipeline_parallel_degree > 1)."""
    amp: contextlib.AbstractContextManager = field(default_factory=contextlib.nullcontext)
    """The forward's autocast (one GPU or DDP: ``training.mixed_precision_param``),
    see :func:`torchtitan_grpo.distributed.parallel.mixed_precision`."""
    aux_loss_coef: float = 0.0
    """MoE: weight of the router's load-balancing loss (``moe.aux_loss_coef``)."""

    def __post_init__(self):
        if not self.model_parts:
            self.model_parts = [self.model]


def build_policy(job_config, hf_dir: str, d: Dist) -> Policy:
    """TorchTitan model initialised from an HF checkpoint, parallelised as the
    config says, with TorchTitan's optimizer and LR schedule."""
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers

    name = job_config.model.name
    packing.check_layout(job_config)
    hf_config = hf_model.load_hf_config(hf_dir)
    model_args = hf_model.model_args_from_hf(name, hf_config, max_seq_len=parallel.rope_len(job_config))
    moe_step.configure(job_config, model_args, d.device)
    adapter = hf_model.state_dict_adapter(name, model_args, hf_dir)
    model, parallel_dims, pipe = policy_model.build(job_config, model_args, adapter, hf_dir, d, _PipelineLoss())
    moe_step.prepare(model, job_config)
    model.train()

    optimizers = build_optimizers([model], job_config.optimizer, parallel_dims)
    lr_schedulers = build_lr_schedulers(optimizers, job_config.lr_scheduler, job_config.training.steps)
    reference = offpolicy.build_reference(job_config, hf_dir, d) if job_config.grpo.kl_coef > 0 else None
    if _micro_batch_tokens(job_config.grpo):  # packed rows: document-masked attention in both models
        for m in (model, reference):
            if m is not None:
                packing.use_document_attention(m)
    return Policy(model, model_args, adapter, optimizers, lr_schedulers, parallel_dims,
                  float(job_config.training.max_norm), reference, [model], pipe,
                  parallel.mixed_precision(job_config, parallel_dims, d.device), job_config.moe.aux_loss_coef)


def hf_weights(policy: Policy) -> dict[str, torch.Tensor]:
    """Full HF-named tensors of the current weights (a collective under FSDP/TP:
    every rank must call it). With LoRA: the merged weights (base + scaled B A)."""
    if lora.has_lora(policy.model):
        if lora_sharded.is_sharded(policy.model):
            return lora_sharded.merged_hf_state(policy.model, policy.adapter)
        return lora.merged_hf_state(policy.model, policy.adapter)
    return hf_model.hf_state_dict(policy.model, policy.adapter)


# ------------------------------------------------------------------ one step

def _pack(samples: list[Sample], pad_id: int, device: torch.device, rows: int = 0, length: int = 0):
    """Right-padded tokens plus, at the positions that *predict* trained
    completion tokens, the mask, rollout logprobs and advantages.

    A sample's trained tokens are all of its completion, or those its
    ``loss_mask`` marks (the others get a zero mask and a zero rollout
    logprob: no loss, no gradient, no metric counts them).

    ``rows`` / ``length``: pad to at least that many rows (pad tokens, zero
    mask: they add nothing to the loss or its gradient) and tokens per row.
    """
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    T = max([*lengths, length, 2])
    B = max(len(samples), rows)
    # Rows are built as Python lists and become tensors in one call each: a
    # few tensor writes per sample cost more than the lists on a CPU step.
    tok_rows, mask_rows, old_rows = [], [], []
    for i, s in enumerate(samples):
        seq = [*s.prompt_ids, *s.completion_ids]
        start = len(s.prompt_ids) - 1  # logits at position t predict token t+1
        n = len(s.completion_ids)
        if start < 0:
            raise ValueError(f"sample {i} has no prompt token: the first completion token has nothing to predict it")
        if len(s.rollout_logprobs) != n:
            raise ValueError(f"sample {i}: {len(s.rollout_logprobs)} rollout logprobs for {n} completion tokens")
        if s.loss_mask is None:
            m, lp = [1.0] * n, [float(x) for x in s.rollout_logprobs]
        else:
            if len(s.loss_mask) != n:
                raise ValueError(f"sample {i}: loss_mask has {len(s.loss_mask)} entries for {n} completion tokens")
            m = [float(x) for x in s.loss_mask]
            # untrained positions may hold placeholders (Atropos sends 1.0): never let them reach the loss
            lp = [float(x) if k > 0 else 0.0 for x, k in zip(s.rollout_logprobs, m)]
        tail = [0.0] * (T - 1 - start - n)
        tok_rows.append(seq + [pad_id] * (T - len(seq)))
        mask_rows.append([0.0] * start + m + tail)
        old_rows.append([0.0] * start + lp + tail)
    for _ in range(B - len(samples)):
        tok_rows.append([pad_id] * T)
        mask_rows.append([0.0] * (T - 1))
        old_rows.append([0.0] * (T - 1))
    tokens = torch.tensor(tok_rows, dtype=torch.long)
    mask = torch.tensor(mask_rows, dtype=torch.float32)
    old = torch.tensor(old_rows, dtype=torch.float32)
    adv = torch.zeros(B)
    adv[: len(samples)] = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return tokens.to(device), mask.to(device), old.to(device), adv.to(device)


@dataclass
class _LossContext:
    """What every micro-batch's loss needs besides its own tensors (one per step)."""

    grpo_cfg: object
    temperature: float
    max_new_tokens: int
    num_samples: int
    """Samples of the whole step, all ranks: the loss normaliser."""
    num_tokens: int
    """Completion tokens of the whole step, all ranks: the loss normaliser."""


def _logits_terms(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor | float]:
    """The full-logits path: ``[B, T - 1]`` log-probs from ``[B, T - 1, V]`` float
    logits, and the masked mean entropy (0 when the mask is empty)."""
    logprobs = grpo_losses.token_logprobs(logits, targets, temperature)
    entropy = 0.0
    if mask.any():
        entropy = grpo_losses.entropy_from_logits(logits, mask, temperature=temperature)
    return logprobs, entropy


def _micro_batch_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, old: torch.Tensor,
                      adv: torch.Tensor, ctx: _LossContext, ref: torch.Tensor | None = None):
    """GRPO loss of one micro-batch from its ``[B, T - 1, V]`` float logits, and
    a record of what the step's metrics need from it (see :func:`_add_record`)."""
    logprobs, entropy = _logits_terms(logits, targets, mask, ctx.temperature)
    return _logprob_loss(logprobs, entropy, mask, old, adv, ctx, ref)


def _logprob_loss(logprobs: torch.Tensor, entropy: torch.Tensor | float, mask: torch.Tensor, old: torch.Tensor,
                  adv: torch.Tensor, ctx: _LossContext, ref: torch.Tensor | None = None):
    """:func:`_micro_batch_loss` from the ``[B, T - 1]`` float32 log-probs (with
    gradient) and the masked mean entropy (a metric)."""
    g = ctx.grpo_cfg
    # "old" of the ratio and the IS weights: see grpo.is_correction
    ratio_old, is_w, is_m = offpolicy.importance_weights(logprobs, old, mask, g.is_correction, g.is_cap)
    common = dict(ref_logprobs=ref, kl_coef=g.kl_coef, kl_estimator=g.kl_estimator, is_weights=is_w)
    if g.loss_agg == "gspo":  # sequence-level ratio and clip; normalised by the step's samples
        loss, m = grpo_losses.gspo_loss(logprobs, ratio_old, adv, mask, clip_low=g.gspo_clip_low,
                                        clip_high=g.gspo_clip_high, num_sequences=ctx.num_samples, **common)
    elif g.loss_agg == "cispo":  # clipped detached token weights; normalised by the step's tokens
        loss, m = grpo_losses.cispo_loss(logprobs, ratio_old, adv, mask, clip_low=g.cispo_clip_low,
                                         clip_high=g.cispo_clip_high, num_tokens=ctx.num_tokens, **common)
    else:
        loss, m = grpo_losses.grpo_loss(
            logprobs, ratio_old, adv, mask, clip_low=g.clip_low, clip_high=g.clip_high,
            loss_agg=g.loss_agg, max_completion_len=ctx.max_new_tokens,
            num_sequences=ctx.num_samples, num_tokens=ctx.num_tokens, **common)
    with torch.no_grad():
        ntok = float(mask.sum())
        # the clip fraction's units: tokens, or completions for GSPO (its clip is per completion)
        units = float(m["clip_units"]) if "clip_units" in m else ntok
        record = {"loss": float(loss), "clip_fraction": float(m["clip_fraction"]) * units, "clip_units": units,
                  "tokens": ntok,
                  "lp_diff_max": 0.0, "lp_diff_sum": 0.0, "k3_sum": 0.0, "extreme_05": 0.0, "extreme_10": 0.0,
                  "entropy": 0.0, "mask": mask,
                  "is_metrics": is_m, "loss_metrics": m}
        if ntok:
            diff = (logprobs - old) * mask  # log(pi_train / pi_rollout) on the rollout's tokens
            record["lp_diff_max"] = float(diff.abs().max())
            record["lp_diff_sum"] = float(diff.abs().sum())
            record["k3_sum"] = float(((diff.exp() - 1 - diff) * mask).sum())  # k3 estimate of KL(rollout || train)
            # "extreme" tokens (the router-replay paper's): probability ratio beyond e^0.5 / e^1 either way
            record["extreme_05"], record["extreme_10"] = float((diff.abs() > 0.5).sum()), float((diff.abs() > 1.0).sum())
            record["entropy"] = float(entropy) * ntok
    return loss, record


def _logprob_chunk_tokens(policy: Policy, grpo_cfg) -> int:
    """Tokens per chunk of the chunked log-prob head (:mod:`torchtitan_grpo.train.token_logprobs`),
    0 for the full-logits path. The head needs the whole output weight on each
    rank (one device, FSDP / HSDP, DDP): TP's output projection is vocab-sharded
    (its logits are all-gathered, no loss parallel) and PP runs the loss on the
    last stage's output inside the schedule, so both keep the full-logits path."""
    chunk = int(getattr(grpo_cfg, "logprob_chunk_tokens", 0))
    if policy.pipeline is not None or getattr(policy.parallel_dims, "tp_enabled", False):
        return 0
    return chunk


def _forward_terms(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor, temperature: float,
                   chunk_tokens: int, amp: contextlib.AbstractContextManager):
    """``(logprobs, masked mean entropy)`` of ``tokens[:, 1:]`` under ``model``:
    through the chunked head when ``chunk_tokens`` (the model's forward stops
    at log-probs, never ``[B, T, V]`` logits), else from full float logits."""
    if not chunk_tokens:
        with amp:
            logits = model(tokens)[:, :-1].float()
        return _logits_terms(logits, tokens[:, 1:], mask, temperature)
    with amp, token_logprobs.logprob_head(model.output, tokens[:, 1:], temperature, chunk_tokens,
                                          with_entropy=True) as head:
        logprobs = model(tokens)
    return logprobs, (head.entropy * mask).sum() / mask.sum().clamp(min=1.0)


@torch.no_grad()
def _reference_logprobs(reference: torch.nn.Module, tokens: torch.Tensor, temperature: float,
                        chunk_tokens: int, amp: contextlib.AbstractContextManager) -> torch.Tensor:
    """``[B, T - 1]`` log-probs of ``tokens[:, 1:]`` under the frozen reference (KL penalty)."""
    with amp:
        if not chunk_tokens:
            return offpolicy.reference_logprobs(reference, tokens, temperature)
        with token_logprobs.logprob_head(reference.output, tokens[:, 1:], temperature, chunk_tokens):
            return reference(tokens)


def _add_record(sums: dict[str, float], off_stats: offpolicy.OffPolicyStats, record: dict) -> None:
    """Add one micro-batch's record to the step's sums."""
    for key in ("loss", "clip_fraction", "entropy", "tokens", "lp_diff_sum", "k3_sum", "extreme_05", "extreme_10"):
        sums[key] = sums.get(key, 0.0) + record[key]  # callers' older sums lack the extreme counts
    sums["clip_units"] = sums.get("clip_units", 0.0) + record["clip_units"]  # callers' older sums lack it
    sums["lp_diff_max"] = max(sums["lp_diff_max"], record["lp_diff_max"])
    off_stats.add(record["mask"], record["is_metrics"], record["loss_metrics"])


def train_step(policy: Policy, local: list[Sample], grpo_cfg, temperature: float, max_new_tokens: int,
               global_num_samples: int, global_num_tokens: int, pad_id: int, d: Dist) -> dict[str, float]:
    """Forward/backward over micro-batches of this rank's samples, then one
    optimizer step. Losses are normalised by global counts so gradients do not
    depend on how samples are split over ranks and micro-batches.

    Under PP the micro-batches go through the pipeline schedule and the loss
    runs on the last stage (:func:`_pipeline_forward_backward`); the returned
    metrics are the same on every rank."""
    t0 = time.perf_counter()
    # CPU time of this thread and of the whole process over the step: what
    # the rest of the process (the push's and the rollouts' threads, torch's
    # intra-op workers) used meanwhile, and how long this thread was off the
    # CPU, waiting for the GIL or a core (on a GPU a sync may spin: on-CPU).
    cpu0, proc0 = time.thread_time(), time.process_time()
    ctx = _LossContext(grpo_cfg, temperature, max_new_tokens, global_num_samples, global_num_tokens)
    sums = {"loss": 0.0, "clip_fraction": 0.0, "clip_units": 0.0, "lp_diff_max": 0.0, "entropy": 0.0,
            "tokens": 0.0, "lp_diff_sum": 0.0, "k3_sum": 0.0, "extreme_05": 0.0, "extreme_10": 0.0}
    off_stats = offpolicy.OffPolicyStats(grpo_cfg.is_correction, policy.reference is not None)
    if policy.pipeline is None:
        _forward_backward(policy, local, ctx, pad_id, d, sums, off_stats)
    else:
        _pipeline_forward_backward(policy, local, ctx, pad_id, d, sums, off_stats)

    grad_norm = _clip_grad_norm(policy)
    policy.optimizers.step()
    policy.lr_schedulers.step()
    policy.optimizers.zero_grad()

    stats = torch.tensor([sums[k] for k in ("loss", "clip_fraction", "clip_units", "entropy", "tokens", "lp_diff_sum",
                                            "k3_sum", "extreme_05", "extreme_10")], dtype=torch.float64)
    lp_max = torch.tensor([sums["lp_diff_max"]], dtype=torch.float64)
    if d.world_size > 1:
        stats, lp_max = stats.to(d.device), lp_max.to(d.device)
        # sums over data-parallel ranks only: TP ranks (and, after the broadcast
        # from the last stage, PP ranks) hold copies of the same numbers
        dp_group = parallel.data_parallel_group(policy.parallel_dims)
        if dp_group is not None:
            dist.all_reduce(stats, group=dp_group)
        dist.all_reduce(lp_max, op=dist.ReduceOp.MAX)
    off_metrics = off_stats.reduce(d.world_size, parallel.data_parallel_group(policy.parallel_dims), d.device)
    loss_sum, clip_sum, clip_units, ent_sum, ntok, diff_sum, k3_sum, ext05, ext10 = stats.tolist()
    return {
        "loss": loss_sum,  # local losses are already globally normalised: their sum is the batch loss
        "clip_fraction": clip_sum / max(clip_units, 1.0),  # of tokens; of completions with grpo.loss_agg = "gspo"
        "entropy": ent_sum / max(ntok, 1.0),
        "grad_norm": grad_norm,
        "lr": policy.lr_schedulers.schedulers[0].get_last_lr()[0],
        "trainer_vs_rollout_logprob_max_abs_diff": float(lp_max.item()),
        "trainer_vs_rollout_logprob_mean_abs_diff": diff_sum / max(ntok, 1.0),
        "trainer_vs_rollout_k3": k3_sum / max(ntok, 1.0),
        "trainer_vs_rollout_extreme_frac_0.5": ext05 / max(ntok, 1.0),
        "trainer_vs_rollout_extreme_frac_1.0": ext10 / max(ntok, 1.0),
        "time/train_s": time.perf_counter() - t0,
        "cpu/train_thread_s": (cpu := time.thread_time() - cpu0),
        "cpu/other_threads_s": max(time.process_time() - proc0 - cpu, 0.0),
    } | off_metrics | moe_step.step_metrics(policy.model, grpo_cfg, parallel.data_parallel_group(policy.parallel_dims),
                                            d.device)


def _micro_batch_tokens(grpo_cfg) -> int:
    """grpo.micro_batch_tokens (0: padded micro-batches)."""
    return int(getattr(grpo_cfg, "micro_batch_tokens", 0))


def _micro_batches(local: list[Sample], grpo_cfg) -> list[list[Sample]]:
    """This rank's samples per micro-batch: ``micro_batch_size`` at a time, or
    with grpo.micro_batch_tokens the rows of :func:`torchtitan_grpo.train.packing.plan`."""
    budget = _micro_batch_tokens(grpo_cfg)
    if budget:
        rows = packing.plan([len(s.prompt_ids) + len(s.completion_ids) for s in local], budget)
        return [[local[i] for i in row] for row in rows]
    mbs = grpo_cfg.micro_batch_size
    return [local[k : k + mbs] for k in range(0, len(local), mbs)]


def _forward_backward(policy: Policy, local: list[Sample], ctx: _LossContext, pad_id: int, d: Dist,
                      sums: dict[str, float], off_stats: offpolicy.OffPolicyStats) -> None:
    """Micro-batched forward/backward through the whole model (no PP): padded
    ``[samples, longest]`` micro-batches, or packed ``[1, L]`` rows
    (grpo.micro_batch_tokens) whose outputs return to the same per-sample
    layout before the loss (:mod:`torchtitan_grpo.train.packing`)."""
    model = policy.model
    packed = _micro_batch_tokens(ctx.grpo_cfg) > 0
    row_multiple = packing.CUDA_ROW_MULTIPLE if d.device.type == "cuda" else 1
    chunk_tokens = _logprob_chunk_tokens(policy, ctx.grpo_cfg)
    forward, ref_forward = cp_step.forwards(policy.parallel_dims, _forward_terms, _reference_logprobs)
    micro = _micro_batches(local, ctx.grpo_cfg)
    # Ranks with fewer local samples still run the same number of forward/backward
    # passes (on an empty micro-batch), or FSDP's collectives would deadlock.
    n_micro = max(1, len(micro))
    if d.world_size > 1:
        t = torch.tensor([n_micro], device=d.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        n_micro = int(t.item())
    for k in range(n_micro):
        chunk = micro[k] if k < len(micro) else []
        empty = not chunk
        if empty:  # a zero-weight pass keeps the collectives in step
            chunk = local[:1] or [Sample([pad_id, pad_id], [pad_id], [0.0], 0.0, 0.0, "length", [])]
        # the loss's layout (rows = samples); with packing the model sees `row` instead
        tokens, mask, old, adv = _pack(chunk, pad_id, d.device)
        if empty:
            mask = torch.zeros_like(mask)
        ref, row, offsets = None, None, None
        if packed:
            row = packing.pack_row([[*s.prompt_ids, *s.completion_ids] for s in chunk], pad_id, d.device,
                                   row_multiple)
            offsets = row.offsets
        else:  # sequence parallelism splits T evenly over TP ranks, CP into 2 x cp chunks
            tokens, mask, old = parallel.pad_to_multiple(
                tokens, mask, old, parallel.seq_len_multiple(policy.parallel_dims), pad_id)
        length = (row.tokens if packed else tokens).shape[1]
        # MoE: the rollout's routes for the forward and the backward's recompute (grpo.router_replay)
        with moe_step.replayed(model, ctx.grpo_cfg, [] if empty else chunk, length, offsets):
            if packed:
                logprobs, entropy = packing.forward_terms(model, row, mask, ctx.temperature, chunk_tokens,
                                                          policy.amp)
                if policy.reference is not None:
                    ref = packing.reference_logprobs(policy.reference, row, ctx.temperature, chunk_tokens,
                                                     policy.amp)
            else:
                logprobs, entropy = forward(model, tokens, mask, ctx.temperature, chunk_tokens, policy.amp)
                if policy.reference is not None:
                    ref = ref_forward(policy.reference, tokens, ctx.temperature, chunk_tokens, policy.amp)
            loss, record = _logprob_loss(logprobs, entropy, mask, old, adv, ctx, ref)
            aux = moe_step.aux_term(model, policy.aux_loss_coef, chunk, length, offsets, mask, ctx.num_tokens)
            (loss + aux).backward()
        _add_record(sums, off_stats, record)
        del logprobs, loss, ref


# ------------------------------------------------------------ pipeline step
#
# Under PP the GRPO loss runs inside the schedule, on the last stage, once per
# micro-batch: the schedule calls ``loss_fn(stage_output, target_chunk)``. What
# the loss needs besides the logits travels in ``target``, one float64
# ``[rows, T - 1, 4]`` tensor that the schedule splits into micro-batches
# along rows like the tokens: per position, the next token id, the completion
# mask, the rollout logprob and the row's advantage (float64 holds token ids
# and float32 values exactly). The per-step constants (normalisers, clip
# range, IS mode, temperature) sit in the loss function's context.


def _pack_target(next_tokens: torch.Tensor, mask: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """``[B, T - 1, 4]`` float64: next token, mask, rollout logprob, advantage."""
    channels = (next_tokens, mask, old, adv.unsqueeze(-1).expand_as(mask))
    return torch.stack([c.to(torch.float64) for c in channels], dim=-1)


def _unpack_target(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_pack_target`: ``(next tokens, mask, rollout logprobs, advantages)``."""
    return (target[..., 0].long(), target[..., 1].float(), target[..., 2].float(), target[:, 0, 3].float())


class _PipelineLoss:
    """The pipeline schedule's ``loss_fn``: GRPO loss of one micro-batch on the last stage.

    Keeps one record per call. A schedule's first step may also call it
    once to infer gradient shapes (torch >= 2.13, on placeholder
    activations), before the real micro-batches: a step's records are the
    last ``n_microbatches`` ones.
    """

    def __init__(self) -> None:
        self.ctx: _LossContext | None = None
        self.records: list[dict] = []
        self.cp: tuple | None = None
        """CP: (parallel_dims, this rank's positions row) of the step."""

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        next_tokens, mask, old, adv = _unpack_target(target)
        # full logits: the chunked head does not run inside the pipeline schedule
        if self.cp is not None:  # logits at this rank's share of the positions: whole sequences gathered
            dims, positions = self.cp
            logprobs, entropy = cp_step.pipeline_terms(dims, output.float(), next_tokens, mask, positions,
                                                                self.ctx.temperature)
            loss, record = _logprob_loss(logprobs, entropy, mask, old, adv, self.ctx)
        else:
            loss, record = _micro_batch_loss(output[:, :-1].float(), next_tokens, mask, old, adv, self.ctx)
        self.records.append(record)
        return loss


def _pipeline_batch_shape(policy: Policy, local: list[Sample], ctx: _LossContext, d: Dist) -> tuple[int, int, int]:
    """``(micro-batches, rows per micro-batch, sequence length)`` of this step, the
    same on every rank (a new shape builds new schedules on all ranks at once,
    see :meth:`torchtitan_grpo.distributed.pipeline.StagePipeline.schedule_for`)."""
    longest = max((len(s.prompt_ids) + len(s.completion_ids) for s in local), default=2)
    t = torch.tensor([len(local), longest], device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    most, longest = (int(x) for x in t.tolist())
    # grpo.micro_batch_size bounds the rows; at least one micro-batch per
    # stage, so that the stages overlap (1F1B requires it; with fewer samples
    # some micro-batches are padding only)
    n_micro = max(-(-most // ctx.grpo_cfg.micro_batch_size), policy.pipeline.num_stages)
    rows = max(1, -(-most // n_micro))
    length = pipeline_parallel.bucketed_seq_len(longest, policy.model_args.max_seq_len,
                                                parallel.seq_len_multiple(policy.parallel_dims))
    return n_micro, rows, length


def _pipeline_forward_backward(policy: Policy, local: list[Sample], ctx: _LossContext, pad_id: int, d: Dist,
                               sums: dict[str, float], off_stats: offpolicy.OffPolicyStats) -> None:
    """Forward/backward of this rank's samples through the pipeline schedule.

    Every rank steps ``n_micro`` micro-batches of ``rows`` rows (missing rows
    are padding with a zero mask, so ranks with fewer samples, or none, keep
    the collectives in step); the last stage's metrics are broadcast over the
    pipeline, so every rank returns them.
    """
    pipe = policy.pipeline
    n_micro, rows, length = _pipeline_batch_shape(policy, local, ctx, d)
    tokens, mask, old, adv = _pack(local, pad_id, d.device, rows=n_micro * rows, length=length)
    target = _pack_target(tokens[:, 1:], mask, old, adv)
    loss_fn = pipe.loss_fn
    loss_fn.ctx, loss_fn.records, loss_fn.cp, positions = ctx, [], None, None
    if policy.parallel_dims.cp_enabled:  # the first stage gets this CP rank's share of the tokens
        tokens, positions = cp_step.pipeline_tokens(policy.parallel_dims, tokens)
        loss_fn.cp = (policy.parallel_dims, positions)
    pipe.step(tokens, target, n_micro, positions)
    if pipe.is_last:
        records = loss_fn.records[-n_micro:]
        if len(records) != n_micro:
            raise RuntimeError(f"pipeline loss ran {len(loss_fn.records)} times for {n_micro} micro-batches")
        for record in records:
            _add_record(sums, off_stats, record)
    loss_fn.records = []
    pipe.sync_tied_gradients()
    _share_last_stage_metrics(pipe, sums, off_stats)


def _share_last_stage_metrics(pipe: pipeline_parallel.StagePipeline, sums: dict[str, float],
                              off_stats: offpolicy.OffPolicyStats) -> None:
    """Replace every stage's sums by the last stage's (the only one with a loss)."""
    keys = ("loss", "clip_fraction", "clip_units", "entropy", "tokens", "lp_diff_max", "lp_diff_sum", "k3_sum",
            "extreme_05", "extreme_10")
    n_off = off_stats.sums.numel()
    values = torch.tensor([sums[k] for k in keys] + off_stats.sums.tolist() + [off_stats.is_max],
                          dtype=torch.float64, device=pipe.device)
    values = pipe.broadcast_from_last_stage(values).cpu()
    sums.update(zip(keys, values[: len(keys)].tolist()))
    off_stats.sums = values[len(keys) : len(keys) + n_off].clone()
    off_stats.is_max = float(values[-1])


def _clip_grad_norm(policy: Policy) -> float:
    """Clip by the norm of the whole model's gradient; returns that norm.

    Under PP TorchTitan's ``clip_grad_norm_`` sums the stages' squared norms
    over the pipeline mesh; a tied weight's second copy (last stage) is
    clipped by that norm but not counted in it.
    """
    from torchtitan.distributed.utils import clip_grad_norm_

    params = [p for part in policy.model_parts for p in part.parameters() if p.grad is not None]
    pipe = policy.pipeline
    if pipe is None:
        if not params:
            return 0.0
        norm = clip_grad_norm_(params, policy.max_norm, foreach=True, pp_mesh=None,
                               ep_enabled=bool(getattr(policy.parallel_dims, "ep_enabled", False)))
    else:  # every stage joins the all-reduce over the pipeline
        counted, mirrors = pipe.split_mirrored(params)
        norm = clip_grad_norm_(counted, policy.max_norm, foreach=True, pp_mesh=pipe.pp_mesh, ep_enabled=False)
        if mirrors:
            torch.nn.utils.clip_grads_with_norm_(mirrors, policy.max_norm, norm, foreach=True)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
