"""Pipeline parallelism (PP) for the GRPO trainer: one stage per PP rank.

``parallelism.pipeline_parallel_degree = N`` cuts the model (qwen3 or llama3)
into N consecutive stages, ``tok_embeddings`` first and ``norm`` + ``output``
last, and every PP rank keeps only its own stage. TorchTitan 0.2.2 has a
pipelining function for llama3 only; it deep-copies the whole model per stage
and builds one schedule whose stages keep the activation shapes of the first
batch (its batches are always ``training.seq_len`` long). Here, instead:

* **The split is done in place** (:func:`split_stage`): the modules of other
  stages are dropped from the loaded model (``None`` for ``tok_embeddings`` /
  ``norm`` / ``output``, deleted entries of the ``layers`` ModuleDict), which
  both models' ``forward`` skips. A stage keeps the original parameter FQNs
  (``layers.3.attention.wq.weight``), so the state-dict adapter maps them to
  HF names as for the whole model, and TorchTitan's ``parallelize_fn`` then
  applies FSDP / HSDP / TP to the stage over the non-PP mesh dims
  (:func:`torchtitan_grpo.distributed.parallel.apply_layout`). Which modules each stage
  holds follows TorchTitan's own keys: ``module_fqns_per_model_part``, or
  ``generate_llm_fqn_per_model_part`` with the first/last stage weights.
* **GRPO batches change shape every step** (number of samples per rank,
  longest sequence). A ``PipelineStage`` learns its activation shapes at its
  first step and keeps them, so a schedule is built per
  ``(micro-batches, batch shape)`` and the few most recent are kept
  (:meth:`StagePipeline.schedule_for`); the trainer pads sequence lengths to
  a few buckets (:func:`bucketed_seq_len`) so that shapes repeat. Every rank
  must step the same shape at the same time (the first step of a new
  schedule infers shapes with real forward passes, and FSDP/TP collectives
  run in them): the trainer agrees on it over the world first.
* **Schedules**: ``1F1B`` and ``GPipe`` (single-stage schedules); the loss
  function runs on the last stage once per micro-batch, with
  ``scale_grads=False`` (the GRPO loss is already normalised by the global
  sample/token counts, so micro-batch losses are summed, never averaged).
* **Tied embeddings** (qwen3 or llama3 with ``tie_word_embeddings``): the first stage
  holds ``tok_embeddings.weight`` and the last ``output.weight``, two copies
  of one parameter. After backward their gradients are exchanged and summed
  (:meth:`StagePipeline.sync_tied_gradients`), so both copies get the
  gradient of the single parameter and the same optimizer update; the grad
  norm counts the pair once (:meth:`StagePipeline.split_mirrored`).

Where the weights are (for the weight push and exports): on a PP rank,
``Policy.model`` (= ``Policy.model_parts[0]`` = ``Policy.pipeline.module``)
is its stage; its ``state_dict()`` / ``named_parameters()`` hold only that
stage's parameters, under the whole model's FQNs (FSDP/TP shards as
DTensors, as without PP), and ``hf_state_dict(stage, adapter)`` gives that
stage's HF tensors; the union over the stages is the whole model's (with
tied embeddings the last stage's ``output.weight`` maps to nothing: HF has
no ``lm_head.weight`` then). Stage ``Policy.pipeline.stage_index`` is the
rank's coordinate on ``Policy.pipeline.pp_mesh`` (TorchTitan's "pp" mesh).

With CP (``parallelism.context_parallel_degree``) each CP rank feeds its
share of the sequence; the stages' RoPE positions come from the step (the
schedule passes activations only) and the last stage's loss gathers whole
sequences (:func:`torchtitan_grpo.distributed.context_parallel.pipeline_terms`).

Not supported under PP (rejected by :func:`check_config` with the key named):
other schedules (interleaved/looped ones need several stages per rank), CSV
schedules, DDP without dp_shard (TorchTitan's composable ``replicate`` is
neither an FSDP module nor a ``DistributedDataParallel``, the two kinds whose
gradient sync a pipeline stage defers to the end of the step, and the DDP
sum fix of :mod:`torchtitan_grpo.distributed.parallel` scales a whole model's output),
and the KL penalty (its reference model would need a pipeline of its own).
"""

from __future__ import annotations

import functools
import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_grpo import _titan  # noqa: F401  (before torchtitan)
from torchtitan_grpo.distributed import parallel
from torchtitan_grpo.config.pipeline import SCHEDULES, check_config, schedule_class

logger = logging.getLogger(__name__)

__all__ = [
    "SCHEDULES",
    "StagePipeline",
    "bucketed_seq_len",
    "build_pipeline",
    "check_config",
    "split_stage",
    "stage_module_names",
]

_MAX_CACHED_SCHEDULES = 4
"""Schedules (with their stage's activation buffers) kept per rank."""

_SEQ_LEN_BUCKETS = 8
"""Padded sequence lengths are multiples of ``training.seq_len / this``."""

_TOP_LEVEL = ("tok_embeddings", "layers", "norm", "output")
"""The children of TorchTitan's dense qwen3 and llama3 ``Transformer``."""


def stage_module_names(job_config, n_layers: int) -> list[list[str]]:
    """The top-level module FQNs of each stage, one list per PP rank.

    ``parallelism.module_fqns_per_model_part`` if set; otherwise TorchTitan's
    ``generate_llm_fqn_per_model_part`` with the first/last stage weights (and
    ``pipeline_parallel_layers_per_stage``, which must then give exactly one
    stage per rank). Every module must appear once, in forward order.
    """
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    p = job_config.parallelism
    pp = p.pipeline_parallel_degree
    names = p.module_fqns_per_model_part
    key = "parallelism.module_fqns_per_model_part"
    if names is None:
        key = ("parallelism.pipeline_parallel_first_stage_less_layers / "
               "pipeline_parallel_last_stage_less_layers")
        first, last = p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers
        per_stage = p.pipeline_parallel_layers_per_stage
        if per_stage is not None and math.ceil((n_layers + first + last) / per_stage) != pp:
            raise ValueError(
                f"parallelism.pipeline_parallel_layers_per_stage={per_stage} gives "
                f"{math.ceil((n_layers + first + last) / per_stage)} stages for {n_layers} layers; "
                f"the GRPO trainer runs exactly one stage per PP rank ({pp})"
            )
        names = generate_llm_fqn_per_model_part(pp, n_layers, first, last)
    names = [list(part) for part in names]
    canonical = ["tok_embeddings", *(f"layers.{i}" for i in range(n_layers)), "norm", "output"]
    if len(names) != pp or any(not part for part in names):
        raise ValueError(f"{key}: needs {pp} non-empty stages (one per PP rank), got {names}")
    if [n for part in names for n in part] != canonical:
        raise ValueError(
            f"{key}: the stages must hold {canonical[0]}, layers.0..{n_layers - 1}, norm, output "
            f"in this order, each exactly once; got {names}"
        )
    return names


# ------------------------------------------------------------------- split


def split_stage(model: nn.Module, keep: list[str]) -> nn.Module:
    """Reduce ``model`` in place to the top-level modules named in ``keep``.

    ``layers.<i>`` entries are deleted from the ``layers`` ModuleDict (the
    others keep their keys, hence their FQNs); ``tok_embeddings``, ``norm``
    and ``output`` become None, which TorchTitan's forward and parallelize
    functions skip. Returns ``model``.
    """
    children = {name for name, _ in model.named_children()}
    if children != set(_TOP_LEVEL):
        raise ValueError(
            f"cannot split {type(model).__name__} into pipeline stages: expected children "
            f"{sorted(_TOP_LEVEL)}, found {sorted(children)}"
        )
    wanted = set(keep)
    for key in list(model.layers.keys()):
        if f"layers.{key}" not in wanted:
            del model.layers[key]
    for name in ("tok_embeddings", "norm", "output"):
        if name not in wanted:
            setattr(model, name, None)
    return model


def bucketed_seq_len(length: int, max_seq_len: int, multiple: int = 1) -> int:
    """The padded sequence length of a pipelined batch whose longest is ``length``.

    A multiple of ``max_seq_len / 8`` (and of ``multiple``, the TP degree
    for sequence parallelism), capped at ``max_seq_len``: at most a handful of
    shapes, hence of schedules to build, at the cost of some padding.
    """
    bucket = math.ceil(max(1, math.ceil(max_seq_len / _SEQ_LEN_BUCKETS)) / multiple) * multiple
    padded = math.ceil(length / bucket) * bucket
    if length <= max_seq_len < padded and max_seq_len % multiple == 0:
        padded = max_seq_len
    return padded


# ---------------------------------------------------------------- pipeline


@dataclass
class StagePipeline:
    """This rank's pipeline stage and how to run the pipeline over it."""

    module: nn.Module
    """The stage (FSDP/TP applied); ``Policy.model`` on this rank."""
    stage_index: int
    """Index of the stage in the pipeline; equals this rank's PP coordinate."""
    num_stages: int
    pp_mesh: object
    """TorchTitan's 1-D "pp" DeviceMesh (``parallel_dims.get_mesh("pp")``)."""
    device: torch.device
    schedule_class: type
    loss_fn: Callable
    """``loss_fn(stage_output, target) -> scalar`` run on the last stage per micro-batch."""
    module_names: list[list[str]]
    """Top-level module FQNs of every stage (index = stage)."""
    tied: bool = False
    """The model's ``output.weight`` is its ``tok_embeddings.weight``: the first
    and the last stage each hold a copy, kept equal."""
    positions: torch.Tensor | None = None
    """CP: this rank's ``[1, T / cp]`` sequence positions of the step's batch,
    given to every stage's RoPE (:meth:`step` sets it); None without CP."""
    _schedules: OrderedDict = field(default_factory=OrderedDict, repr=False)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.pp_mesh.get_group()

    def global_rank(self, stage_index: int) -> int:
        """The global rank holding ``stage_index`` in this rank's pipeline."""
        return dist.get_global_rank(self.pp_group, stage_index)

    # ------------------------------------------------------- schedules

    def schedule_for(self, n_microbatches: int, batch_shape: tuple[int, ...]):
        """A schedule over ``n_microbatches`` micro-batches of a ``batch_shape`` batch.

        Built on first use (its stage infers activation shapes at its first
        step), kept among the most recent few. Every rank of the world must
        ask for the same key in the same step.
        """
        from torch.distributed.pipelining import PipelineStage

        key = (n_microbatches, tuple(batch_shape))
        schedule = self._schedules.pop(key, None)
        if schedule is None:
            stage = PipelineStage(self.module, self.stage_index, self.num_stages, self.device,
                                  group=self.pp_group)
            schedule = self.schedule_class(stage, n_microbatches=n_microbatches, loss_fn=self.loss_fn,
                                           scale_grads=False)
            logger.debug("pipeline stage %d: new %s for %d micro-batches of %s", self.stage_index,
                         self.schedule_class.__name__, n_microbatches, key[1])
        self._schedules[key] = schedule
        while len(self._schedules) > _MAX_CACHED_SCHEDULES:
            self._schedules.popitem(last=False)
        return schedule

    def step(self, tokens: torch.Tensor, target: torch.Tensor | None, n_microbatches: int,
             positions: torch.Tensor | None = None) -> None:
        """Forward and backward of one batch through the pipeline.

        Every PP rank passes the same ``tokens`` (only the first stage feeds
        them to the model; the others use the shape) and ``target`` (used by
        the last stage's ``loss_fn``); gradients accumulate in the stage's
        parameters.
        """
        schedule = self.schedule_for(n_microbatches, tuple(tokens.shape))
        self.positions = positions
        args = (tokens,) if self.is_first else ()
        schedule.step(*args, target=target if self.is_last else None, return_outputs=False)

    # ------------------------------------------------------ after backward

    def _tied_param(self) -> nn.Parameter | None:
        if not self.tied:
            return None
        if self.is_first:
            return self.module.tok_embeddings.weight
        if self.is_last:
            return self.module.output.weight
        return None

    @torch.no_grad()
    def sync_tied_gradients(self) -> None:
        """First and last stage: each adds the other's gradient of the tied
        weight to its own, so both hold the single-model gradient.

        Both stages lay the weight out alike (vocab rows: FSDP ``Shard(0)``,
        TP ``Shard(0)``), so the rank with the same non-PP coordinates holds
        the matching local shard. ``a + b`` and ``b + a`` are the same
        floats, so the copies stay bit-identical through the optimizer.
        """
        param = self._tied_param()
        if param is None:
            return
        if param.grad is None:
            raise RuntimeError(f"pipeline stage {self.stage_index}: the tied embedding has no gradient")
        grad = param.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        send = local.contiguous()
        recv = torch.empty_like(send)
        peer = self.global_rank(self.num_stages - 1 if self.is_first else 0)
        ops = [dist.P2POp(dist.isend, send, peer, self.pp_group),
               dist.P2POp(dist.irecv, recv, peer, self.pp_group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        local.add_(recv)

    def split_mirrored(self, params: list[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """``(counted, mirrors)``: the parameters the grad norm counts, and the
        last stage's copy of a tied weight (its gradient equals the first
        stage's, so it is clipped by the same norm but not counted twice)."""
        mirror = self._tied_param() if self.is_last else None
        counted = [p for p in params if p is not mirror]
        return counted, [p for p in params if p is mirror]

    @torch.no_grad()
    def broadcast_from_last_stage(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` of the last stage on every stage of this rank's pipeline
        (the loss and its metrics are computed there only)."""
        dist.broadcast(values, src=self.global_rank(self.num_stages - 1), group=self.pp_group)
        return values


def build_pipeline(model: nn.Module, job_config, parallel_dims, device: torch.device | str,
                   loss_fn: Callable) -> StagePipeline:
    """Cut ``model`` to this rank's stage and apply the rest of the layout.

    ``model``: the whole TorchTitan model with its weights loaded on
    ``device``; it is reduced in place (the other stages' modules are
    released). ``parallel_dims`` from
    :func:`torchtitan_grpo.distributed.parallel.build_parallel_dims` (with its mesh).
    ``loss_fn(stage_output, target)`` is the last stage's per-micro-batch loss.
    """
    device = torch.device(device)
    pp_mesh = parallel_dims.get_mesh("pp")
    stage_index = pp_mesh.get_local_rank()
    names = stage_module_names(job_config, len(model.layers))
    tied = parallel._is_tied(model)
    stage = split_stage(model, names[stage_index])
    stage = parallel.apply_layout(stage, job_config, parallel_dims, device)
    schedule_cls = schedule_class(job_config.parallelism.pipeline_parallel_schedule)
    logger.info("pipeline stage %d of %d (%s): %s", stage_index, parallel_dims.pp, schedule_cls.__name__,
                names[stage_index])
    pipe = StagePipeline(stage, stage_index, parallel_dims.pp, pp_mesh, device, schedule_cls, loss_fn, names, tied)
    if parallel_dims.cp_enabled:  # the schedule passes activations only: positions come from the step
        stage.register_forward_pre_hook(functools.partial(_stage_positions, pipe), with_kwargs=True)
    return pipe


def _stage_positions(pipe: StagePipeline, _module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """CP x PP: the step's sequence positions (one row) for this micro-batch's rows."""
    if pipe.positions is not None:
        kwargs = {**kwargs, "positions": pipe.positions.expand(args[0].shape[0], -1)}
    return args, kwargs
