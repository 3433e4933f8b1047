"""A CUDA-graph-safe MoE MLP for the static KV batch (``server/engine/static_batch.py``).

transformers' sparse MoE block (``Qwen3MoeSparseMoeBlock``) loops over the
experts that were hit, with index tensors whose sizes depend on the routing:
a host sync per expert, which a CUDA graph cannot capture. This module runs
the same math with shapes fixed by the batch alone:

- **Route.** The gate's logits, softmax in fp32, top-k, optional
  renormalisation, weights cast back to the logits' dtype (HF's router, op
  for op, so the picked experts are the same).
- **Sort.** The ``N x top_k`` (token, expert) pairs are sorted by expert:
  always ``N x top_k`` rows, and each expert's group ends at an offset found
  by ``searchsorted`` (a device tensor, never read on the host).
- **Grouped GEMMs.** On CUDA in bf16, ``torch._grouped_mm`` runs every
  expert's gate/up and down projection over its rows in one kernel each;
  other dtypes on CUDA run every expert on every row and keep each row's own
  (graph-safe, E/k times the FLOPs); on CPU a plain loop over each expert's
  rows (tests, where nothing is captured).
- **Combine.** Each row is scaled by its routing weight and added back to
  its token (``index_add_``).

It reads the experts' parameters (``experts.gate_up_proj [E, 2I, H]``,
``experts.down_proj [E, H, I]``) in place, so a weight update that copies
into them is seen by captured graphs. The routes (expert ids ``[N, top_k]``)
are returned beside the output: router replay reports them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def is_moe(mlp: Any) -> bool:
    """An HF sparse MoE block with a top-k router (``gate``) and grouped experts."""
    experts, gate = getattr(mlp, "experts", None), getattr(mlp, "gate", None)
    return (gate is not None and hasattr(gate, "weight") and hasattr(gate, "top_k")
            and experts is not None and hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"))


def route(gate: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing weights ``[N, k]`` in the logits' dtype, expert ids ``[N, k]``) for tokens ``x [N, H]``."""
    logits = F.linear(x, gate.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, idx = torch.topk(probs, gate.top_k, dim=-1)
    if getattr(gate, "norm_topk_prob", False):
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), idx


def _grouped_mm_ok(x: torch.Tensor, experts: Any) -> bool:
    # The grouped GEMM kernel takes bf16 on the GPUs it supports (sm90+);
    # other dtypes take the loop (eager only).
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") \
        and experts.gate_up_proj.dtype == torch.bfloat16


def experts_forward(experts: Any, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Sum over each token's experts of ``weight * expert(x)``: ``[N, H]``."""
    n, k = idx.shape
    n_experts = experts.gate_up_proj.shape[0]
    flat = idx.reshape(-1)
    ids, order = torch.sort(flat, stable=True)
    token = order // k
    rows = x[token]  # [N*k, H], grouped by expert
    if _grouped_mm_ok(x, experts):
        bounds = torch.arange(n_experts, device=x.device, dtype=ids.dtype)
        offs = torch.searchsorted(ids, bounds, right=True, out_int32=True)
        gate, up = torch._grouped_mm(rows, experts.gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        out = torch._grouped_mm(experts.act_fn(gate) * up, experts.down_proj.transpose(-2, -1), offs=offs)
    elif x.is_cuda:
        # Graph-safe without the grouped kernel (fp32 / fp16 on a GPU: tests,
        # debugging): every expert runs on every row and keeps its own, E/k
        # times the FLOPs of the grouped path, no host sync.
        out = torch.zeros_like(rows)
        for e in range(n_experts):
            gate, up = F.linear(rows, experts.gate_up_proj[e]).chunk(2, dim=-1)
            out = torch.where((ids == e)[:, None], F.linear(experts.act_fn(gate) * up, experts.down_proj[e]), out)
    else:  # CPU: only each expert's own rows (nothing is captured here)
        out = torch.empty_like(rows)
        for e in range(n_experts):
            sel = ids == e
            if not bool(sel.any()):
                continue
            gate, up = F.linear(rows[sel], experts.gate_up_proj[e]).chunk(2, dim=-1)
            out[sel] = F.linear(experts.act_fn(gate) * up, experts.down_proj[e])
    out = out * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, token, out.to(x.dtype))


def moe_forward(mlp: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE block on ``x [..., H]``: (output ``[..., H]``, expert ids ``[prod(...), top_k]``)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    weights, idx = route(mlp.gate, flat)
    return experts_forward(mlp.experts, flat, weights, idx).reshape(shape), idx
