"""HF checkpoint names for the fused expert weights of transformers' MoE models.

transformers 5 keeps a Qwen3-MoE layer's experts as two fused parameters,
``mlp.experts.gate_up_proj [E, 2 * I, H]`` (each expert's gate rows, then its
up rows) and ``mlp.experts.down_proj [E, H, I]``, and converts the
checkpoint's per-expert tensors (``mlp.experts.{j}.gate_proj.weight`` ...) when
it loads a folder. Weight pushes use the checkpoint's names (what SGLang and
vLLM load, and what the trainer's state-dict adapter writes), so the engine
addresses each per-expert name as a view into the fused parameter: a pushed
tensor is copied into its slice, never swapped in as storage (the views are
not adoptable, see ``weights.adoptable``).
"""

from __future__ import annotations

import torch
from torch import nn


def expert_views(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{checkpoint name: view}`` for every fused experts module of ``model``
    ({} for a dense model or one whose experts are separate modules)."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)
                and gate_up.dim() == 3 and down.dim() == 3):
            continue
        experts, rows, _ = gate_up.shape
        inner = rows // 2
        if rows != 2 * inner or tuple(down.shape[::2]) != (experts, inner):
            raise ValueError(f"{name}: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} "
                             "are not [E, 2I, H] and [E, H, I]")
        for j in range(experts):
            out[f"{name}.{j}.gate_proj.weight"] = gate_up.data[j, :inner]
            out[f"{name}.{j}.up_proj.weight"] = gate_up.data[j, inner:]
            out[f"{name}.{j}.down_proj.weight"] = down.data[j]
    return out
