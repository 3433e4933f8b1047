"""What a multi-rank trainer's step pays for getting full weights out, measured
in one run: nothing (off), the trainer's own collective export (``hf_weights``:
``full_tensor()`` on FSDP's groups, on the critical path), and the sidecar
gather (``ShardGatherer.snapshot``: a copy of the local shards; the gather
runs on its own thread, stream and process groups, overlapping the next step).

    torchrun --nproc_per_node=2 bench/gather_step.py          # FSDP over 2 GPUs (NCCL), Qwen3-0.6B shape
    torchrun --nproc_per_node=2 bench/gather_step.py --cpu    # gloo, the demo's tiny Qwen3

No replica is involved: rank 0 receives each gathered version and drops it,
so the rows isolate the gather (the Pusher's own cost is bench/step_time.py's).
The trainer is ``trainer.build_policy`` + ``trainer.train_step`` on a fixed
synthetic GRPO batch, FSDP over all ranks, float32 master weights. The three
modes alternate in ``--rounds`` rounds of ``--steps`` steps, so drift of the
machine hits each alike; the sidecar is drained between blocks and that wait
is not counted. Step time is rank 0's wall time of train_step + export or
snapshot, with its current stream synchronised. Prints one markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MODES = ("off", "export", "gather")


def build(args, model_dir: str, d):
    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.train.trainer import build_policy

    seq = args.prompt_len + args.completion_len
    argv = ["--model.name", "qwen3", "--model.hf_assets_path", model_dir, "--training.seq_len", str(seq),
            "--training.steps", "1000000", "--training.max_norm", "1.0", "--optimizer.lr", "1e-5",
            "--optimizer.weight_decay", "0.0", "--lr_scheduler.warmup_steps", "1",
            "--parallelism.data_parallel_shard_degree", str(d.world_size),
            "--training.mixed_precision_param", "bfloat16" if d.device.type == "cuda" else "float32",
            "--grpo.micro_batch_size", str(args.micro_batch_size), "--job.dump_folder", args.tmp]
    if d.device.type == "cpu":
        argv += ["--optimizer.implementation", "for-loop"]
    cfg = parse_config(argv)
    return cfg, build_policy(cfg, model_dir, d)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="gloo and the tiny model (tests, CI)")
    ap.add_argument("--steps", type=int, default=None, help="steps per mode per round (GPU 8, --cpu 3)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of off/export/gather (GPU 3, --cpu 2)")
    ap.add_argument("--samples", type=int, default=None, help="samples in the global batch (GPU 32, --cpu 8)")
    ap.add_argument("--prompt-len", type=int, default=None, help="GPU 32, --cpu 8")
    ap.add_argument("--completion-len", type=int, default=None, help="GPU 32, --cpu 8")
    ap.add_argument("--micro-batch-size", type=int, default=32)
    ap.add_argument("--push-dtype", default="model", choices=["model", "bfloat16"],
                    help="dtype of the gathered weights (weight_sync.dtype)")
    args = ap.parse_args(argv)
    gpu = not args.cpu
    for key, g, c in (("steps", 8, 3), ("rounds", 3, 2), ("samples", 32, 8), ("prompt_len", 32, 8),
                      ("completion_len", 32, 8)):
        if getattr(args, key) is None:
            setattr(args, key, g if gpu else c)
    if gpu and not torch.cuda.is_available():
        print("needs GPUs; use --cpu for the gloo version", file=sys.stderr)
        return 2
    torch.set_num_threads(1)

    from step_time import synthetic_batch, write_model

    from torchtitan_grpo.models.hf_bridge import hf_state_dict
    from torchtitan_grpo.distributed.parallel import data_parallel_rank_and_degree
    from torchtitan_grpo.train.trainer import close_distributed, init_distributed, train_step
    from torchtitan_grpo.weight_sync.gather import ShardGatherer

    d = init_distributed()
    with tempfile.TemporaryDirectory(prefix="gather_step_") as tmp:
        args.tmp = tmp
        box = [os.path.join(tmp, "qwen3")]
        dist.broadcast_object_list(box, src=0)  # rank 0's folder: one checkpoint for all
        model_dir = box[0]
        if d.is_main:
            write_model(model_dir, gpu)
        dist.barrier()
        cfg, policy = build(args, model_dir, d)
        batch = synthetic_batch(args.samples, args.prompt_len, args.completion_len, policy.model_args.vocab_size)
        dp_rank, dp_degree = data_parallel_rank_and_degree(policy.parallel_dims)
        local = batch[dp_rank::dp_degree]
        delivered = {"versions": 0, "bytes": 0}

        def drop(tensors, version, wait):
            delivered["versions"] += 1
            delivered["bytes"] = sum(t.nbytes for t in tensors.values())
            return {}

        dtype = None if args.push_dtype == "model" else getattr(torch, args.push_dtype)
        gatherer = ShardGatherer([policy.model], policy.adapter, policy.parallel_dims, d.device,
                                 drop if d.is_main else None, dtype=dtype, num_slots=2)
        version = 0

        def step(mode: str) -> tuple[float, float]:
            """(step time, time in the export or snapshot call)"""
            nonlocal version
            t0 = time.perf_counter()
            train_step(policy, local, cfg.grpo, 1.0, args.completion_len, global_num_samples=len(batch),
                       global_num_tokens=len(batch) * args.completion_len, pad_id=0, d=d)
            version += 1
            t1 = time.perf_counter()
            if mode == "export":
                tensors = hf_state_dict(policy.model, policy.adapter)
                if dtype is not None:
                    tensors = {k: v.to(dtype) for k, v in tensors.items()}
                del tensors
            elif mode == "gather":
                gatherer.snapshot(version)
            if d.device.type == "cuda":
                torch.cuda.current_stream(d.device).synchronize()
            t2 = time.perf_counter()
            return t2 - t0, t2 - t1

        for mode in MODES:  # warm-up: allocator, NCCL communicators of both kinds
            step(mode)
        gatherer.snapshot(version, wait=True)
        times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                times[mode] += [step(mode) for _ in range(args.steps)]
                gatherer.snapshot(version, wait=True)  # drain (not counted)
        gatherer.close()

        if d.is_main:
            n_params = sum(p.numel() for p in policy.model.parameters())  # DTensors: global sizes
            where = (f"{torch.cuda.get_device_name(0)} x{d.world_size}, NCCL" if gpu
                     else f"cpu x{d.world_size} processes, gloo")
            print(f"\n# gather_step: qwen3 {n_params / 1e6:.2f}M params (FSDP over {d.world_size} ranks), {where}, "
                  f"torch {torch.__version__}; batch {len(batch)} x {args.prompt_len}+{args.completion_len} "
                  f"tokens; {args.rounds} rounds x {args.steps} steps per mode; "
                  f"{delivered['versions']} versions of {delivered['bytes'] / 1e9:.3f} GB gathered")
            off = statistics.median(t for t, _ in times["off"])
            print("\n| mode | median step ms | p90 ms | x off | export or snapshot ms (median) |\n"
                  "| --- | ---: | ---: | ---: | ---: |")
            for mode in MODES:
                t = sorted(t for t, _ in times[mode])
                p90 = t[min(len(t) - 1, int(0.9 * len(t)))]
                print(f"| {mode} | {1e3 * statistics.median(t):.1f} | {1e3 * p90:.1f} | "
                      f"{statistics.median(t) / off:.3f} | {1e3 * statistics.median(e for _, e in times[mode]):.1f} |")
        close_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
