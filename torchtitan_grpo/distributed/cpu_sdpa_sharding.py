"""DTensor sharding rules for CPU flash attention (heads or batch sharded).

TorchTitan's qwen3 TP feeds DTensor q/k/v (sharded on heads) to SDPA; on CPU
that dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``, for
which torch 2.13 registers no DTensor strategy: TP and CP tests on CPU need
one (:func:`register_cpu_sdpa_sharding`, called by
:mod:`torchtitan_grpo.distributed.parallel`)."""

from __future__ import annotations

import torch


def _require_no_attn_mask(op_schema) -> None:
    from torch.distributed.tensor._op_schema import OpStrategy

    if isinstance(op_schema.kwargs_schema.get("attn_mask"), OpStrategy):
        raise NotImplementedError(
            "DTensor CPU flash attention with an explicit attn_mask is not supported "
            "(TorchTitan's causal SDPA passes none)"
        )


def _cpu_flash_attention_strategy(op_schema):
    """Outputs ``(out [B, H, L, E], logsumexp [B, H, L])``, inputs q, k, v."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    _require_no_attn_mask(op_schema)
    n = 2 + 3
    per_mesh_dim = [
        [Replicate()] * n,
        [Shard(1)] * n,  # heads (TP): attention is independent per head
        [Shard(0)] * n,  # batch
    ]
    return expand_to_full_mesh_op_strategy(
        op_schema.get_mesh_from_args(), op_schema, per_mesh_dim, input_index=2
    )


def _cpu_flash_attention_backward_strategy(op_schema):
    """Outputs ``(grad_q, grad_k, grad_v)``, inputs grad_out, q, k, v, out, lse."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    _require_no_attn_mask(op_schema)
    n = 3 + 6
    per_mesh_dim = [[Replicate()] * n, [Shard(1)] * n, [Shard(0)] * n]
    return expand_to_full_mesh_op_strategy(
        op_schema.get_mesh_from_args(validate=False),
        op_schema,
        per_mesh_dim,
        input_index=3,
    )


def register_cpu_sdpa_sharding() -> bool:
    """Teach DTensor to run CPU flash attention sharded on heads or batch.

    TorchTitan's qwen3 TP feeds DTensor q/k/v (sharded on heads) to SDPA; on
    CPU that dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``,
    for which torch 2.13 registers no strategy. Registers forward and backward
    only where torch has none. Returns True if anything was registered.
    """
    from torch.distributed.tensor import DTensor

    aten = torch.ops.aten
    prop = DTensor._op_dispatcher.sharding_propagator
    tables = ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules")
    known = [getattr(prop, t, {}) for t in tables]  # not all exist in every torch
    added = False
    for op, strategy in (
        (aten._scaled_dot_product_flash_attention_for_cpu.default, _cpu_flash_attention_strategy),
        (
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            _cpu_flash_attention_backward_strategy,
        ),
    ):
        if any(op in table for table in known):
            continue
        prop.register_op_strategy(op, strategy)
        added = True
    return added
