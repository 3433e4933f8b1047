"""What a mixture-of-experts model adds to the trainer's step.

* Router replay (``grpo.router_replay = "rollout"``): each micro-batch's
  forward *and* backward (activation checkpointing routes again in the
  recompute) run inside :func:`torchtitan_grpo.models.router_replay.replay` with the
  routes the servers reported, laid out like the model's input (padded
  samples, or a packed row at its samples' offsets).
* The router's auxiliary load-balancing loss (``moe.aux_loss_coef > 0``),
  weighted by the micro-batch's share of the step's trained tokens, so that
  summed over micro-batches and data-parallel ranks (the trainer sums
  gradients) it is the token-weighted mean over the step.
* Start-up checks naming the key, and TorchTitan's grouped expert GEMMs on
  GPUs that compute in bf16 anyway.
* The step's metric ``moe/replayed_tokens`` (:func:`step_metrics`): the
  positions the routers took from the rollout, summed over data-parallel
  ranks; the proof that routes reached the trainer (a run whose samples lost
  their routes would replay nothing, silently).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_grpo.models import qwen3_moe, router_replay


def configure(job_config, model_args, device: torch.device) -> None:
    """Refuse MoE options the model or layout cannot take (one line naming the
    key); pick the experts' GEMM path. Call before the model is built."""
    moe = bool(getattr(model_args, "moe_enabled", False))
    grpo, moe_cfg = job_config.grpo, job_config.moe
    if grpo.router_replay != "off" and not moe:
        raise ValueError(f'grpo.router_replay = "{grpo.router_replay}": the model has no MoE layer (a dense model '
                         "has no routes to replay)")
    if moe_cfg.aux_loss_coef < 0:
        raise ValueError(f"moe.aux_loss_coef must be >= 0, got {moe_cfg.aux_loss_coef}")
    if moe_cfg.aux_loss_coef > 0 and not moe:
        raise ValueError("moe.aux_loss_coef > 0: the model has no MoE layer")
    pipelined = job_config.parallelism.pipeline_parallel_degree > 1
    if moe and pipelined and (grpo.router_replay != "off" or moe_cfg.aux_loss_coef > 0):
        raise ValueError("grpo.router_replay / moe.aux_loss_coef with pipeline parallelism: not implemented "
                         "(the schedule would have to name each micro-batch to the routers)")
    if moe:
        # TorchTitan's grouped GEMMs compute in bf16: use them where the trainer does (a GPU with bf16 mixed
        # precision); elsewhere the exact per-expert loop
        bf16 = getattr(job_config.training, "mixed_precision_param", "bfloat16") == "bfloat16"
        model_args.moe_args.use_grouped_mm = device.type == "cuda" and bf16


def prepare(model: nn.Module, job_config) -> None:
    """After the build: the routers keep what the auxiliary loss needs."""
    if job_config.moe.aux_loss_coef > 0:
        qwen3_moe.enable_aux_loss(model)


_REPLAYED = "_grpo_replayed_tokens"
"""Attribute of the model counting the positions replayed since the last
:func:`step_metrics` (on the module: one count per policy, whatever wraps it)."""


@contextlib.contextmanager
def replayed(model: nn.Module, grpo_cfg, samples: Sequence, length: int,
             offsets: Sequence[int] | None = None) -> Iterator[None]:
    """Replay the samples' routes for the block (a no-op without
    ``grpo.router_replay = "rollout"`` or without routes). ``length``: the
    model input's positions per row; ``offsets``: each sample's start in one
    packed row (None: sample ``i`` in row ``i`` from position 0)."""
    routes = None
    if grpo_cfg.router_replay == "rollout":
        placements = None if offsets is None else [(0, off) for off in offsets]
        routes = router_replay.routes_tensor(samples, rows=1 if offsets is not None else 0, length=length,
                                             placements=placements)
        if routes is not None:  # positions with routes (-1 everywhere: routed normally)
            setattr(model, _REPLAYED, getattr(model, _REPLAYED, 0) + int((routes[..., 0, 0] >= 0).sum()))
    with router_replay.replay(model, routes):
        yield


def aux_term(model: nn.Module, coef: float, samples: Sequence, length: int, offsets: Sequence[int] | None,
             mask: torch.Tensor, num_tokens: int) -> torch.Tensor | float:
    """``coef * aux_loss * (this micro-batch's trained tokens / the step's)``
    for the forward just run (0.0 when the loss is off)."""
    if coef <= 0:
        return 0.0
    device = mask.device
    lengths = torch.tensor([len(s.prompt_ids) + len(s.completion_ids) for s in samples], device=device)
    t = torch.arange(length, device=device)
    if offsets is None:  # padded: row i holds sample i from position 0
        valid = t[None, :] < lengths[:, None]
        if valid.shape[0] < mask.shape[0]:
            valid = torch.cat([valid, valid.new_zeros(mask.shape[0] - valid.shape[0], length)])
    else:  # one packed row
        starts = torch.tensor(list(offsets), device=device)
        valid = ((t[None, :] >= starts[:, None]) & (t[None, :] < (starts + lengths)[:, None])).any(0, keepdim=True)
    share = mask.sum() / max(num_tokens, 1)
    return coef * qwen3_moe.aux_loss(model, valid) * share


def step_metrics(model: nn.Module, grpo_cfg, group: dist.ProcessGroup | None,
                 device: torch.device) -> dict[str, float]:
    """``{"moe/replayed_tokens": n}`` for the step just run (and the count
    reset): the input positions whose experts came from the rollout, summed
    over the data-parallel ``group`` (a collective there: every rank calls
    it). ``{}`` without ``grpo.router_replay = "rollout"``."""
    if grpo_cfg.router_replay != "rollout":
        return {}
    count = torch.tensor([getattr(model, _REPLAYED, 0)], dtype=torch.float64, device=device)
    setattr(model, _REPLAYED, 0)
    if group is not None:
        dist.all_reduce(count, group=group)
    return {"moe/replayed_tokens": float(count.item())}
