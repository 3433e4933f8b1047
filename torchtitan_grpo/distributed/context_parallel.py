"""Context parallelism (CP) in the GRPO step: TorchTitan 0.2.2's ring attention
over the ``cp`` mesh, the sequence dimension of every micro-batch split over
its ranks.

TorchTitan does the model's part: with ``parallelism.context_parallel_degree
> 1`` its ``parallelize_fn`` wraps each attention module so that q/k/v become
``Shard(2)`` DTensors whose SDPA runs as ring attention, and FSDP shards the
weights over ``dp_shard x cp`` (so CP alone is FSDP over the CP ranks). Its
trainer shards the inputs, labels and RoPE positions with the head-tail load
balancer (``cp_shard``: rank ``r`` of ``n`` holds chunks ``r`` and ``2n-1-r``
of ``2n``) and runs the model on the local shard. This module does the same
for the GRPO forward and adds what the GRPO loss needs:

* **Inputs.** Tokens, their next-token targets, their positions (which index
  the RoPE cache) and the per-position mask are sharded together through
  TorchTitan's ``cp_shard``, so they stay aligned whatever the load balancer
  does. The model's output projection (full logits, or the chunked head of
  :mod:`torchtitan_grpo.train.token_logprobs`) then scores each rank's local
  positions only: no rank forms more than ``T / cp`` positions of logits.
* **The loss sees whole sequences.** The ``[B, T / cp]`` local log-probs are
  all-gathered over the CP ranks and put back in sequence order (by the
  sharded positions), so every CP rank evaluates the same loss on the whole
  ``[B, T - 1]`` batch: per-sequence means and sums (``grpo.loss_agg``),
  sequence-level IS weights, the KL term and the metrics need nothing else.
  The gather's backward hands each rank the gradient of its own positions
  only (every rank's loss is the same function, so its slice of that
  gradient is exact); the parameter gradients of the CP ranks' positions are
  then summed by FSDP's reduce-scatter over ``dp_shard x cp``, which
  :mod:`torchtitan_grpo.distributed.parallel` makes a plain SUM in every layout. A
  gathered row costs ``4 T`` bytes, nothing beside the activations.
* **CPU.** PyTorch's ring attention handles the CUDA SDPA kernels only
  (flash, memory-efficient, cuDNN); CPU SDPA dispatches to
  ``_scaled_dot_product_flash_attention_for_cpu``, which the CP dispatcher
  rejects. :func:`enable_cpu_ring_attention` routes that kernel (forward and
  backward) through the same ring templates, so CP runs on gloo as well.
* **CUDA in float32.** TorchTitan's SDPA wrapper allows cuDNN, flash and math;
  in fp32 only math is eligible, which CP cannot ring. Under CP the
  memory-efficient kernel is allowed too (grouped-query heads repeated for
  it), so fp32 CP runs; bf16 still takes cuDNN / flash.

* **With TP.** TP hands the attention its heads as DTensors over the TP
  mesh; :func:`_local_heads` makes them local before CP's input hook, so each
  TP rank rings its own heads over its CP ranks.
* **With PP.** The first stage takes this rank's share of the tokens
  (:func:`pipeline_tokens`), every stage its positions (the pipeline's
  RoPE hook), and the last stage's loss gathers whole sequences from the
  local logits (:func:`pipeline_terms`), as above.

Supported: CP alone, CP x FSDP / HSDP (``data_parallel_*``), CP x TP, CP x
PP, with padded micro-batches. Refused in one line naming the key: CP with
EP, packed micro-batches (``grpo.micro_batch_tokens``, refused in
:mod:`torchtitan_grpo.train.packing`), and load balancers other than head-tail.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_grpo import _titan  # noqa: F401  (before torchtitan)

__all__ = ["check_config", "enable_cpu_ring_attention", "gather_sequence", "prepare_model", "shard_batch"]


# ------------------------------------------------------------------ config


def check_config(p, world_size: int) -> int:
    """The CP degree from ``[parallelism]`` (``p``), or one line naming the
    key of a combination the trainer does not run."""
    cp = p.context_parallel_degree
    if cp == 1:
        return 1
    if cp < 1:
        raise ValueError(f"parallelism.context_parallel_degree={cp}: must be >= 1")
    others = {
        "expert_parallel_degree": "MoE routing over CP ranks is untested",
    }
    for key, why in others.items():
        if getattr(p, key) != 1:
            raise NotImplementedError(
                f"parallelism.context_parallel_degree={cp} with parallelism.{key}={getattr(p, key)}: "
                f"not supported ({why}); combine CP with data_parallel_shard_degree / replicate only")
    if p.context_parallel_load_balancer != "headtail":
        raise NotImplementedError(
            f"parallelism.context_parallel_load_balancer={p.context_parallel_load_balancer!r}: the GRPO "
            "trainer runs CP with 'headtail' only (ring attention assumes its chunk order)")
    return cp


# ------------------------------------------------------ attention kernels


def _cpu_flash_cp_strategy(op_schema):
    """Forward: ``(out, lse)`` from ``(q, k, v)``; replicated, or sharded on
    heads, batch or (CP) the sequence, all alike."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    per_dim = [[Replicate()] * 5, [Shard(1)] * 5, [Shard(0)] * 5, [Shard(2)] * 5]
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, per_dim, input_index=2)


def _cpu_flash_backward_cp_strategy(op_schema):
    """Backward: ``(dq, dk, dv)`` from ``(dout, q, k, v, out, lse)``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    per_dim = [[Replicate()] * 9, [Shard(1)] * 9, [Shard(0)] * 9, [Shard(2)] * 9]
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(validate=False), op_schema, per_dim,
                                           input_index=3)


def _ring_cpu_flash(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    if attn_mask is not None or dropout_p:
        raise NotImplementedError("CP ring attention on CPU: no attn_mask or dropout (TorchTitan passes none)")
    return _templated_ring_attention(mesh.get_group(), 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                                     query=query, key=key, value=value, is_causal=is_causal, scale=scale)


def _ring_cpu_flash_backward(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                             attn_mask=None, scale=None):
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention_backward,
    )

    return _templated_ring_attention_backward(
        mesh.get_group(), 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=grad_out, grad_out_name="grad_out", query=query, key=key, value=value, out=out,
        logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=scale)


def _handler(ring: Callable) -> Callable:
    """A DTensor custom-op handler that runs ``ring`` on the local shards (as
    PyTorch's own ``_sdpa_handler`` does for the CUDA kernels)."""
    from torch.distributed.tensor import DTensor

    def handle(op_call, args, kwargs):
        dispatcher = DTensor._op_dispatcher
        info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        dispatcher.sharding_propagator.propagate(info)
        sharding = info.output_sharding
        if sharding is None or sharding.needs_redistribute:
            raise RuntimeError(f"CP ring attention on CPU: q/k/v of {op_call} are not all sharded on the sequence")
        local = ring(info.compute_mesh, *info.local_args, **info.local_kwargs)
        return dispatcher.wrap(local, sharding.output_spec)

    return handle


def enable_cpu_ring_attention() -> None:
    """Route CPU SDPA (``_scaled_dot_product_flash_attention_for_cpu``, forward
    and backward) on sequence-sharded DTensors through PyTorch's ring attention
    templates (a sharding strategy without its handler would attend within
    each shard only). Idempotent; overrides the head-only strategy that
    :func:`torchtitan_grpo.distributed.cpu_sdpa_sharding.register_cpu_sdpa_sharding` may have set."""
    from torch.distributed.tensor import DTensor

    aten = torch.ops.aten
    fwd, bwd = aten._scaled_dot_product_flash_attention_for_cpu.default, \
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    from torch.distributed.tensor.experimental._context_parallel import _attention

    dispatcher = DTensor._op_dispatcher
    prop = dispatcher.sharding_propagator
    prop.register_op_strategy(fwd, _cpu_flash_cp_strategy)
    prop.register_op_strategy(bwd, _cpu_flash_backward_cp_strategy)
    handlers = {fwd: _handler(_ring_cpu_flash), bwd: _handler(_ring_cpu_flash_backward)}
    # Enabling CP's dispatcher (TorchTitan's apply_cp) *replaces* the handler
    # table by PyTorch's import-time table plus its CUDA ops: add ours to both.
    dispatcher._custom_op_handlers.update(handlers)
    getattr(_attention, "existing_custom_ops", {}).update(handlers)


def _repeat_kv_heads(module, args, kwargs):
    """Forward pre-hook on TorchTitan's SDPA wrapper: grouped-query k/v
    repeated to the query's heads, so the memory-efficient kernel (no GQA in
    it) is eligible for fp32 CP on CUDA."""
    q, k, v = args[:3]
    if not kwargs.get("enable_gqa") or k.shape[1] == q.shape[1]:
        return None
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    return (q, k, v, *args[3:]), {**kwargs, "enable_gqa": False}


def prepare_model(model: nn.Module, parallel_dims, device: torch.device) -> None:
    """Before ``parallelize_fn`` (nothing without CP): the attention kernels CP
    can ring (module doc)."""
    from torch.nn.attention import SDPBackend
    from torchtitan.models.attention import ScaledDotProductAttentionWrapper

    if not parallel_dims.cp_enabled:
        return
    if device.type == "cpu":
        enable_cpu_ring_attention()
    for m in model.modules():
        if isinstance(m, ScaledDotProductAttentionWrapper):
            if device.type == "cuda":
                m.sdpa_backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                   SDPBackend.EFFICIENT_ATTENTION]
                m.register_forward_pre_hook(_repeat_kv_heads, with_kwargs=True, prepend=True)
            if parallel_dims.tp_enabled:  # registered last, prepended: runs before the hooks above
                m.register_forward_pre_hook(_local_heads, with_kwargs=True, prepend=True)


def _local_heads(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """CP x TP: q / k / v reach the attention as DTensors sharded over the TP
    mesh on heads; CP's input hook makes ``Shard(seq)`` DTensors over the CP
    mesh and accepts only plain tensors or those. Each TP rank's heads are a
    complete attention problem, so the ring runs on the local heads; the
    output (made local by CP's output hook) is this rank's share of the heads,
    which the row-parallel output projection takes as ``Shard(-1)``."""
    from torch.distributed.tensor import DTensor

    def local(x):
        return x.to_local() if isinstance(x, DTensor) else x

    return tuple(local(a) for a in args), {k: local(v) for k, v in kwargs.items()}


# ------------------------------------------------------------------ inputs


def shard_batch(parallel_dims, tokens: torch.Tensor, mask: torch.Tensor | None = None):
    """This CP rank's share of a ``[B, T]`` micro-batch (``T`` divisible by
    ``2 * cp``, see :func:`torchtitan_grpo.distributed.parallel.seq_len_multiple`):
    ``(tokens, targets, positions, mask)``, each ``[B, T / cp]``. ``targets``
    are the next tokens (0 after the last, never scored), ``positions`` each
    local position's index in the sequence (the RoPE cache's index, and the
    order :func:`gather_sequence` restores), ``mask`` the ``[B, T - 1]``
    per-position mask padded likewise (None: not sharded)."""
    from torchtitan.distributed.context_parallel import cp_shard

    b, t = tokens.shape
    targets = nn.functional.pad(tokens[:, 1:], (0, 1))
    positions = torch.arange(t, dtype=torch.int32, device=tokens.device).expand(b, t).contiguous()
    buffers = [tokens, targets, positions]
    if mask is not None:
        buffers.append(nn.functional.pad(mask, (0, 1)))
    mesh = parallel_dims.get_mesh("cp")
    sharded, _ = cp_shard(mesh, tuple(buffers), None, "headtail")
    return (*sharded[:3], sharded[3] if mask is not None else None)


class _GatherSequence(torch.autograd.Function):
    """``[B, T / cp]`` local values -> ``[B, T]`` in sequence order on every CP
    rank; backward: this rank's positions of the incoming gradient."""

    @staticmethod
    def forward(ctx, local, order, group, rank):
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        full = torch.empty_like(torch.cat(parts, dim=1))
        full.scatter_(1, order, torch.cat(parts, dim=1))
        ctx.save_for_backward(order)
        ctx.width, ctx.rank = local.shape[1], rank
        return full

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        mine = order[:, ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width]
        return grad.gather(1, mine), None, None, None


def gather_sequence(parallel_dims, local: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The whole ``[B, T]`` tensor from each CP rank's ``[B, T / cp]`` share
    (``positions``: :func:`shard_batch`'s), differentiable (class doc)."""
    mesh = parallel_dims.get_mesh("cp")
    group = mesh.get_group()
    parts = [torch.empty_like(positions) for _ in range(mesh.size())]
    dist.all_gather(parts, positions.contiguous(), group=group)
    order = torch.cat(parts, dim=1).long()
    return _GatherSequence.apply(local, order, group, mesh.get_local_rank())
