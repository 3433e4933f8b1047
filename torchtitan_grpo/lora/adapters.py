"""Low-rank adapters (LoRA) on TorchTitan's projections, and the merged weights.

``apply_lora(model, cfg)`` swaps each targeted ``nn.Linear`` (attention
``wq/wk/wv/wo``, feed-forward ``w1/w2/w3``) for a :class:`LoRALinear` that
keeps the very same ``weight`` Parameter and adds ``lora_A`` ``[r, in]``
(Kaiming-uniform, as ``nn.Linear`` initialises a weight) and ``lora_B``
``[out, r]`` (zeros: at step 0 the model is exactly the base). Its output is
``W x + (alpha / r) * B A dropout(x)``. Every other parameter is frozen
(``requires_grad = False``), so TorchTitan's optimizer, which only takes
parameters that require grad, holds (and keeps Adam state for) ``A`` and
``B`` alone, and gradient clipping sees only them.

State-dict names: the base weight keeps its name (``layers.0.attention.wq.weight``),
the adapters add ``...wq.lora_A`` and ``...wq.lora_B``. DCP checkpoints hold
both (resume restores the adapters and their optimizer state); the HF side
never sees the adapter keys: :func:`merged_state` gives the TorchTitan-named
weights with every adapted weight replaced by ``W + (alpha / r) B A`` (a new
tensor: ``W`` is never modified), and the train spec's state-dict adapter
names (and, for llama3 wq/wk, permutes) those exactly as it does today. The
push and the HF export send that.

Why our own module and not peft's ``inject_adapter_in_model``: peft finds
its targets by HF module names (``q_proj``) and wraps layers in its own
classes whose state-dict keys carry an adapter name (``lora_A.default.weight``)
and a ``base_layer`` level, which would rename the base weight that
TorchTitan's state-dict adapter, DCP checkpoints and the push's name mapping
key on; its layers are written for HF models on plain tensors, not for
TorchTitan's modules under FSDP2/DTensor (``fully_shard`` must see the
adapters as parameters of the block it wraps, and a merge of DTensor shards
is ours to define). A forty-line ``nn.Linear`` subclass keeps the base names,
is a plain parameter holder for FSDP2, and is exported to peft's format
separately (:mod:`torchtitan_grpo.lora.peft`).

Several trainer ranks (FSDP2, HSDP, DDP) put the same adapters on the meta
model before it is sharded and gather them for the merge:
:mod:`torchtitan_grpo.lora.sharded`; pipeline stages: :mod:`torchtitan_grpo.lora.pp`; tensor parallelism:
:mod:`torchtitan_grpo.lora.tp`. ``[lora] base_dtype = "bfloat16"``
stores the adapted projections' frozen weights in bf16 (the adapters stay
float32): the forward computes with the weight cast to the input's dtype,
and the merge is done in the adapters' dtype.
"""

from __future__ import annotations

import logging
import math
import re

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_grpo.config.lora import LORA_TARGETS

__all__ = ["LoRALinear", "apply_lora", "adapted_modules", "has_lora", "merge", "merged_state", "merged_hf_state",
           "check_layout", "whole_adapter"]

# the parent module of each target: attention.wq ... feed_forward.w3 (MoE experts are not nn.Linear)
_PARENT = {"wq": "attention", "wk": "attention", "wv": "attention", "wo": "attention",
           "w1": "feed_forward", "w2": "feed_forward", "w3": "feed_forward"}
# wrappers TorchTitan may put around a block (activation checkpointing, torch.compile)
logger = logging.getLogger(__name__)

_WRAPPERS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod)(?=\.|$)")


class LoRALinear(nn.Linear):
    """``nn.Linear`` on a frozen ``weight`` plus ``scale * B A`` on a dropped-out input.

    Built from an existing ``nn.Linear``: its ``weight`` (and ``bias``, if any)
    Parameters are taken over as they are, so nothing that refers to them
    (tied weights, TorchTitan's ``init_weights``) changes."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a new weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.rank, self.alpha = rank, float(alpha)
        self.scale = self.alpha / rank
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, device=w.device, dtype=w.dtype))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_adapter()

    @torch.no_grad()
    def reset_adapter(self) -> None:
        """A as ``nn.Linear`` initialises a weight of its shape, B zero: the
        adapter adds nothing until B is trained."""
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype != x.dtype:  # a bf16 frozen base under float32 compute (lora.base_dtype)
            w = w.to(x.dtype)
        base = F.linear(x, w, self.bias)
        return base + self.scale * F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """``W + scale * B A`` as a new tensor (the live weight is untouched)."""
        return merge(self.weight, self.lora_A, self.lora_B, self.scale)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha:g}"


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale * B A`` in the adapters' dtype, as a new tensor (whole, unsharded tensors)."""
    return torch.addmm(weight.detach().to(a.dtype), b.detach(), a.detach(), alpha=scale)


# [parallelism] degrees LoRA does not handle; data parallelism (FSDP2, HSDP, DDP), TP and PP are supported
_REFUSED = ("context_parallel_degree", "expert_parallel_degree")


def check_layout(parallelism) -> None:
    """Refuse the layouts LoRA does not handle (one line naming lora.enable and the key):
    one process, FSDP2, HSDP, DDP, TP (also with FSDP2) and PP are fine; CP, EP and
    PP x TP are not (docs/LORA.md)."""
    for key in _REFUSED:
        degree = getattr(parallelism, key, 1)
        if degree != 1:
            raise ValueError(f"lora.enable = true is not supported with parallelism.{key} = {degree}: LoRA runs on "
                             "one process, data-parallel layouts (FSDP2, HSDP, DDP), tensor and pipeline "
                             "parallelism only (see docs/LORA.md)")
    tp, pp = getattr(parallelism, "tensor_parallel_degree", 1), getattr(parallelism, "pipeline_parallel_degree", 1)
    if tp != 1 and pp != 1:
        raise ValueError(f"lora.enable = true is not supported with parallelism.tensor_parallel_degree = {tp} "
                         f"and pipeline_parallel_degree = {pp} together: use one of them (see docs/LORA.md)")


def _targets(model: nn.Module, target_modules: list[str]) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """``(fqn, parent, attribute, linear)`` of every projection to adapt."""
    wanted = {(_PARENT[t], t) for t in target_modules}
    out = []
    for fqn, parent in model.named_modules():
        kind = fqn.rsplit(".", 1)[-1]
        for attr, child in parent.named_children():  # module order
            if (kind, attr) in wanted and type(child) is nn.Linear:  # exactly nn.Linear: never an adapter twice
                out.append((f"{fqn}.{attr}", parent, attr, child))
    return out


def apply_lora(model: nn.Module, cfg) -> list[str]:
    """Put adapters on ``cfg.target_modules`` of every layer of ``model`` (a
    whole, loaded model on one device), freeze everything else, and return the
    adapted modules' names. Call before the optimizer is built.

    Also on a model on meta, before it is sharded (:mod:`torchtitan_grpo.lora.sharded`,
    which then initialises the adapters itself once the tensors are allocated).
    ``cfg.base_dtype`` (default float32) is the adapted weights' dtype."""
    unknown = [t for t in cfg.target_modules if t not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"lora.target_modules: unknown {unknown} (the TorchTitan projections are {list(LORA_TARGETS)})")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("lora.enable: the model is already sharded (DTensor parameters): put the adapters on the "
                         "meta model before fully_shard (torchtitan_grpo.lora.sharded)")
    targets = _targets(model, list(cfg.target_modules))
    if not targets:
        raise ValueError(f"lora.target_modules = {list(cfg.target_modules)}: no such nn.Linear in the model")
    for p in model.parameters():
        p.requires_grad_(False)
    base_dtype = getattr(torch, getattr(cfg, "base_dtype", "float32"))
    for _, parent, attr, linear in targets:
        adapted = LoRALinear(linear, cfg.rank, cfg.alpha, cfg.dropout)
        if linear.weight.dtype != base_dtype:  # lora.base_dtype: the frozen weight only, A and B keep theirs
            adapted.weight = nn.Parameter(linear.weight.detach().to(base_dtype), requires_grad=False)
        setattr(parent, attr, adapted)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info("LoRA: %d adapters (rank %d, alpha %g) on %s; %d of %d parameters trained (%.2f%%)",
                len(targets), cfg.rank, cfg.alpha, ",".join(cfg.target_modules), trained, total, 100 * trained / total)
    return [fqn for fqn, *_ in targets]


def adapted_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """``{fqn: LoRALinear}`` in module order, with the names the state dict
    uses (TorchTitan's wrapper levels removed)."""
    return {_WRAPPERS.sub("", fqn).lstrip("."): m for fqn, m in model.named_modules() if isinstance(m, LoRALinear)}


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def merged_state(model: nn.Module, gather=None) -> dict[str, torch.Tensor]:
    """The model's state dict, TorchTitan-named, as the base model would have
    it: every adapted weight is ``W + scale * B A`` (a new tensor), the adapter
    keys are left out, everything else is the live tensor, detached (not
    copied). Feed it to the state-dict adapter's ``to_hf`` for HF names.

    ``gather`` turns a (sharded) parameter into its whole tensor before use
    (:mod:`torchtitan_grpo.lora.sharded`; a collective there); None: the
    parameters are whole already (one process)."""
    by_weight = {id(m.weight): m for m in model.modules() if isinstance(m, LoRALinear)}
    adapter_ids = {id(p) for m in by_weight.values() for p in (m.lora_A, m.lora_B)}
    merged: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in adapter_ids:
            continue
        m = by_weight.get(id(t))
        if m is None:
            out[name] = (t if gather is None else gather(t)).detach()
        else:
            if id(t) not in merged:
                merged[id(t)] = (m.merged_weight() if gather is None else
                                 merge(gather(t), gather(m.lora_A), gather(m.lora_B), m.scale))
            out[name] = merged[id(t)]
    return out


def merged_hf_state(model: nn.Module, adapter) -> dict[str, torch.Tensor]:
    """HF-named merged weights: what the push and the HF export send with LoRA on."""
    return adapter.to_hf(merged_state(model))


def _stamp(m: LoRALinear) -> tuple[int, int]:
    """Version counters of ``A`` / ``B``'s local tensors: any in-place update
    (optimizer step, checkpoint load) changes them."""
    def local(p):
        return p._local_tensor if isinstance(p, DTensor) else p
    return local(m.lora_A)._version, local(m.lora_B)._version


def whole_adapter(m: LoRALinear) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` of ``m`` whole: the parameters themselves when not sharded,
    else the copy the last gather on this rank left, if still current."""
    if not isinstance(m.lora_A, DTensor):
        return m.lora_A.detach(), m.lora_B.detach()
    kept = getattr(m, "_grpo_whole_adapter", None)
    if kept is None or kept[0] != _stamp(m):
        raise RuntimeError("LoRA adapters are sharded and not gathered since their last update: call "
                           "lora_sharded.gather_adapters (or merged_hf_state) on every rank first")
    return kept[1], kept[2]
