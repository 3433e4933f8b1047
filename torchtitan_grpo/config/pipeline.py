"""The pipeline-parallel settings the GRPO trainer accepts, checked before
anything is built.

Below both ``parallel`` (whose ``build_parallel_dims`` checks them first) and
``pipeline`` (which builds the stages with ``parallel.apply_layout``), so
that neither imports the other back.
"""

from __future__ import annotations

__all__ = ["SCHEDULES", "check_config", "schedule_class"]

SCHEDULES = ("1F1B", "GPipe")
"""Accepted ``parallelism.pipeline_parallel_schedule`` values (any case)."""


def schedule_class(name: str) -> type:
    """The torch schedule class for ``parallelism.pipeline_parallel_schedule``."""
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe

    classes = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
    cls = classes.get(str(name).lower())
    if cls is None:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule={name!r}: the GRPO trainer runs one "
            f"stage per PP rank with one of {', '.join(SCHEDULES)}"
        )
    return cls


def _dp_shard_degree(parallelism, world_size: int | None) -> int | None:
    """``data_parallel_shard_degree`` with -1 resolved (None if it cannot be)."""
    shard = parallelism.data_parallel_shard_degree
    if shard != -1:
        return shard
    if world_size is None:
        return None
    others = (parallelism.data_parallel_replicate_degree * parallelism.tensor_parallel_degree
              * parallelism.pipeline_parallel_degree * parallelism.context_parallel_degree)
    return world_size // max(others, 1)


def check_config(job_config, world_size: int | None = None) -> None:
    """Raise, naming the key, for a PP setting the GRPO trainer cannot run.

    A no-op for ``pipeline_parallel_degree == 1``. Called at start-up by
    :func:`torchtitan_grpo.distributed.parallel.build_parallel_dims`.
    """
    p = job_config.parallelism
    pp = p.pipeline_parallel_degree
    if pp < 1:
        raise ValueError(f"parallelism.pipeline_parallel_degree={pp}: must be >= 1")
    if pp == 1:
        return
    if job_config.model.name not in ("qwen3", "llama3"):
        raise ValueError(
            f"model.name={job_config.model.name!r} with parallelism.pipeline_parallel_degree={pp}: "
            "pipeline stages are built for qwen3 and llama3 only"
        )
    schedule_class(p.pipeline_parallel_schedule)
    if p.pipeline_parallel_schedule_csv:
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule_csv={p.pipeline_parallel_schedule_csv!r}: "
            "CSV schedules are not supported by the GRPO trainer (use "
            "parallelism.pipeline_parallel_schedule = \"1F1B\" or \"GPipe\")"
        )
    if p.data_parallel_replicate_degree > 1 and _dp_shard_degree(p, world_size) == 1:
        raise NotImplementedError(
            f"parallelism.data_parallel_replicate_degree={p.data_parallel_replicate_degree} "
            f"without data_parallel_shard_degree > 1 (DDP) and parallelism.pipeline_parallel_degree={pp}: "
            "DDP is not supported with pipeline stages; use data_parallel_shard_degree (FSDP, or "
            "HSDP with dp_replicate) instead"
        )
    grpo = getattr(job_config, "grpo", None)
    if grpo is not None and grpo.kl_coef > 0:
        raise NotImplementedError(
            f"grpo.kl_coef={grpo.kl_coef} with parallelism.pipeline_parallel_degree={pp}: the KL "
            "reference model is not pipelined; set grpo.kl_coef = 0 or pipeline_parallel_degree = 1"
        )
