"""LoRA under tensor parallelism: adapter placements that follow the base weight's.

TorchTitan's TP plan gives each projection torch's ``ColwiseParallel`` or
``RowwiseParallel``. Neither knows a :class:`~torchtitan_grpo.lora.adapters.LoRALinear`:
colwise shards *every* parameter of the module on dim 0 (``A`` ``[r, in]``
would be cut along the rank), rowwise calls its weight partitioner on every
submodule (it fails on the adapter's dropout) and leaves ``A`` / ``B`` plain
tensors. Here the same styles get a LoRA-aware partitioner:

* column-parallel (``wq wk wv w1 w3``; ``W`` ``Shard(0)``): ``A`` ``Replicate()``,
  ``B`` ``Shard(0)``: ``B (A x)`` comes out sharded on the output features
  like ``W x``;
* row-parallel (``wo w2``; ``W`` ``Shard(1)``): ``A`` ``Shard(1)``, ``B``
  ``Replicate()``: ``A x`` is a ``Partial`` sum and so is ``B (A x)``, added
  to the base's ``Partial`` output and reduced with it by the style's output
  redistribution.

torch's ``SequenceParallel`` (the norms) re-registers its parameters as
trainable; the frozen base is frozen again right after each plan is applied
(before FSDP wraps it).

The forward is :class:`LoRALinear`'s own, on DTensors: DTensor's propagation
does every redistribution. A replicated adapter's gradient comes back
``Partial(sum)``; ``parallel.apply_layout`` already reduces every trained
DTensor's gradient to its parameter's placements (the hook it registers for
TP-replicated norms), so clipping and AdamW see whole gradients. The styles'
input / output layouts are TorchTitan's, untouched.

:func:`lora_plan` is the context ``trainer.build_policy`` parallelises a
LoRA model in (built on meta, adapters injected first, as under FSDP2:
:mod:`torchtitan_grpo.lora.sharded`, whose seeding, gather, merge and push
then work unchanged: ``full_tensor()`` and ``distribute_tensor`` take any
placements). It swaps ``parallelize_module`` in TorchTitan's model
``parallelize`` modules for one that hands an adapted projection the LoRA
style instead of torch's.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from torchtitan_grpo.lora.adapters import LoRALinear

__all__ = ["LoRAColwiseParallel", "LoRARowwiseParallel", "lora_style", "lora_plan"]


def _place(style, module: nn.Module, device_mesh, placements: dict[str, Placement]) -> None:
    """Each named parameter of ``module`` as a DTensor on ``device_mesh`` with its placement."""
    if not isinstance(module.lora_dropout, nn.Identity):
        raise ValueError("lora.dropout > 0 is not supported with parallelism.tensor_parallel_degree > 1 "
                         "(the dropout mask would differ between TP ranks): set lora.dropout = 0")
    for name, placement in placements.items():
        param = getattr(module, name)
        if param is None:
            continue
        module.register_parameter(name, nn.Parameter(
            distribute_tensor(param, device_mesh, [placement], src_data_rank=style.src_data_rank),
            requires_grad=param.requires_grad))


class LoRAColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` of a ``LoRALinear``: ``W``, bias and ``B`` on ``Shard(0)``, ``A`` replicated."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if isinstance(module, LoRALinear):  # the dropout submodule has nothing to place
            _place(self, module, device_mesh, {"weight": Shard(0), "bias": Shard(0),
                                               "lora_A": Replicate(), "lora_B": Shard(0)})


class LoRARowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` of a ``LoRALinear``: ``W`` and ``A`` on ``Shard(1)``, bias and ``B`` replicated."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if isinstance(module, LoRALinear):
            _place(self, module, device_mesh, {"weight": Shard(1), "bias": Replicate(),
                                               "lora_A": Shard(1), "lora_B": Replicate()})


def lora_style(style, module: nn.Module):
    """The style to apply to ``module``: for a ``LoRALinear`` under torch's
    colwise / rowwise style, a copy of it (same layouts) that places the
    adapters; anything else unchanged. Other styles on an adapter (Float8's)
    are refused."""
    if not isinstance(module, LoRALinear):
        return style
    kind = {ColwiseParallel: LoRAColwiseParallel, RowwiseParallel: LoRARowwiseParallel}.get(type(style))
    if kind is None:
        raise ValueError(f"lora.enable with tensor parallelism: no LoRA placement for {type(style).__name__} "
                         "(only torch's ColwiseParallel / RowwiseParallel; float8 TP is not supported with LoRA)")
    out = copy.copy(style)
    out.__class__ = kind
    return out


def _lora_parallelize_module(original):
    def parallelize_module(module=None, device_mesh=None, parallelize_plan=None, **kwargs):
        if isinstance(parallelize_plan, dict):
            plan = {}
            for key, style in parallelize_plan.items():
                try:
                    target = module.get_submodule(key)
                except AttributeError:  # a wildcard or a module this stage lacks: torch resolves it
                    target = None
                plan[key] = style if target is None else lora_style(style, target)
            parallelize_plan = plan
        elif parallelize_plan is not None:
            parallelize_plan = lora_style(parallelize_plan, module)
        frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
        out = original(module=module, device_mesh=device_mesh, parallelize_plan=parallelize_plan, **kwargs)
        # torch's SequenceParallel (the norms) re-registers parameters trainable: keep the base frozen
        for name, p in module.named_parameters():
            if name in frozen:
                p.requires_grad_(False)
        return out

    parallelize_module._grpo_lora = True
    return parallelize_module


@contextlib.contextmanager
def lora_plan(model_name: str) -> Iterator[None]:
    """For the duration, TorchTitan's model ``parallelize`` modules (the
    ``model_name`` train spec's, imported first, and any other already
    imported) apply the LoRA styles to adapted projections. Changes nothing
    for a model without adapters or without TP."""
    from torchtitan_grpo import _titan  # noqa: F401  (before torchtitan)
    from torchtitan.protocols.train_spec import get_train_spec

    get_train_spec(model_name)  # imports its parallelize module

    swapped = []
    for name, mod in list(sys.modules.items()):
        fn = getattr(mod, "parallelize_module", None) if name.startswith("torchtitan.models.") else None
        if callable(fn) and not getattr(fn, "_grpo_lora", False):
            swapped.append((mod, fn))
            mod.parallelize_module = _lora_parallelize_module(fn)
    try:
        yield
    finally:
        for mod, fn in swapped:
            mod.parallelize_module = fn
