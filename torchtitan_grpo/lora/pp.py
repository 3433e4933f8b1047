"""LoRA under pipeline parallelism (PP): adapters on each stage, merged and
pushed over the stages.

One process adapts the loaded model (:mod:`torchtitan_grpo.lora.adapters`), data
parallelism puts the adapters on the meta model before ``fully_shard``
(:mod:`torchtitan_grpo.lora.sharded`). Under PP each rank keeps one stage
of the model (:mod:`torchtitan_grpo.distributed.pipeline`), so in ``trainer.build_policy``:

* **Untied models** (built on meta, cut, laid out, then loaded):
  :func:`inject` puts the adapters on the *whole* meta model before the
  split and returns the whole model's adapter order; the split keeps each
  stage's ``LoRALinear`` modules with their ``A`` / ``B``, the stage's layout
  (FSDP over the non-PP dims) wraps them with their blocks, and
  :func:`lora_sharded.load_and_init` loads the stage's base (adapters hidden from the
  strict loader) and draws every ``A`` of the whole model in module order
  from a generator seeded with ``grpo.seed``, each stage keeping its own.
  So a PP run gets exactly the ``A`` a one-process run seeded alike gets.
* **Tied models** (loaded whole, then cut): :func:`adapt_whole` adapts and
  seeds the whole loaded model before the split. The tied embedding is
  frozen, so there is no gradient for the first and last stage to exchange
  (the trainer then marks the pipeline untied: the copies stay equal
  because neither is ever updated).

Training needs nothing else: the optimizer of each stage holds its adapters,
the grad norm is summed over the pipeline as for full weights, DCP saves each
stage's base and adapters under their usual names.

The merged weights and the adapters are per stage (each rank merges its own
``W + scale B A``, gathering FSDP shards within the stage when there are
any); :class:`PipelineLoraPush` brings the stages' HF-named (merged) or
peft-named (adapter) tensors to rank 0, point to point, as the full-weight
``ShardGatherer`` brings stages' weights (:mod:`distributed.stage_transfer`:
each tensor rank 0 lacks comes from the lowest rank that has it; planned
once), and rank 0's Pusher sends them.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_grpo.lora import adapters as lora, sharded as lora_sharded
from torchtitan_grpo.lora.sharded import ShardedLoraPush
from torchtitan_grpo.distributed import stage_transfer

__all__ = ["inject", "adapt_whole", "PipelineLoraPush"]

logger = logging.getLogger(__name__)


def inject(model: nn.Module, cfg) -> list[tuple[str, torch.Size]]:
    """Adapters on the whole meta ``model`` before the pipeline split; returns
    the whole model's :func:`lora_sharded.adapter_order` (for :func:`lora_sharded.load_and_init`)."""
    lora_sharded.inject(model, cfg)
    return lora_sharded.adapter_order(model)


def adapt_whole(model: nn.Module, cfg, seed: int) -> None:
    """Tied models: adapters on the whole loaded ``model`` before the split,
    ``A`` seeded as every other layout draws it."""
    lora.apply_lora(model, cfg)
    lora_sharded.init_adapters(model, seed)


# ------------------------------------------------------------------- push


class PipelineLoraPush(ShardedLoraPush):
    """The weight push of a LoRA policy under PP (``trainer_push``'s object):
    every rank computes its stage's merged (or adapter) tensors, as
    :class:`ShardedLoraPush` does for the whole model (FSDP shards gathered
    within the stage), the other stages send theirs to rank 0, and rank 0's
    Pusher sends the whole model's. On the trainer's thread and groups, not
    overlapped with the next step."""

    def __init__(self, model_parts: list[nn.Module], adapter, pusher, sync: bool, adapter_only: bool = False,
                 device: torch.device | None = None):
        super().__init__(model_parts, adapter, pusher, sync, adapter_only)
        if device is None:  # gloo sends CPU tensors, NCCL this rank's GPU's
            cuda = dist.get_backend() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.device = device
        self._plan: list[stage_transfer.Transfer] | None = None
        self._keys: list[str] | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        local = super().tensors()
        keys = list(local)
        if self._plan is None:
            entries = [([k], tuple(v.shape), v.dtype) for k, v in local.items()]
            self._plan, self._keys = stage_transfer.plan_to_rank0(entries), keys
        elif keys != self._keys:
            raise RuntimeError("PipelineLoraPush: this stage's tensor names changed since the first push")
        # rank 0: every stage's tensors; the others: their own, after sending their part
        out = dict(local)
        stage_transfer.exchange_to_rank0(self._plan, out, self.device,
                                         prepare=lambda t: t.detach().to(self.device).contiguous())
        return out
