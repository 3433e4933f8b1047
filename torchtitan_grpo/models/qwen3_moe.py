"""Qwen3-MoE (HF ``Qwen3MoeForCausalLM``) on TorchTitan's MoE Qwen3 model.

TorchTitan 0.2.2's ``qwen3`` train spec has the MoE variant (grouped experts
``[E, ...]``, a token-choice top-k router) and its state-dict adapter maps the
grouped experts to HF's per-expert names
(``model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight``, router
``model.layers.{i}.mlp.gate.weight``) both ways: the names SGLang and vLLM
load, and the ones :mod:`torchtitan_grpo.models.hf_bridge` pushes and exports. So the
train spec stays ``qwen3`` (``model.name = "qwen3"``); this module only

* maps config.json onto ``Qwen3ModelArgs(moe_enabled=True, moe_args=...)``
  and refuses what TorchTitan's model cannot express (:func:`moe_model_args`);
* makes the built model's routers replayable and CPU-runnable
  (:func:`prepare`, see :mod:`torchtitan_grpo.models.router_replay`);
* computes the router's auxiliary load-balancing loss (:func:`aux_loss`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import torchtitan_grpo  # noqa: F401  (installs the triton shim before torchtitan)
from torchtitan.models.moe import MoEArgs
from torchtitan.models.moe.moe import TokenChoiceTopKRouter, TokenReorderer
from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
from torchtitan_grpo.models.router_replay import ReplayRouter, expert_counts, moe_routers

__all__ = ["MODEL_TYPE", "ARCHITECTURE", "is_moe_config", "moe_model_args", "prepare",
           "enable_aux_loss", "aux_loss"]

MODEL_TYPE = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"
# transformers' Qwen3MoeConfig defaults, for config.json files that omit a field
_HF_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                "norm_topk_prob": False, "decoder_sparse_step": 1}


def is_moe_config(hf_config: dict) -> bool:
    """Whether config.json describes a Qwen3-MoE checkpoint."""
    return hf_config.get("model_type") == MODEL_TYPE


def _field(hf_config: dict, name: str):
    # transformers 5 writes num_experts as num_local_experts (its attribute_map)
    if name == "num_experts" and "num_experts" not in hf_config:
        return hf_config.get("num_local_experts", _HF_DEFAULTS[name])
    return hf_config.get(name, _HF_DEFAULTS.get(name))


def _refuse(field: str, value, why: str) -> ValueError:
    return ValueError(f"config.json field {field}={value!r} is not supported: {why}")


def moe_model_args(dense: Qwen3ModelArgs, hf_config: dict) -> Qwen3ModelArgs:
    """The MoE args of a Qwen3-MoE config.json on top of ``dense``, the dense
    Qwen3 mapping of the same file (attention, norms, RoPE, vocabulary).

    Raises:
        ValueError: a field TorchTitan's MoE Qwen3 cannot express, named.
    """
    step = _field(hf_config, "decoder_sparse_step")
    if step != 1:
        raise _refuse("decoder_sparse_step", step, "TorchTitan's qwen3 puts an MoE in every layer (needs 1)")
    dense_layers = hf_config.get("mlp_only_layers") or []
    if dense_layers:
        raise _refuse("mlp_only_layers", dense_layers, "TorchTitan's qwen3 has no dense layers beside MoE "
                      "ones (needs [])")
    num_experts, top_k = int(_field(hf_config, "num_experts")), int(_field(hf_config, "num_experts_per_tok"))
    if num_experts < 1:
        raise _refuse("num_experts", num_experts, "a Qwen3-MoE needs experts (a dense model is model_type qwen3)")
    if not 1 <= top_k <= num_experts:
        raise _refuse("num_experts_per_tok", top_k, f"needs 1 .. num_experts={num_experts}")
    moe = MoEArgs(
        num_experts=num_experts,
        num_shared_experts=0,  # HF Qwen3-MoE has none
        score_func="softmax",  # softmax over all experts, then top-k, as HF
        route_norm=bool(_field(hf_config, "norm_topk_prob")),
        route_scale=1.0,
        gate_bias=False,
        # HF weighs each expert's *output* by its score; TorchTitan's default
        # scales the expert's input instead, which differs through SwiGLU
        score_before_experts=False,
        top_k=top_k,
        # TorchTitan's grouped path needs its triton permutation kernel (not
        # on CPU) and runs the experts in bf16 whatever the weights' dtype;
        # the per-expert loop is exact in every dtype. A bf16 GPU run may set
        # args.moe_args.use_grouped_mm = True before building the model.
        use_grouped_mm=False,
        # None: no aux-loss-free expert bias. TorchTitan would update a
        # per-expert routing bias from token counts after every optimizer
        # step: routing would drift between versions apart from the policy
        # gradient, and HF's Qwen3-MoE (so SGLang / vLLM) has no such bias,
        # so the pushed weights would route differently at inference.
        load_balance_coeff=None,
    )
    n_heads = hf_config["num_attention_heads"]
    return dataclasses.replace(
        dense,
        # HF Qwen3-MoE's attention falls back to hidden_size // heads, not
        # the dense Qwen3's 128, when config.json has no head_dim
        head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // n_heads,
        moe_enabled=True,
        moe_inter_dim=int(_field(hf_config, "moe_intermediate_size")),
        moe_args=moe,
    )


class _CountingReorderer(TokenReorderer):
    """TorchTitan's reorderer with :func:`expert_counts` (its ``histc`` of
    integer ids is not implemented on CPU); the same ops otherwise."""

    def forward(self, top_scores: torch.Tensor, selected_experts_indices: torch.Tensor):
        counts = expert_counts(selected_experts_indices, self.num_experts)
        order = torch.argsort(selected_experts_indices.view(-1), stable=True)
        return top_scores.view(-1)[order], order, counts


def prepare(model: nn.Module) -> nn.Module:
    """Make every MoE layer's router a :class:`ReplayRouter` and its reorderer
    CPU-capable, in place, by class swap (parameters, hooks and FQNs stay).
    Call it on the freshly built model, before parallelising: FSDP and TP
    then wrap the swapped classes. A dense model is returned unchanged."""
    for module in model.modules():
        if type(module) is TokenChoiceTopKRouter:
            module.__class__ = ReplayRouter
        elif type(module) is TokenReorderer:
            module.__class__ = _CountingReorderer
    return model


def enable_aux_loss(model: nn.Module, on: bool = True) -> None:
    """Make the routers keep what :func:`aux_loss` needs (their last forward's
    scores and expert ids); call once after building when ``moe.aux_loss_coef > 0``."""
    for _, router in moe_routers(model):
        router.keep_stats = on
        router.last_stats = None


def aux_loss(model: nn.Module, valid: torch.Tensor) -> torch.Tensor:
    """HF Qwen3-MoE's auxiliary load-balancing loss of the last forward (the
    Switch Transformer loss, unscaled: multiply by ``moe.aux_loss_coef``).

    ``num_experts * sum_e f_e * P_e`` where, over the non-padding tokens of
    ``valid [rows, T]`` (bool, the model input's layout) pooled over all MoE
    layers: ``f_e`` = routed (token, layer) slots to expert ``e`` per (token,
    layer) (the ``f_e`` sum to ``top_k``), ``P_e`` = the mean router
    probability of ``e``. Slots are the experts actually used, replayed ones
    included. Differentiable through the probabilities (the gate). The
    routers' kept stats are released.

    Under PP a stage sees its own layers only: the value is that stage's
    pooled loss, not the whole model's.
    """
    routers = moe_routers(model)
    stats = [router.last_stats for _, router in routers]
    if not routers or any(s is None for s in stats):
        raise RuntimeError("moe aux loss: no router stats; call qwen3_moe.enable_aux_loss(model) before the forward")
    for _, router in routers:
        router.last_stats = None
    weights = valid.reshape(-1).to(torch.float32)
    num_experts, top_k = routers[0][1].num_experts, routers[0][1].top_k
    slots = torch.zeros(num_experts, dtype=torch.float32, device=weights.device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=weights.device)
    for scores, selected in stats:
        if scores.shape[0] != weights.shape[0]:
            raise ValueError(f"moe aux loss: valid has {weights.shape[0]} tokens, the forward {scores.shape[0]}")
        slots = slots.index_add(0, selected.reshape(-1), weights.repeat_interleave(top_k))
        probs = probs + (scores * weights.unsqueeze(-1)).sum(dim=0)
    total = (weights.sum() * len(stats)).clamp(min=1.0)  # no real token: slots and probs are 0
    return num_experts * torch.sum((slots / total) * (probs / total))
