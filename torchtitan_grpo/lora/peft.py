"""Write the trained adapters in the format peft loads on the HF model.

A peft LoRA folder is ``adapter_config.json`` plus ``adapter_model.safetensors``
whose keys are ``base_model.model.<HF module>.lora_A.weight`` /
``.lora_B.weight`` (``<HF module>`` e.g. ``model.layers.0.self_attn.q_proj``),
``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``, scaled by
``lora_alpha / r``: ``PeftModel.from_pretrained(base, folder)`` then computes
what our :class:`~torchtitan_grpo.lora.adapters.LoRALinear` computes.

HF module names come from the train spec's state-dict adapter, applied to the
base weight's name. Where that adapter reorders the weight's rows (llama3's
wq/wk, for HF's rotary layout), ``B A`` must be reordered the same way, and
since a row permutation ``P`` gives ``P(B A) = (P B) A``, ``B``'s rows are
permuted and ``A`` is kept. The permutation is read off the adapter itself
(it maps a tensor whose rows hold their own index), so any adapter that only
reorders rows is handled and any other transform fails loudly.

peft itself is not needed to write the folder (it is a test dependency).
"""

from __future__ import annotations

import json
import os

import torch

from torchtitan_grpo.lora.adapters import adapted_modules, LoRALinear

__all__ = ["ADAPTER_FOLDER", "export_peft_adapter", "peft_adapter_tensors"]

ADAPTER_FOLDER = "lora_adapter"
"""Sub-folder of the HF export that holds the peft adapter."""

_PREFIX = "base_model.model."


def _hf_module_and_rows(adapter, fqn: str, m: LoRALinear) -> tuple[str, torch.Tensor | None]:
    """HF module name of ``fqn``'s weight and the row order the adapter gives it
    (None: rows kept in place)."""
    out_f, in_f = m.weight.shape
    rows = torch.arange(out_f, dtype=torch.float64).unsqueeze(1).expand(out_f, in_f).contiguous()
    hf = adapter.to_hf({f"{fqn}.weight": rows})
    if len(hf) != 1:
        raise ValueError(f"LoRA export: the state-dict adapter maps {fqn}.weight to {sorted(hf)}, not one HF weight")
    (name, mapped), = hf.items()
    if not name.endswith(".weight"):
        raise ValueError(f"LoRA export: {fqn}.weight maps to {name}, not an HF '.weight'")
    if tuple(mapped.shape) != (out_f, in_f) or not torch.equal(mapped, mapped[:, :1].expand_as(mapped)):
        raise ValueError(f"LoRA export: the state-dict adapter transforms {fqn}.weight beyond reordering its rows")
    order = mapped[:, 0].long()
    if torch.equal(order, torch.arange(out_f)):
        return name[: -len(".weight")], None
    if not torch.equal(order.sort().values, torch.arange(out_f)):
        raise ValueError(f"LoRA export: the state-dict adapter's rows of {fqn}.weight are not a permutation")
    return name[: -len(".weight")], order


def peft_adapter_tensors(model: torch.nn.Module, adapter) -> dict[str, torch.Tensor]:
    """The peft-named adapter tensors of ``model`` (detached CPU copies).
    Sharded adapters (FSDP2) must have been gathered on this rank since their
    last update (:func:`torchtitan_grpo.lora.sharded.gather_adapters`)."""
    from torchtitan_grpo.lora.adapters import whole_adapter

    out: dict[str, torch.Tensor] = {}
    for fqn, m in adapted_modules(model).items():
        module, order = _hf_module_and_rows(adapter, fqn, m)
        a, b = whole_adapter(m)
        a, b = a.cpu(), b.cpu()
        if order is not None:
            b = b[order]
        out[f"{_PREFIX}{module}.lora_A.weight"] = a.contiguous()
        out[f"{_PREFIX}{module}.lora_B.weight"] = b.contiguous()
    return out


def _adapter_config(model: torch.nn.Module, tensors: dict[str, torch.Tensor], base_path: str) -> dict:
    mods = list(adapted_modules(model).values())
    ranks = {m.rank for m in mods}
    alphas = {m.alpha for m in mods}
    drops = {m.lora_dropout.p if isinstance(m.lora_dropout, torch.nn.Dropout) else 0.0 for m in mods}
    if len(ranks) != 1 or len(alphas) != 1:
        raise ValueError(f"LoRA export: one rank and alpha for all adapters expected, got {ranks} and {alphas}")
    alpha = alphas.pop()
    targets = sorted({k[len(_PREFIX):].rsplit(".", 2)[0].rsplit(".", 1)[-1] for k in tensors})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": os.path.abspath(base_path),
        "r": ranks.pop(),
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
        "lora_dropout": drops.pop() if len(drops) == 1 else 0.0,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def export_peft_adapter(model: torch.nn.Module, adapter, out_dir: str, base_path: str,
                        dtype: torch.dtype = torch.float32, tensors: dict[str, torch.Tensor] | None = None) -> str:
    """Write ``model``'s adapters into ``out_dir`` (created) as a peft LoRA
    folder for the HF checkpoint at ``base_path`` (the frozen base: the
    run's ``model.hf_assets_path``); returns ``out_dir``. ``tensors``: the
    peft-named tensors to write instead of ``model``'s own (under PP, every
    stage's, gathered to rank 0); ``model`` then gives rank and alpha only."""
    from safetensors.torch import save_file

    if tensors is None:
        tensors = peft_adapter_tensors(model, adapter)
    tensors = {k: v.detach().cpu().to(dtype) for k, v in tensors.items()}
    if not tensors:
        raise ValueError("LoRA export: the model has no adapters")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "adapter_model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    os.chmod(path, 0o644)
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(_adapter_config(model, tensors, base_path), f, indent=2)
    return out_dir
