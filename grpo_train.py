"""GRPO post-training on TorchTitan, with the weights pushed to a fleet of
inference servers after every optimizer step.

    torchrun --nproc_per_node=N grpo_train.py --job.config_file train_configs/X.toml [--grpo.group_size 8 ...]

Each step: take ``prompts_per_step`` groups of ``group_size`` completions from
the inference servers (with their logprobs and the weight version that
produced them), scored and with rewards normalised within each group into
advantages, take one clipped-surrogate step on the trainer's own logprobs,
then push the new weights, tagged with a version number, to every server.
With ``rollout.pipeline_depth`` > 0 the servers generate the next steps'
groups while the trainer trains, and a step takes the groups that finished
first. Samples from weights more than ``grpo.max_staleness`` versions old are
dropped; the rest are importance-weighted against the rollout logprobs
(``grpo.is_correction``). With ``[checkpoint] enable``, the run saves every
``checkpoint.interval`` steps and resumes from the newest checkpoint in its
dump folder. Infrastructure lives in the ``torchtitan_grpo`` package.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time

import torch

from torchtitan_grpo.train.checkpoint import Checkpointer, export_hf
from torchtitan_grpo.config.checks import ConfigError, check_reachable
from torchtitan_grpo.config.parse import parse_config
from torchtitan_grpo.fleet.launcher import ServerStartError
from torchtitan_grpo.distributed.parallel import data_parallel_rank_and_degree
from torchtitan_grpo.train import importance as offpolicy
from torchtitan_grpo.rollout.producer import ProducerStopped
from torchtitan_grpo.stopping import Stop, StopSignals
from torchtitan_grpo.train.trainer import broadcast_object, build_policy, close_distributed, init_distributed, train_step
from torchtitan_grpo.weight_sync.gather import trainer_push

logger = logging.getLogger("torchtitan_grpo")


def main(argv: list[str]) -> dict:
    cfg = parse_config(argv)
    check_reachable(cfg)  # external servers: before the model is built
    d = init_distributed()
    _setup_logging(d.rank)
    torch.manual_seed(cfg.grpo.seed)

    from torchtitan_grpo.session import prepare_model_dir, rollout_side

    hf_dir = prepare_model_dir(cfg, d)
    policy = build_policy(cfg, hf_dir, d)
    logger.info("policy %s from %s: %.2fM parameters on %s x%d", cfg.model.name, hf_dir,
                sum(p.numel() for p in policy.model.parameters()) / 1e6, d.device, d.world_size)

    # Resume ([checkpoint]): weights, optimizer, LR schedule, step, weight version,
    # prompt position and RNG states from the newest checkpoint, if any.
    ckpt = Checkpointer(cfg, policy, d)
    resumed = ckpt.load()
    start = resumed.step if resumed else 0
    version = resumed.weight_version if resumed else 0  # of the trainer's weights; +1 per optimizer step
    pushing = cfg.weight_sync.mode != "off"
    g = cfg.grpo

    stopped: Stop | None = None
    with contextlib.ExitStack() as stack:
        stack.callback(ckpt.close)
        # SIGTERM / SIGINT end the loop at the next step boundary (see stopping.py).
        signals = stack.enter_context(StopSignals())
        # Rank 0 owns the inference side: servers, pool, rollouts, pusher, metrics.
        side = stack.enter_context(rollout_side(cfg, hf_dir, d, resumed)) if d.is_main else None
        pad_id = broadcast_object(side.pad_id if side else None, d)
        push = None
        if pushing:
            # After each step every rank copies its shards into a staging slot and
            # goes on; a sidecar thread gathers full HF-named tensors over
            # communicators of its own and rank 0's Pusher sends them to each
            # replica (one trainer rank: the Pusher's snapshot is the only copy).
            push = stack.enter_context(trainer_push(policy.model_parts, policy.adapter, policy.parallel_dims,
                                                    d.device, side.pusher if side else None, cfg.weight_sync,
                                                    policy.optimizers))
        if resumed and pushing:
            # The servers loaded the initial weights from disk: they get the
            # restored ones before generating anything.
            push.snapshot(version, wait=True)

        if side:
            # Generation starts now, on the weights the servers hold. With
            # rollout.pipeline_depth > 0 it runs ahead of the trainer from here on.
            side.rollouts.start(version)
            # [eval]: held-out prompts on the same servers, before the first step, every
            # eval.interval steps and at the end; the serial loop waits for it, pipelined does not.
            side.evaluate(start, version, "start")
        t_prev = time.perf_counter()
        step = start
        saved_step = start if resumed else 0  # the newest step with a checkpoint in ckpt.folder
        for step in range(start + 1, cfg.training.steps + 1):
            # 1. Rollouts: the first prompts_per_step groups to finish, with rewards
            #    and advantages; samples staler than grpo.max_staleness (and, with
            #    grpo.mask_truncated, those cut at max_new_tokens) are dropped.
            #    Rank 0 sends a Stop instead on a signal or a rollout failure.
            batch = None
            if side:
                batch = _next_batch(side, signals)
                if not isinstance(batch, Stop):
                    batch.samples, kept = offpolicy.select_samples(batch.samples, version if pushing else 0,
                                                                   g.max_staleness, g.mask_truncated,
                                                                   token_level=g.is_correction == "token")
                    batch.metrics |= kept
            batch = broadcast_object(batch, d)
            if isinstance(batch, Stop):
                stopped, step = batch, step - 1
                break
            # data-parallel ranks split the batch; TP ranks of one DP rank share its part
            dp_rank, dp_degree = data_parallel_rank_and_degree(policy.parallel_dims)
            local = batch.samples[dp_rank::dp_degree]
            num_tokens = int(sum(s.num_loss_tokens for s in batch.samples))  # the tokens the loss sees

            metrics = {}
            if batch.samples:  # else every sample was dropped: no step, no new version
                # 2. One GRPO optimizer step on this rank's share of the batch.
                metrics = train_step(policy, local, g, cfg.rollout.temperature, cfg.rollout.max_new_tokens,
                                     global_num_samples=len(batch.samples), global_num_tokens=num_tokens,
                                     pad_id=pad_id, d=d)
                version += 1

                # 3. Push the new weights, tagged with their version, to every server.
                #    async: snapshot and go on; sync: wait for every admitted replica.
                if pushing:
                    metrics |= push.snapshot(version)
            if side:
                side.rollouts.published(version)  # the next step's groups may start

            # 4. Log, and checkpoint every checkpoint.interval steps and at the last.
            if side:
                now = time.perf_counter()
                metrics |= {k: v for k, v in batch.metrics.items() if not k.startswith("_")}
                metrics |= {"weight_version": float(version if pushing else 0), "time/step_s": now - t_prev,
                            "perf/samples_per_s": len(batch.samples) / (now - t_prev),
                            "perf/tokens_per_s": num_tokens / (now - t_prev)}
                t_prev = now
                side.log.log(step, metrics)
                side.evaluate(step, version)
            if ckpt.save(step, version, side.rollouts if side else None, last_step=step == cfg.training.steps):
                saved_step = step

        if stopped is not None:
            # Keep the last completed step (if checkpointing is on); the servers stop with the stack.
            # It may have a checkpoint already (an interval save just before the stop, or the step
            # resumed from): the line names it then too.
            if step > saved_step and ckpt.save(step, version, side.rollouts if side else None, force=True):
                saved_step = step
            where = f"; checkpoint of step {step} in {ckpt.folder}" if step > 0 and saved_step == step else ""
            stop_line = f"stopped after step {step} of {cfg.training.steps}: {stopped.reason}{where}"
            logger.error("%s", stop_line)
        else:
            if pushing and cfg.weight_sync.mode == "async":
                # The servers end on the final weights, whatever async mode skipped
                # (a busy buffer, or a last step whose samples were all too stale).
                push.snapshot(version, wait=True)
            if side:
                side.evaluate(step, version, "end")
        summary = side.summary() if side else {}
    if stopped is not None:
        close_distributed()
        _write_error_file(stop_line)  # torchrun's failure report names the stop, not a docs link
        raise SystemExit(stopped.exit_code)
    if cfg.checkpoint.hf_export:
        export_hf(policy, hf_dir, os.path.join(cfg.job.dump_folder, cfg.checkpoint.hf_export_folder), d,
                  cfg.checkpoint.export_dtype)
    close_distributed()
    return summary


def _next_batch(side, signals: StopSignals):
    """Rank 0: the next batch, or a Stop (a signal, or rollouts that cannot go on)."""
    if signals.event.is_set():
        return signals.stop
    try:
        batch = side.rollouts.next_batch(signals.event)
    except ProducerStopped as e:
        return Stop(str(e), 1)
    return batch if batch is not None else signals.stop


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout, force=True)


def _fail(message: str) -> None:
    """One line for the user, and the same line where torchrun reports a failed
    worker (its error file), instead of a traceback wall. GRPO_DEBUG=1 keeps
    the traceback."""
    print(f"grpo_train.py: error: {message}", file=sys.stderr, flush=True)
    _write_error_file(message)
    sys.exit(2)


def _write_error_file(message: str) -> None:
    """Under torchrun, ``message`` in place of a traceback in its report of a
    failed worker ("Root Cause ... traceback : <message>"); without it the
    report shows a link to torchrun's docs. torchrun prints its own traceback
    either way, and on a signal it received itself it reads no error file."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        import json

        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                     "timestamp": str(int(time.time()))}}}, f)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:
        logger.warning("interrupted: inference servers stopped")
        sys.exit(130)
    except ConfigError as e:
        if os.environ.get("GRPO_DEBUG"):
            raise
        _fail(str(e))
    except ServerStartError as e:  # the servers' logs hold the rest
        if os.environ.get("GRPO_DEBUG"):
            raise
        _fail(e.summary)
