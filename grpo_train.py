"""GRPO post-training on TorchTitan, with the weights pushed to a fleet of
inference servers after every optimizer step.

    torchrun --nproc_per_node=N grpo_train.py --job.config_file train_configs/X.toml [--grpo.group_size 8 ...]

Each step: sample ``group_size`` completions for each of ``prompts_per_step``
prompts from the inference servers (with their logprobs and the weight
version that produced them), score them, normalise rewards within each group
into advantages, take one clipped-surrogate step on the trainer's own
logprobs, then push the new weights, tagged with the step number, to every
server. Infrastructure lives in the ``torchtitan_grpo`` package.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import torch

from torchtitan_grpo.config import parse_config
from torchtitan_grpo.parallel import data_parallel_rank_and_degree
from torchtitan_grpo.trainer import broadcast_object, build_policy, hf_weights, init_distributed, train_step

logger = logging.getLogger("torchtitan_grpo")


def main(argv: list[str]) -> dict:
    cfg = parse_config(argv)
    d = init_distributed()
    _setup_logging(d.rank)
    torch.manual_seed(cfg.grpo.seed)

    from torchtitan_grpo.session import prepare_model_dir, rollout_side

    hf_dir = prepare_model_dir(cfg, d)
    policy = build_policy(cfg, hf_dir, d)
    logger.info("policy %s from %s: %.2fM parameters on %s x%d", cfg.model.name, hf_dir,
                sum(p.numel() for p in policy.model.parameters()) / 1e6, d.device, d.world_size)

    with contextlib.ExitStack() as stack:
        # Rank 0 owns the inference side: servers, pool, rollouts, pusher, metrics.
        side = stack.enter_context(rollout_side(cfg, hf_dir, d)) if d.is_main else None
        pad_id = broadcast_object(side.pad_id if side else None, d)

        for step in range(1, cfg.training.steps + 1):
            # 1. Rollouts: groups of completions with rewards and advantages.
            batch = broadcast_object(side.rollouts.collect(step) if side else None, d)
            # data-parallel ranks split the batch; TP ranks of one DP rank share its part
            dp_rank, dp_degree = data_parallel_rank_and_degree(policy.parallel_dims)
            local = batch.samples[dp_rank::dp_degree]
            num_tokens = sum(len(s.completion_ids) for s in batch.samples)

            # 2. One GRPO optimizer step on this rank's share of the batch.
            metrics = train_step(policy, local, cfg.grpo, cfg.rollout.temperature, cfg.rollout.max_new_tokens,
                                 global_num_samples=len(batch.samples), global_num_tokens=num_tokens,
                                 pad_id=pad_id, d=d)

            # 3. Push the new weights, version = step, to every server.
            if cfg.weight_sync.mode != "off":
                tensors = hf_weights(policy)  # a collective: every rank takes part
                if side:  # async mode waits only at the last step: the final weights always arrive
                    metrics |= side.pusher.push(tensors, version=step, wait=step == cfg.training.steps or None)
                del tensors

            # 4. Log.
            if side:
                metrics |= {k: v for k, v in batch.metrics.items() if not k.startswith("_")}
                metrics["weight_version"] = float(step if cfg.weight_sync.mode != "off" else 0)
                side.log.log(step, metrics)

        summary = side.summary() if side else {}
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return summary


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout, force=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:
        logger.warning("interrupted: inference servers stopped")
        sys.exit(130)
