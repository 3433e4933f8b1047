"""The policy's model on this rank: TorchTitan's model built from an HF
checkpoint under the config's layout, with LoRA's adapters where ``[lora]``
asks for them.

Three ways to build, by layout (``[parallelism]``):

- **One process, FSDP / HSDP / DDP / TP** (:func:`_sharded`): built on meta,
  parallelised, then allocated and loaded, so a rank's memory only ever holds
  its shards. LoRA on several ranks injects the adapters on meta first
  (``fully_shard`` must see them in the blocks it wraps; ``lora_sharded``),
  with their own TP placements (``lora_tp``); on one process they are put on
  the loaded base (``lora.apply_lora``).
- **PP, untied checkpoint** (:func:`_pipeline`): cut to this rank's stage on
  meta, then the stage's tensors allocated and loaded; LoRA's adapters are
  injected on the whole model first so that every stage draws the one-process
  values (``lora_pp``).
- **PP, tied checkpoint** (:func:`_tied_pipeline`, Qwen3 <= 4B, tied Llama):
  loaded whole, then each rank keeps its stage (the first and the last both
  start from the embedding).

Gradients are summed over data-parallel ranks in every layout
(:mod:`torchtitan_grpo.distributed.parallel`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from torchtitan_grpo.lora import adapters as lora, pp as lora_pp, sharded as lora_sharded, tp as lora_tp
from torchtitan_grpo.models import hf_bridge as hf_model
from torchtitan_grpo.distributed import parallel
from torchtitan_grpo.distributed import pipeline as pipeline_parallel

DTYPE = torch.float32
"""Master weights; bf16 compute on GPUs: FSDP's mixed precision, else autocast (amp)."""


def build(job_config, model_args, adapter, hf_dir: str, d, pipeline_loss) -> tuple[torch.nn.Module, Any, Any]:
    """``(model, parallel_dims, pipe)`` of this rank (``pipe`` None without PP);
    ``d`` the trainer's Dist, ``pipeline_loss`` the PP schedule's loss."""
    lora_cfg = getattr(job_config, "lora", None)
    if lora_cfg is not None and not lora_cfg.enable:
        lora_cfg = None
    if lora_cfg is not None:
        lora.check_layout(job_config.parallelism)
    if job_config.parallelism.pipeline_parallel_degree > 1:
        # PP settings fail here, before any weight is loaded
        parallel_dims = parallel.build_parallel_dims(job_config, d.world_size, d.device)
        pipeline_parallel.stage_module_names(job_config, model_args.n_layers)
        build_pp = _tied_pipeline if getattr(model_args, "enable_weight_tying", False) else _pipeline
        model, pipe = build_pp(job_config, model_args, adapter, hf_dir, d, parallel_dims, pipeline_loss, lora_cfg)
        return model, parallel_dims, pipe
    model, parallel_dims = _sharded(job_config, model_args, adapter, hf_dir, d, lora_cfg)
    return model, parallel_dims, None


def _sharded(job_config, model_args, adapter, hf_dir: str, d, lora_cfg):
    name = job_config.model.name
    sharded_lora = lora_cfg is not None and d.world_size > 1
    model = hf_model.build_model(name, model_args, "meta", DTYPE)
    if sharded_lora:  # adapters on meta: fully_shard must see them in the blocks it wraps
        lora_sharded.inject(model, lora_cfg)
    with lora_tp.lora_plan(name) if sharded_lora else contextlib.nullcontext():  # TP: the adapters' placements
        model, parallel_dims = parallel.parallelize(model, job_config, d.world_size, d.device)
    parallel.materialize(model, d.device)
    if sharded_lora:
        lora_sharded.load_and_init(model, adapter, hf_dir, job_config.grpo.seed)
    else:
        hf_model.load_hf_weights(model, adapter, hf_dir)
        if lora_cfg is not None:
            # on the loaded base, before the optimizer: it takes only the adapters (the base is frozen)
            lora.apply_lora(model, lora_cfg)
    return model, parallel_dims


def _pipeline(job_config, model_args, adapter, hf_dir: str, d, parallel_dims, pipeline_loss, lora_cfg):
    model = hf_model.build_model(job_config.model.name, model_args, "meta", DTYPE)
    whole = hf_model.checkpoint_names(model, adapter)  # the checkpoint must fit the whole model
    order = lora_pp.inject(model, lora_cfg) if lora_cfg is not None else None  # the whole model's adapters
    pipe = pipeline_parallel.build_pipeline(model, job_config, parallel_dims, d.device, pipeline_loss)
    model = parallel.materialize(pipe.module, d.device)
    if lora_cfg is not None:
        # the stage's base, then every A of the whole model drawn in order, the stage keeping its own
        lora_sharded.load_and_init(model, adapter, hf_dir, job_config.grpo.seed, whole, order)
    else:
        hf_model.load_hf_weights(model, adapter, hf_dir, whole)
    return model, pipe


def _tied_pipeline(job_config, model_args, adapter, hf_dir: str, d, parallel_dims, pipeline_loss, lora_cfg):
    model = hf_model.build_model(job_config.model.name, model_args, d.device, DTYPE)
    hf_model.load_hf_weights(model, adapter, hf_dir)
    if lora_cfg is not None:  # on the whole model, before the split (lora_pp)
        lora_pp.adapt_whole(model, lora_cfg, job_config.grpo.seed)
    pipe = pipeline_parallel.build_pipeline(model, job_config, parallel_dims, d.device, pipeline_loss)
    # LoRA freezes the embedding: no gradient for its two copies to share
    pipe.tied = pipe.tied and lora_cfg is None
    return pipe.module, pipe
