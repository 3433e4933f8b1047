"""LoRA on several trainer ranks: FSDP2, HSDP and DDP (data-parallel layouts).

One process adapts the loaded model in place (:func:`torchtitan_grpo.lora.adapters.apply_lora`).
With several ranks the model is built on meta and sharded before any tensor
exists, and ``fully_shard`` must see the adapters as parameters of the
transformer block it wraps (a parameter added later would be neither
sharded nor gathered). So, in ``trainer.build_policy``:

1. :func:`inject` on the meta model: the same ``LoRALinear`` swap and freeze
   as one process (and the ``lora.base_dtype`` cast), nothing allocated;
2. TorchTitan's ``parallelize_fn`` and ``materialize`` (adapters included:
   FSDP shards ``lora_A`` / ``lora_B`` on dim 0 like any weight);
3. :func:`load_and_init`: the base from the HF checkpoint (the adapters are
   hidden from the strict loader, which knows only checkpoint names), then
   ``A`` Kaiming-uniform from a generator seeded with ``grpo.seed`` and drawn
   whole on every rank (each rank keeps its shard: all ranks agree without
   communication, and a one-process run seeded the same way gets the same
   ``A``), ``B`` zero.

The optimizer then takes only the adapters (the rest does not require grad);
FSDP2 reduce-scatters their gradients alone; DCP checkpoints hold base and
adapters as DTensors under their usual names, and resume restores both with
the adapters' optimizer state.

Pushes and exports need whole tensors: :func:`merged_hf_state` gathers
every parameter (``full_tensor()``, a collective on every rank) and merges
``W + scale B A`` as one process does, on the gathered tensors.
:func:`gather_adapters` gathers ``A`` and ``B`` only (the adapter push). Both
remember each module's gathered ``A`` / ``B`` with the version counters of
its local shards, so rank 0 can write the peft folder afterwards alone
(:func:`whole_adapter`; the export calls it after :func:`merged_hf_state`)
and a stale copy is refused rather than written. :class:`ShardedLoraPush` is
the trainer's push object for these layouts.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_grpo.lora import adapters as lora
from torchtitan_grpo.lora.adapters import LoRALinear, _stamp

__all__ = ["inject", "load_and_init", "adapter_order", "init_adapters", "merged_state", "merged_hf_state", "gather_adapters",
           "is_sharded", "ShardedLoraPush"]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------ build


def inject(model: nn.Module, cfg) -> list[str]:
    """Adapters on the meta ``model``, before it is parallelised (step 1 above)."""
    if any(not p.is_meta for p in model.parameters()):
        raise ValueError("lora_sharded.inject: the model must be on meta (built before parallelize and materialize)")
    return lora.apply_lora(model, cfg)


@contextlib.contextmanager
def _adapters_hidden(model: nn.Module) -> Iterator[None]:
    """``lora_A`` / ``lora_B`` out of every module's parameters for the
    duration (the strict HF loader must see the base names only); put back
    in the same order, the very same Parameter objects FSDP holds."""
    held = [(m, m._parameters.pop("lora_A"), m._parameters.pop("lora_B"))
            for m in model.modules() if isinstance(m, LoRALinear)]
    try:
        yield
    finally:
        for m, a, b in held:
            m._parameters["lora_A"], m._parameters["lora_B"] = a, b


def _copy_whole(param: torch.Tensor, whole: torch.Tensor) -> None:
    from torchtitan_grpo.models.hf_bridge import _copy_full  # each rank cuts its own shard of ``whole``

    _copy_full(param, whole)


def adapter_order(model: nn.Module) -> list[tuple[str, torch.Size]]:
    """``(fqn, A shape)`` of every adapter of ``model``, in module order: the
    order :func:`init_adapters` draws in (record it on the whole model before
    a pipeline split keeps one stage of it)."""
    return [(fqn, m.lora_A.shape) for fqn, m in lora.adapted_modules(model).items()]


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int, order: list[tuple[str, torch.Size]] | None = None) -> None:
    """``A`` Kaiming-uniform (as ``nn.Linear`` initialises a weight) from a
    generator seeded with ``seed``, drawn whole in module order on every
    rank; ``B`` zero. Sharded or not: the same ``seed`` gives the same ``A``
    in every layout (the one-process path draws from the global RNG instead).

    ``order``: ``model`` is one pipeline stage and this is the whole model's
    :func:`adapter_order`: every ``A`` of the whole model is drawn, in that
    order, and the stage keeps its own (so PP gets one process's ``A``)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    mine = lora.adapted_modules(model)
    order = adapter_order(model) if order is None else order
    missing = mine.keys() - {fqn for fqn, _ in order}
    if missing:
        raise ValueError(f"lora_sharded.init_adapters: adapters {sorted(missing)[:3]} are not in the given order")
    for fqn, shape in order:
        a = torch.empty(shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
        m = mine.get(fqn)
        if m is not None:
            _copy_whole(m.lora_A, a.to(m.lora_A.dtype))
            _copy_whole(m.lora_B, torch.zeros(m.lora_B.shape, dtype=m.lora_B.dtype))


def load_and_init(model: nn.Module, adapter, hf_dir: str, seed: int, whole: dict | None = None,
                  order: list[tuple[str, torch.Size]] | None = None) -> None:
    """Step 3 above, on the materialised (sharded) model. ``whole`` / ``order``:
    ``model`` is one pipeline stage (:mod:`torchtitan_grpo.lora.pp`), these are
    the whole model's checkpoint names and :func:`adapter_order`."""
    from torchtitan_grpo.models.hf_bridge import load_hf_weights

    with _adapters_hidden(model):
        load_hf_weights(model, adapter, hf_dir, whole)
    init_adapters(model, seed, order)


# ------------------------------------------------------------------ gather


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _remember(m: LoRALinear, a: torch.Tensor, b: torch.Tensor) -> None:
    if isinstance(m.lora_A, DTensor):
        m._grpo_whole_adapter = (_stamp(m), a.detach(), b.detach())


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """:func:`torchtitan_grpo.lora.adapters.merged_state` of a sharded model: every
    parameter whole (a collective: every rank calls it, all get the tensors)."""
    wholes: dict[int, torch.Tensor] = {}

    def gather(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in wholes:
            wholes[id(t)] = _whole(t)
        return wholes[id(t)]

    out = lora.merged_state(model, gather)
    for m in lora.adapted_modules(model).values():
        if id(m.lora_A) in wholes:
            _remember(m, wholes[id(m.lora_A)], wholes[id(m.lora_B)])
    return out


def merged_hf_state(model: nn.Module, adapter) -> dict[str, torch.Tensor]:
    """HF-named merged weights of a sharded model (a collective)."""
    return adapter.to_hf(merged_state(model))


def gather_adapters(model: nn.Module) -> None:
    """Gather every ``A`` / ``B`` whole (a collective), for :func:`whole_adapter`."""
    for m in lora.adapted_modules(model).values():
        _remember(m, _whole(m.lora_A), _whole(m.lora_B))


# ------------------------------------------------------------------- push


class ShardedLoraPush:
    """The weight push of a LoRA policy on several data-parallel ranks (the
    ``trainer_push`` object: ``snapshot(version, wait=None)`` on every rank
    after each optimizer step, ``close()``).

    Every rank gathers (the merged weights, or with ``adapter_only`` the
    adapters: ``weight_sync.lora_push = "adapter"``) on the trainer's thread
    and its process groups, then rank 0 hands the HF- or peft-named tensors to
    its Pusher. Unlike the full-weight ``ShardGatherer`` the gather is not
    overlapped with the next step: a merged push costs one all-gather of the
    model per version, an adapter push one of the adapters only."""

    def __init__(self, model_parts: list[nn.Module], adapter, pusher, sync: bool, adapter_only: bool = False):
        self.model_parts, self.adapter, self.pusher, self.sync = model_parts, adapter, pusher, sync
        self.adapter_only = adapter_only

    def tensors(self) -> dict[str, torch.Tensor]:
        """What rank 0 pushes (every rank must call it; the others get it too, and drop it)."""
        from torchtitan_grpo.lora.peft import peft_adapter_tensors

        out: dict[str, torch.Tensor] = {}
        for part in self.model_parts:
            if self.adapter_only:
                gather_adapters(part)
                out |= peft_adapter_tensors(part, self.adapter)
            else:
                out |= merged_hf_state(part, self.adapter)
        return out

    def snapshot(self, version: int, wait: bool | None = None) -> dict[str, float]:
        t0 = time.perf_counter()
        tensors = self.tensors()
        gather_s = time.perf_counter() - t0
        if self.pusher is None:  # not rank 0
            return {}
        m = self.pusher.push(tensors, version, self.sync if wait is None else wait)
        m["time/push_gather_s"] = gather_s
        if "time/push_stall_s" in m:  # the trainer's thread waited for the gather too
            m["time/push_stall_s"] += gather_s
        return m

    def close(self, abandon: bool = False) -> None:
        pass

    def __enter__(self) -> ShardedLoraPush:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(abandon=exc_type is not None)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` has adapters and sharded (DTensor) parameters: its
    merge needs this module's gather (DDP's parameters are whole on every rank)."""
    return lora.has_lora(model) and any(isinstance(p, DTensor) for p in model.parameters())
