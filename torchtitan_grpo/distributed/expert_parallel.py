"""Expert parallelism (EP) for TorchTitan's MoE models, and MoE on CPU.

TorchTitan 0.2.2 does the parallelism itself: with
``parallelism.expert_parallel_degree > 1`` its ``ParallelDims`` builds a
"sparse" mesh ``(pp, dp_replicate, efsdp, ep, etp)`` whose ``ep`` dim borrows
its ranks from FSDP (``efsdp = dp_shard / ep`` here; TorchTitan can also
borrow TP ranks, which :func:`check_config` refuses), and
qwen3's ``parallelize_fn`` shards each layer's grouped experts over ``ep``
(``ExpertParallel``: tokens travel to their experts' ranks by all-to-all and
back) and FSDP-wraps them over ``efsdp`` (always wrapped under EP, even at
size 1). Dense weights keep the dense mesh (FSDP over ``dp_shard``, TP).
This module decides which combinations the GRPO trainer runs
(:func:`check_config`, :func:`check_model`) and adds what MoE lacks on a CPU:

* **Token permutation.** After the all-to-all, ``_permute`` reorders the
  received tokens expert by expert with ``generate_permute_indices``, a triton
  kernel (``torchtitan/models/moe/kernels.py``, which CPU machines replace by
  a stub, see ``_titan``). :func:`install_token_permutation` puts
  :func:`permute_indices`, the same indices computed with plain torch ops, in
  its place for tensors not on CUDA; CUDA tensors keep the kernel.
* **Token counts.** The router and the reorderer count tokens per expert
  with ``torch.histc`` on int64 expert indices, which has no CPU kernel
  ("histogram_cpu" not implemented for 'Long'). On CPU each MoE forward runs
  under :class:`IntegerHistc`, which answers those calls with the same counts
  from ``torch.bincount`` (same dtype, as CUDA's histc returns).
* **Expert matmuls.** ``torch._grouped_mm`` computes in bf16 (TorchTitan casts
  to it), slow on CPU and far from fp32; CPU models use TorchTitan's own
  for-loop over experts (``use_grouped_mm = False``), exact in fp32.

Gradients need nothing here: an expert's rank receives every token routed to
it (the all-to-all's backward returns the input gradients), so its gradient is
already the sum over the data-parallel ranks' tokens; FSDP over ``efsdp`` sums
as ``parallel`` makes every FSDP group do.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from torchtitan_grpo import _titan  # noqa: F401  (before torchtitan)

logger = logging.getLogger(__name__)

__all__ = ["IntegerHistc", "check_config", "check_model", "enable_cpu_moe", "install_token_permutation",
           "moe_layers", "permute_indices", "prepare_model"]


# ------------------------------------------------------------------ config


def check_config(p, world_size: int) -> tuple[int, int]:
    """``(ep, etp)`` for TorchTitan's ``ParallelDims`` from ``[parallelism]``
    (``p``), or one line naming the key the trainer cannot run.

    Supported: EP borrowing its ranks from FSDP (``data_parallel_shard_degree``),
    with HSDP replicas around it. Not: EP with TP (TorchTitan's EP then borrows
    TP ranks, with wrong router gradients), expert tensor parallelism
    (``expert_tensor_parallel_degree``), EP with pipeline stages (untested
    with the trainer's own stage split). CP: :mod:`torchtitan_grpo.distributed.context_parallel`.
    """
    ep, etp = p.expert_parallel_degree, p.expert_tensor_parallel_degree
    if ep < 1:
        raise ValueError(f"parallelism.expert_parallel_degree={ep}: must be >= 1")
    if etp != 1:
        raise NotImplementedError(
            f"parallelism.expert_tensor_parallel_degree={etp}: expert weights are not TP-sharded by the "
            "GRPO trainer; leave it 1 (EP may still borrow the TP ranks)")
    if ep == 1:
        return 1, 1
    if p.pipeline_parallel_degree != 1:
        raise NotImplementedError(
            f"parallelism.expert_parallel_degree={ep} with parallelism.pipeline_parallel_degree="
            f"{p.pipeline_parallel_degree}: EP with pipeline stages is not supported yet")
    if p.tensor_parallel_degree != 1:
        # TorchTitan's EP then spans TP ranks and splits the tokens over them
        # (ReordererSequenceParallel); the router's replicated gradient keeps
        # only each rank's share of the tokens (measured against one process:
        # gate gradients 6e-3 off, loss exact).
        raise NotImplementedError(
            f"parallelism.expert_parallel_degree={ep} with parallelism.tensor_parallel_degree="
            f"{p.tensor_parallel_degree}: TorchTitan 0.2.2 gives wrong router gradients when EP borrows "
            "TP ranks; borrow them from data_parallel_shard_degree")
    dp_shard = p.data_parallel_shard_degree
    if dp_shard < 0:  # TorchTitan's -1: the ranks the other degrees leave
        dp_shard = world_size // p.data_parallel_replicate_degree
    if dp_shard % ep:
        raise ValueError(
            f"parallelism.expert_parallel_degree={ep} must divide parallelism.data_parallel_shard_degree "
            f"({dp_shard}): EP borrows its ranks from FSDP")
    return ep, etp


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The MoE modules of ``model`` (TorchTitan's ``MoE`` and subclasses)."""
    from torchtitan.models.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


def check_model(model: nn.Module, ep: int, tp: int = 1) -> None:
    """Refuse EP for a model it cannot shard: one without MoE layers, or
    whose expert count ``ep`` does not divide (TorchTitan's dispatch gives
    every EP rank ``num_experts / ep`` experts). Refuse TP for MoE layers
    that weight the experts' outputs (``score_before_experts=False``, Qwen3-MoE):
    TorchTitan 0.2.2's MoE TP leaves each TP rank's router gradient partial
    and calls it replicated (measured: gate gradients 7e-3 off; exact with
    the scores applied before the experts)."""
    layers = moe_layers(model)
    if tp > 1 and any(not m.score_before_experts for m in layers):
        raise NotImplementedError(
            f"parallelism.tensor_parallel_degree={tp}: MoE layers that score after the experts "
            "(Qwen3-MoE) get wrong router gradients under TorchTitan 0.2.2's MoE TP; use FSDP/EP")
    if ep == 1:
        return
    if not layers:
        raise ValueError(
            f"parallelism.expert_parallel_degree={ep}: the model has no MoE layers "
            "(a dense checkpoint); leave it 1")
    experts = {m.experts.num_experts for m in layers}
    bad = sorted(n for n in experts if n % ep)
    if bad:
        raise ValueError(
            f"parallelism.expert_parallel_degree={ep} must divide the number of experts ({bad[0]})")


def prepare_model(model: nn.Module, parallel_dims, device: torch.device | str) -> None:
    """What a model needs before TorchTitan's ``parallelize_fn`` (or, in one
    process, before its first forward): the EP / TP checks, and on CPU the
    CPU paths of its MoE layers. ``parallel_dims`` None: one process."""
    if parallel_dims is not None:
        check_model(model, parallel_dims.ep, parallel_dims.tp)
    if torch.device(device).type != "cuda":
        enable_cpu_moe(model)


# ---------------------------------------------------------- CPU: counting


def _integer_histc(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """``torch.histc`` of an integer tensor (histc's rules: equal ``min`` and
    ``max`` mean the data's range, values outside are dropped, ``max`` falls
    in the last bin), in ``x``'s dtype."""
    lo, hi = float(min), float(max)
    if lo == hi:
        lo, hi = (float(x.min()), float(x.max())) if x.numel() else (0.0, 0.0)
        if lo == hi:
            lo, hi = lo - 1, hi + 1
    values = x.reshape(-1).double()
    values = values[(values >= lo) & (values <= hi)]
    index = ((values - lo) * bins / (hi - lo)).floor().long().clamp_(max=bins - 1)
    return torch.bincount(index, minlength=bins).to(x.dtype)


class IntegerHistc(TorchFunctionMode):
    """Answers ``torch.histc`` on integer CPU tensors, which torch cannot
    ("histogram_cpu" not implemented for 'Long'); every other call passes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.histc and args and not args[0].is_floating_point() and args[0].device.type == "cpu":
            return _integer_histc(*args, **kwargs)
        return func(*args, **kwargs)


def _counting_on_cpu(forward):
    def run(*args, **kwargs):
        with IntegerHistc():
            return forward(*args, **kwargs)

    run._grpo_integer_histc = True
    return run


def enable_cpu_moe(model: nn.Module) -> int:
    """Let ``model``'s MoE layers run on a CPU (module docstring): counts
    through :class:`IntegerHistc`, experts in TorchTitan's fp32 for-loop, the
    EP permutation in plain torch. Idempotent; returns the number of MoE
    layers."""
    layers = moe_layers(model)
    for moe in layers:
        if not getattr(moe.forward, "_grpo_integer_histc", False):
            moe.forward = _counting_on_cpu(moe.forward)
        moe.experts.use_grouped_mm = False
    if layers:
        install_token_permutation()
        logger.info("MoE on CPU: %d layers count with bincount and run experts in an fp32 loop", len(layers))
    return len(layers)


# ------------------------------------------------------- CPU: permutation


def permute_indices(
    tokens_per_expert_group: torch.Tensor,
    experts_per_rank: int,
    num_ranks: int,
    max_len: int,
    alignment: int,
    use_cpu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``generate_permute_indices`` in plain torch ops, same arguments and results.

    ``tokens_per_expert_group[r * experts_per_rank + e]`` tokens arrived from
    EP rank ``r`` for local expert ``e``, rank by rank, expert by expert. The
    result lists, expert by expert and within an expert rank by rank, the
    position of each token in that arrival order; each expert's group is
    padded with -1 (the zero row ``_permute`` appends) to a multiple of
    ``alignment``, at least ``alignment`` long, and the list to ``max_len``.
    Returns ``(indices int32 [max_len], padded sizes int32 [experts_per_rank],
    their cumulative sums)``. ``use_cpu`` is accepted for the signature's sake.
    """
    counts = tokens_per_expert_group.reshape(num_ranks, experts_per_rank).long()
    flat = counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # where each (rank, expert) run begins on arrival
    totals = counts.sum(0).clamp_min(alignment)
    m_sizes = ((totals + alignment - 1) // alignment * alignment).to(torch.int32)
    m_offsets = torch.cumsum(m_sizes, 0, dtype=torch.int32)
    # where each (rank, expert) run goes: its expert's group, after the lower ranks' runs
    dst = (m_offsets - m_sizes).long().unsqueeze(0) + (torch.cumsum(counts, 0) - counts)
    run = torch.repeat_interleave(torch.arange(flat.numel(), device=flat.device), flat)
    arrival = torch.arange(run.numel(), device=flat.device)
    out = torch.full((max_len,), -1, dtype=torch.int32, device=flat.device)
    out[dst.reshape(-1)[run] + arrival - starts[run]] = arrival.to(torch.int32)
    return out, m_sizes, m_offsets


def install_token_permutation() -> None:
    """Route TorchTitan's ``generate_permute_indices`` (looked up by
    ``models.moe.utils._permute`` at call time) to :func:`permute_indices`
    for tensors off CUDA; CUDA tensors keep the triton kernel. Idempotent."""
    from torchtitan.models.moe import utils

    current = utils.generate_permute_indices
    if getattr(current, "_grpo_dispatch", False):
        return
    kernel = current

    def generate(tokens_per_expert_group, *args, **kwargs):
        if tokens_per_expert_group.is_cuda:
            return kernel(tokens_per_expert_group, *args, **kwargs)
        return permute_indices(tokens_per_expert_group, *args, **kwargs)

    generate._grpo_dispatch = True
    utils.generate_permute_indices = generate
