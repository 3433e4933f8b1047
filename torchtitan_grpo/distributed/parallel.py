"""Parallelise the policy model with TorchTitan's own ``parallelize_fn``.

The layout comes from the job config's ``[parallelism]`` section:

* ``data_parallel_shard_degree``: FSDP2;
* ``data_parallel_replicate_degree``: HSDP when combined with dp_shard > 1,
  otherwise DDP (TorchTitan's ``replicate``);
* ``tensor_parallel_degree``: TP with sequence parallelism;
* ``pipeline_parallel_degree``: PP, one stage per PP rank, built by
  :mod:`torchtitan_grpo.distributed.pipeline` (which applies the layout above to each
  stage through :func:`apply_layout`);
* ``expert_parallel_degree``: EP of MoE experts, its ranks borrowed from
  dp_shard (:mod:`torchtitan_grpo.distributed.expert_parallel`, which also runs MoE on
  CPU);
* ``context_parallel_degree``: CP, the sequence split over ranks
  (:mod:`torchtitan_grpo.distributed.context_parallel`);

and their products (HSDP, FSDP + TP, PP x FSDP/HSDP/TP, EP x FSDP/HSDP, CP x FSDP/HSDP).

On top of the train spec's ``parallelize_fn`` this module adds what a GRPO
step needs, and what TorchTitan 0.2.2 lacks, on CPU (gloo) above all:

* **Gradients are summed over data-parallel ranks, never averaged.** Each
  rank's loss is divided by the *global* sample/token count, so the sum of
  the ranks' gradients is the gradient of the whole batch, whatever the
  layout. TorchTitan already sets FSDP's divide factor to 1, which FSDP runs
  as ``PREMUL_SUM(1)``; gloo has no PREMUL_SUM, so FSDP modules are told to
  use plain SUM collectives (HSDP's all-reduce over replicas included). DDP
  (dp_replicate without dp_shard) averages over replicas and must keep doing
  so under gradient accumulation; the gradient flowing into the model is
  scaled by the replica count instead, which turns its average into the sum.
* **Tied embeddings** (qwen3 0.6B-4B, tied llama3): ``output.weight`` *is*
  ``tok_embeddings.weight``. torch >= 2.13 refuses a parameter in two FSDP
  groups, so ``tok_embeddings``, ``norm`` and ``output`` become one group.
  TP gives the two modules separate DTensor copies of the weight; they are
  tied again (same placements) before FSDP sees them.
* **qwen3 TP attention:** on CPU, DTensor has no sharding strategy for the
  CPU flash attention kernel; a head-sharded one (forward and backward) is
  registered when missing. On CUDA, fp32 GQA attention falls back to math,
  which DTensor cannot shard, so there attention runs on each rank's local
  heads (exact: heads are independent).
* **TP gradients** of TP-replicated parameters (sequence-parallel norms)
  come out of backward as ``Partial`` sums; they are reduced to their
  parameter's placements right away (torch 2.11's optimizer step on CUDA
  goes wrong with them; torch 2.13 on CPU copes either way).
* **CPU:** FSDP keeps float32 parameters (bf16 on CPU is slow and changes the
  numerics the parity tests check), and the device mesh is built on "cpu"
  (TorchTitan's device detection falls back to "cuda" on CPU builds).
* **No loss parallel:** the GRPO loss needs each token's log-probability,
  which loss parallel only provides inside cross-entropy; the output
  projection therefore returns replicated logits.

For ``world_size == 1`` only ``[activation_checkpoint]`` applies.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import sys
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_grpo import _titan  # noqa: F401  (before torchtitan)
from torchtitan_grpo.distributed import context_parallel, expert_parallel
from torchtitan_grpo.distributed.cpu_sdpa_sharding import register_cpu_sdpa_sharding
from torchtitan_grpo.config.pipeline import check_config

logger = logging.getLogger(__name__)

__all__ = ["apply_layout", "build_parallel_dims", "data_parallel_group", "data_parallel_rank_and_degree",
           "pad_to_multiple", "parallelize", "register_cpu_sdpa_sharding", "rope_len", "seq_len_multiple"]


# ------------------------------------------------------------------ meshes


@contextlib.contextmanager
def _swapped(owner: object, name: str, value: object) -> Iterator[None]:
    """Temporarily replace ``owner.name`` (a module global) by ``value``."""
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def build_parallel_dims(job_config, world_size: int, device: torch.device | str):
    """TorchTitan ``ParallelDims`` for ``[parallelism]``, mesh built on ``device``.

    With ``world_size == 1`` the mesh is not built (there is nothing to
    shard over and possibly no process group).
    """
    from torchtitan.distributed import parallel_dims as pd_module
    from torchtitan.distributed import ParallelDims

    p = job_config.parallelism
    ep, etp = expert_parallel.check_config(p, world_size)
    if p.pipeline_parallel_degree != 1:
        check_config(job_config, world_size)
    dims = ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=context_parallel.check_config(p, world_size),
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        ep=ep,
        etp=etp,
        world_size=world_size,
    )
    if world_size > 1:
        # ParallelDims builds its mesh on torchtitan.tools.utils.device_type,
        # which is "cuda" on a CPU-only torch; give it the real device type.
        with _swapped(pd_module, "device_type", torch.device(device).type):
            dims.build_mesh()
    return dims


def data_parallel_rank_and_degree(parallel_dims) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks and their number.

    Ranks that differ only in their TP or PP coordinate share an index: they
    must be given the same samples (the "batch" mesh spans dp_replicate x
    dp_shard only).
    """
    if parallel_dims is None or parallel_dims.world_size == 1:
        return 0, 1
    mesh = parallel_dims.get_optional_mesh("batch")
    if mesh is None:
        return 0, 1
    return mesh.get_local_rank(), mesh.size()


def data_parallel_group(parallel_dims) -> dist.ProcessGroup | None:
    """Process group over the data-parallel ranks (None with a single one).

    Sum per-rank metrics (losses, token counts) over this group, not over the
    world: TP ranks hold copies of the same numbers, and so do PP ranks once
    the last stage's numbers are broadcast over the pipeline.
    """
    if parallel_dims is None or parallel_dims.world_size == 1:
        return None
    mesh = parallel_dims.get_optional_mesh("batch")
    return None if mesh is None else mesh.get_group()


def seq_len_multiple(parallel_dims) -> int:
    """Token sequences fed to the model must have a length divisible by this.

    Sequence parallelism splits it over TP ranks, CP into ``2 * cp`` chunks (head-tail).
    On a GPU each CP chunk is also a multiple of 32 positions: the ring attention
    merges the memory-efficient kernel's log-sum-exp, which that kernel pads
    to 32 positions, with its own, and shorter chunks fail to broadcast
    (torch 2.11, a 2-GPU run of tests/test_context_parallel.py with 16-position chunks).
    """
    if parallel_dims is None or parallel_dims.world_size == 1:
        return 1
    if not parallel_dims.cp_enabled:
        return parallel_dims.tp
    divisor = parallel_dims.seq_len_divisor
    if torch.cuda.is_available():
        divisor = math.lcm(divisor, 2 * parallel_dims.cp * 32)
    return divisor


def rope_len(job_config) -> int:
    """Positions the model's RoPE cache covers: ``training.seq_len``, rounded
    up to what :func:`seq_len_multiple` pads a context-parallel micro-batch
    to on a GPU, so a padded row never indexes past the cache."""
    p = job_config.parallelism
    seq_len, cp = job_config.training.seq_len, p.context_parallel_degree
    if cp > 1 and torch.cuda.is_available():
        step = math.lcm(2 * cp * max(1, p.tensor_parallel_degree), 2 * cp * 32)
        return -(-seq_len // step) * step
    return seq_len


def pad_to_multiple(
    tokens: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    multiple: int,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad a packed ``[B, T]`` batch so that ``T % multiple == 0``.

    ``mask`` and ``old_logprobs`` (``[B, T - 1]``, one entry per predicting
    position) grow by the same amount with zeros: the new positions come
    after every real token, so causal attention leaves the real positions'
    logits unchanged and the loss does not see them.
    """
    extra = -tokens.shape[1] % multiple
    if extra == 0:
        return tokens, mask, old_logprobs
    pad = torch.nn.functional.pad
    return (
        pad(tokens, (0, extra), value=pad_id),
        pad(mask, (0, extra), value=0.0),
        pad(old_logprobs, (0, extra), value=0.0),
    )


# -------------------------------------------------------- DTensor attention


def _heads_to_local(module, args, kwargs):
    """Forward pre-hook: DTensor q/k/v sharded on heads -> local tensors."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    q, k, v = args[:3]
    if not isinstance(q, DTensor):
        module._grpo_heads_spec = None
        return None
    per_head = all(p == Replicate() or (isinstance(p, Shard) and p.dim == 1) for p in q.placements)
    same = all(isinstance(t, DTensor) and t.placements == q.placements for t in (k, v))
    if not (per_head and same):
        raise NotImplementedError(
            f"attention on DTensors placed {q.placements}/{k.placements}/{v.placements}; "
            "only head sharding (Shard(1)) or replication can run locally"
        )
    module._grpo_heads_spec = (q.device_mesh, q.placements)
    return (q.to_local(), k.to_local(), v.to_local(), *args[3:]), kwargs


def _heads_from_local(module, args, kwargs, output):
    """Forward hook: the local attention output back to a DTensor on heads."""
    from torch.distributed.tensor import DTensor

    spec = getattr(module, "_grpo_heads_spec", None)
    if spec is None:
        return None
    module._grpo_heads_spec = None
    mesh, placements = spec
    return DTensor.from_local(output, mesh, placements, run_check=False)


def _attend_on_local_heads(model: nn.Module) -> None:
    """Run TorchTitan's SDPA on each rank's own heads instead of through DTensor.

    qwen3's TP plan hands SDPA DTensor q/k/v sharded on heads. On CUDA,
    DTensor shards flash/efficient/cuDNN attention on heads, but with fp32
    activations (TorchTitan runs TP without FSDP unmixed) and GQA SDPA falls
    back to math, whose decomposition DTensor cannot shard. Attention is
    independent per head and TP keeps each rank's query heads with their
    key/value group, so computing on the local shards is exact for any
    kernel.
    """
    from torchtitan.models.attention import ScaledDotProductAttentionWrapper

    for m in model.modules():
        if isinstance(m, ScaledDotProductAttentionWrapper):
            m.register_forward_pre_hook(_heads_to_local, with_kwargs=True)
            m.register_forward_hook(_heads_from_local, with_kwargs=True)


def _settle_grad(param: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor

    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _settle_grad_placements(model: nn.Module) -> None:
    """Give every DTensor gradient its parameter's placements after backward.

    Under TP the parameters replicated over the TP mesh (sequence-parallel
    norms) receive ``Partial(sum)`` gradients. With torch 2.11 on CUDA the
    grad norm comes out right but clipping and AdamW then update those
    weights wrongly (measured: 3e-3 off after one step); torch 2.13 on CPU
    gets them right. Reducing them right after accumulation makes ``.grad``
    what every consumer expects, on any version.
    """
    from torch.distributed.tensor import DTensor

    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_post_accumulate_grad_hook(_settle_grad)


# --------------------------------------------------------- tied embeddings


def _is_tied(model: nn.Module) -> bool:
    emb, out = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    return emb is not None and out is not None and out.weight is emb.weight


def _retie(model: nn.Module) -> None:
    """Point ``output.weight`` at ``tok_embeddings.weight`` again.

    TP distributes each module's parameters separately, which unties them.
    Both become ``Shard(0)`` on the TP mesh (vocab rows), so the embedding's
    DTensor can serve as the output projection unchanged.
    """
    from torch.distributed.tensor import DTensor

    emb, out = model.tok_embeddings.weight, model.output.weight
    if out is emb:
        return
    same_layout = (
        isinstance(emb, DTensor)
        and isinstance(out, DTensor)
        and emb.device_mesh == out.device_mesh
        and emb.placements == out.placements
        and emb.shape == out.shape
    ) or (not isinstance(emb, DTensor) and not isinstance(out, DTensor))
    if not same_layout:
        raise RuntimeError(
            "cannot re-tie output.weight to tok_embeddings.weight: layouts differ "
            f"({getattr(out, 'placements', None)} vs {getattr(emb, 'placements', None)})"
        )
    model.output.weight = emb


class _TiedFullyShard:
    """Stands in for ``fully_shard`` inside TorchTitan's ``apply_fsdp`` while
    a tied model is parallelised.

    ``apply_fsdp`` shards ``tok_embeddings`` alone and ``[norm, output]``
    together. Here the embedding call is skipped and the embedding joins the
    ``[norm, output]`` group, placed first so the group unshards when the
    forward starts (as the embedding group would have). The tie broken by TP
    is restored before the first sharding.
    """

    def __init__(self, model: nn.Module, fully_shard):
        self.model = model
        self.fully_shard = fully_shard
        self.grouped = False

    def __call__(self, module, *args, **kwargs):
        _retie(self.model)
        if module is self.model.tok_embeddings:
            return module
        if isinstance(module, (list, tuple)) and any(m is self.model.output for m in module):
            module = [self.model.tok_embeddings, *module]
            self.grouped = True
        return self.fully_shard(module, *args, **kwargs)


def _fsdp_home(parallelize_fn):
    """The module whose ``fully_shard`` global the spec's ``apply_fsdp`` calls."""
    apply_fsdp = parallelize_fn.__globals__.get("apply_fsdp")
    owner = sys.modules.get(getattr(apply_fsdp, "__module__", ""), None)
    if owner is None or not hasattr(owner, "fully_shard"):
        raise RuntimeError(
            f"cannot find the apply_fsdp used by {parallelize_fn.__qualname__}; "
            "FSDP of tied embeddings needs it"
        )
    return owner


# ------------------------------------------------------ gradient reduction


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _undo_ddp_average(model: nn.Module, degree: int) -> None:
    """Turn DDP's average over ``degree`` replicas into a sum.

    DDP all-reduces the *accumulated* ``.grad`` after every backward, so with
    several micro-batches an already reduced gradient is reduced again. Only
    an average keeps that idempotent (a SUM hook would count the first
    micro-batches ``degree`` times), so DDP keeps averaging and the gradient
    entering the model (d loss / d logits) is scaled by ``degree`` instead.
    Every parameter gradient is linear in it, so DDP's average of the scaled
    gradients is exactly the sum over replicas.
    """

    def scale_output(_module, _args, output):
        return _ScaleGrad.apply(output, float(degree))

    model.register_forward_hook(scale_output)


def _sum_gradients_over_data_parallel(model: nn.Module, parallel_dims) -> None:
    """Make the data-parallel gradient reduction a plain SUM (module doc)."""
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            # FSDP reduce-scatters each backward's new gradient and adds it
            # to the sharded .grad, so a SUM is right across micro-batches.
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    if "replicate" in (_get_registry(model) or {}):
        _undo_ddp_average(model, parallel_dims.dp_replicate)


# ------------------------------------------------------------------ entry


def _job_config_for(job_config, parallel_dims, device: torch.device):
    """A copy of ``job_config`` with the settings this module overrides."""
    cfg = copy.deepcopy(job_config)
    if parallel_dims.tp_enabled and not cfg.parallelism.disable_loss_parallel:
        logger.info("parallelize: loss parallel off (GRPO needs per-token log-probs)")
        cfg.parallelism.disable_loss_parallel = True
    if device.type == "cpu":
        if cfg.training.mixed_precision_param != "float32":
            logger.info(
                "parallelize: training.mixed_precision_param=%s -> float32 on CPU",
                cfg.training.mixed_precision_param,
            )
        cfg.training.mixed_precision_param = "float32"
        cfg.training.mixed_precision_reduce = "float32"
    return cfg


def mixed_precision(job_config, parallel_dims, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The context a training forward runs in, by TorchTitan's rule
    (``maybe_enable_amp``): FSDP / HSDP compute in
    ``training.mixed_precision_param`` through their mixed-precision policy
    (nothing to add here); one device or DDP on a GPU through autocast to
    that dtype; TP or PP without FSDP, CPU, and ``"float32"`` in float32.
    Weights, gradients and optimizer state stay float32 in every case. (Until
    2026-11-27 one GPU trained in float32 whatever the key said.)"""
    device = torch.device(device)
    if device.type == "cpu" or job_config.training.mixed_precision_param == "float32":
        return contextlib.nullcontext()
    from torchtitan.distributed.utils import maybe_enable_amp

    return maybe_enable_amp(parallel_dims, job_config.training.mixed_precision_param, device.type)


def parallelize(model: nn.Module, job_config, world_size: int, device: torch.device | str):
    """Apply the ``[parallelism]`` layout to ``model`` in place.

    ``model`` is on ``device`` (FSDP and TP keep its values) or on meta
    (then allocate it with :func:`materialize` and load the weights afterwards: each rank then
    allocates only its shards). Call it on every rank, after the default process group is initialised.

    Returns ``(model, parallel_dims)``; ``parallel_dims`` is what TorchTitan's
    optimizer builder and :func:`data_parallel_rank_and_degree` expect. For
    ``world_size == 1`` only ``[activation_checkpoint]`` applies. With
    ``pipeline_parallel_degree > 1`` one module cannot hold the layout: use
    :func:`torchtitan_grpo.distributed.pipeline.build_pipeline`.
    """
    device = torch.device(device)
    if job_config.parallelism.pipeline_parallel_degree != 1:
        raise ValueError(
            f"parallelism.pipeline_parallel_degree={job_config.parallelism.pipeline_parallel_degree}: "
            "parallelize() returns one module; build the stages with "
            "torchtitan_grpo.distributed.pipeline.build_pipeline"
        )
    parallel_dims = build_parallel_dims(job_config, world_size, device)
    if world_size == 1:
        expert_parallel.prepare_model(model, None, device)  # MoE on CPU
        # TorchTitan applies AC in parallelize_fn, which one process never reaches
        if job_config.activation_checkpoint.mode != "none":
            from torchtitan.distributed.activation_checkpoint import apply_ac
            apply_ac(model, job_config.activation_checkpoint, base_folder=job_config.job.dump_folder)
        return model, parallel_dims
    return apply_layout(model, job_config, parallel_dims, device), parallel_dims


def apply_layout(model: nn.Module, job_config, parallel_dims, device: torch.device | str) -> nn.Module:
    """The non-pipeline part of the layout (FSDP / HSDP / DDP / TP) on ``model``.

    ``model`` is a whole model or one pipeline stage (a model whose missing
    modules are None, see :mod:`torchtitan_grpo.distributed.pipeline`); TorchTitan's
    ``parallelize_fn`` skips the modules a stage does not hold. Returns the
    parallelised module (the same object for TorchTitan's in-place
    wrappers).
    """
    from torchtitan.protocols.train_spec import get_train_spec

    device = torch.device(device)
    if parallel_dims.dp_replicate_enabled and parallel_dims.tp_enabled and not parallel_dims.dp_shard_enabled:
        raise NotImplementedError(
            "data_parallel_replicate_degree > 1 with tensor parallelism needs "
            "data_parallel_shard_degree > 1 too (HSDP + TP); DDP + TP is not supported"
        )

    expert_parallel.prepare_model(model, parallel_dims, device)
    context_parallel.prepare_model(model, parallel_dims, device)
    cfg = _job_config_for(job_config, parallel_dims, device)
    spec = get_train_spec(job_config.model.name)
    tied = _is_tied(model)
    if parallel_dims.tp_enabled and device.type == "cpu":
        register_cpu_sdpa_sharding()
    if parallel_dims.tp_enabled and device.type == "cuda":
        _attend_on_local_heads(model)

    with contextlib.ExitStack() as stack:
        shard = None
        if tied and parallel_dims.fsdp_enabled:
            home = _fsdp_home(spec.parallelize_fn)
            shard = _TiedFullyShard(model, home.fully_shard)
            stack.enter_context(_swapped(home, "fully_shard", shard))
        if any(child is None for child in model._modules.values()):
            # a pipeline stage: TP plan entries of the modules it does not hold are skipped, as meant
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", message="Parallelize plan key .* could not be resolved")
        model = spec.parallelize_fn(model, parallel_dims, cfg)
    if shard is not None and not shard.grouped:
        raise RuntimeError("tied embeddings: apply_fsdp never sharded the output module")
    if tied:
        _retie(model)
    if parallel_dims.tp_enabled:
        if any(p.is_meta for p in model.parameters()):
            # A hook on a meta parameter does not survive allocation on torch
            # 2.11 + CUDA (measured: PP x TP built on meta ended 3.7e-3 off
            # after one step, the same model loaded whole was exact), so
            # :func:`materialize` registers them once the tensors are real.
            model._grpo_settle_grads_pending = True
        else:
            _settle_grad_placements(model)
    _sum_gradients_over_data_parallel(model, parallel_dims)
    return model


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate a model parallelised on meta (``torchtitan_grpo.models.hf_bridge.materialize``)
    and finish what :func:`apply_layout` could not do on meta tensors."""
    from torchtitan_grpo.models import hf_bridge as hf_model

    hf_model.materialize(model, device)
    if getattr(model, "_grpo_settle_grads_pending", False):
        _settle_grad_placements(model)
        model._grpo_settle_grads_pending = False
    return model
