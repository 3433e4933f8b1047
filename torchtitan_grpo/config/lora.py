"""The ``[lora]`` section: low-rank adapters on a frozen base.

Kept out of ``config/job_config.py`` (one job per module): the dataclass merged into
TorchTitan's JobConfig and its start-up checks, each naming its key. The
adapters themselves are :mod:`torchtitan_grpo.lora.adapters`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# TorchTitan's names of the dense projections an adapter may sit on
# (attention.wq/wk/wv/wo, feed_forward.w1/w2/w3; HF: q/k/v/o_proj, gate/down/up_proj).
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


@dataclass
class LoRA:
    """Train low-rank adapters instead of the full weights: every targeted
    projection computes ``W x + (alpha / rank) * B A dropout(x)`` with ``W``
    frozen and out of the optimizer, ``A`` ``[rank, in]`` and ``B``
    ``[out, rank]`` (zero at start, so step 0 is the base model) trained.

    Inference servers receive merged full weights (``W + (alpha / rank) B A``)
    under the usual HF names, so every backend works unchanged, or with
    ``weight_sync.lora_push = "adapter"`` only the adapter, through the
    engines' LoRA routes (``weight_sync.adapter_push``). The HF export holds the merged model and,
    in ``lora_adapter/``, the adapter in the format peft loads. One trainer
    process or data-parallel layouts (FSDP2, HSDP, DDP); not TP, PP, CP or EP."""

    enable: bool = False
    """Train adapters on a frozen base instead of the full weights."""

    rank: int = 16
    """Rank ``r`` of every adapter (rows of ``A``, columns of ``B``)."""

    alpha: float = 32.0
    """Scale numerator: the adapter's output is multiplied by ``alpha / rank``."""

    dropout: float = 0.0
    """Dropout probability on the adapter's input (training only; the base path never drops)."""

    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Projections that get an adapter, by TorchTitan name: any of wq, wk, wv,
    wo (attention) and w1, w2, w3 (SwiGLU feed-forward), in every layer. A
    TOML list, or comma-separated on the command line (``--lora.target_modules wq,wv``)."""

    base_dtype: str = "float32"
    """dtype of the adapted projections' frozen weights: "float32" (the
    trainer's master dtype) or "bfloat16" (half their memory; they are never
    updated, so no master copy is needed). ``A`` and ``B``, their gradients
    and optimizer state stay float32; merged pushes are computed in float32."""


def validate_lora(cfg, check) -> None:
    """Start-up checks of ``[lora]``; ``check(ok, key, msg, value)`` raises ConfigError."""
    lo = cfg.lora
    push = getattr(getattr(cfg, "weight_sync", None), "lora_push", "merged")
    check(push in ("merged", "adapter"), "weight_sync.lora_push", 'must be "merged" or "adapter"', push)
    if not lo.enable:
        check(push == "merged", "weight_sync.lora_push", '"adapter" needs lora.enable = true (there is no adapter '
              "to push)", push)
        return
    if push == "adapter":
        check(cfg.weight_sync.mode != "off", "weight_sync.lora_push", '"adapter" with weight_sync.mode = "off" '
              "pushes nothing", push)
    check(lo.rank >= 1, "lora.rank", "must be >= 1", lo.rank)
    check(lo.alpha > 0, "lora.alpha", "must be > 0", lo.alpha)
    check(0 <= lo.dropout < 1, "lora.dropout", "must be in [0, 1)", lo.dropout)
    check(bool(lo.target_modules), "lora.target_modules", f"must name at least one of {list(LORA_TARGETS)}",
          lo.target_modules)
    unknown = [m for m in lo.target_modules if m not in LORA_TARGETS]
    check(not unknown, "lora.target_modules", f"unknown {unknown}: the TorchTitan projections are "
          f"{list(LORA_TARGETS)}", lo.target_modules)
    check(len(set(lo.target_modules)) == len(lo.target_modules), "lora.target_modules", "repeats a name",
          lo.target_modules)
    base_dtype = getattr(lo, "base_dtype", "float32")
    check(base_dtype in ("float32", "bfloat16"), "lora.base_dtype", 'must be "float32" or "bfloat16"', base_dtype)
    p = cfg.parallelism
    for key in ("context_parallel_degree", "expert_parallel_degree"):
        degree = getattr(p, key, 1)
        check(degree == 1, "lora.enable", f"is not supported with parallelism.{key} = {degree} (one process, FSDP2, "
              "HSDP, DDP, TP or PP only; docs/LORA.md)", lo.enable)
    pp, tp = getattr(p, "pipeline_parallel_degree", 1), getattr(p, "tensor_parallel_degree", 1)
    check(tp == 1 or pp == 1, "lora.enable", f"is not supported with parallelism.tensor_parallel_degree = {tp} and "
          f"pipeline_parallel_degree = {pp} together (docs/LORA.md)", lo.enable)
    check(tp == 1 or lo.dropout == 0, "lora.dropout", f"must be 0 with parallelism.tensor_parallel_degree = {tp} "
          "(the dropout mask would differ between TP ranks)", lo.dropout)
    check(not cfg.checkpoint.last_save_in_hf, "checkpoint.last_save_in_hf",
          "cannot be used with lora.enable (TorchTitan's HF save would write the unmerged base): use "
          "checkpoint.hf_export, which writes the merged model and the peft adapter", cfg.checkpoint.last_save_in_hf)
