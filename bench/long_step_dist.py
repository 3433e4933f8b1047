"""A whole GRPO training step on long samples over several GPUs: FSDP2, then
FSDP2 x context parallelism, as the trainer builds them.

    torchrun --nproc_per_node=2 bench/long_step_dist.py --layout fsdp              # Qwen3-4B shape, 4k/8k/16k
    torchrun --nproc_per_node=2 bench/long_step_dist.py --layout fsdp_cp --tokens 16384
    torchrun --nproc_per_node=2 bench/long_step_dist.py --tiny                     # CPU + gloo smoke, both layouts

The policy is ``trainer.build_policy`` itself, from a job config
(``bench/long_step.py``'s: lr 0, AdamW, grad clip, bf16 FSDP2 mixed
precision on a GPU, micro-batch 1, ``--ac`` TorchTitan activation
checkpointing, ``grpo.logprob_chunk_tokens = --chunk``) plus the layout's
``[parallelism]`` keys, and an HF checkpoint of random weights (TorchTitan's
init, bf16 safetensors on a GPU) that rank 0 writes once to ``--ckpt`` and
later runs reuse. What is timed is ``trainer.train_step`` on each rank's
share of the step's samples, the share ``grpo_train.py`` gives it:

* ``fsdp``: ``data_parallel_shard_degree = world``; each rank trains
  ``--samples-per-rank`` whole samples.
* ``fsdp_cp``: ``context_parallel_degree = --cp`` x ``data_parallel_shard_degree
  = world / cp``; the CP ranks of one data-parallel rank share its
  ``--samples-per-rank`` samples, each holding ``T / cp`` positions of every
  sample (ring attention; the weights are FSDP-sharded over all ranks).

Per row (rank 0 prints a markdown table): the layout, tokens per sample T,
samples per step (the whole job's), the step's wall time (median of
``--reps`` steps after one warm-up, the slowest rank's), tokens/s of the
whole job (samples x T / step), MFU and the peak memory per GPU (the largest
``torch.cuda.max_memory_allocated`` over the ranks, reset before the row; it
includes the float32 weights, gradients and AdamW state shards), and the
reserved peak beside it. A row that runs out of memory says ``OOM`` and
the next layout goes on (longer samples of the same layout are skipped: they
need more). The ranks' shares are the same size, so they run out together;
an OOM on one rank alone leaves the other in a collective, and only a
timeout (the device script's) ends that.

MFU = model FLOPs / (step s x GPUs x peak dense bf16 FLOP/s), with

    model FLOPs = 6 x N x samples x T  +  6 x L x T^2 x H x d x samples

``N``: the model's distinct parameters (tied: the embedding counted once,
as the output projection's matmul; the embedding lookup costs none).
Attention, per layer and sample: the forward's QK^T and AV are 2 x 2 T^2 H d
FLOPs, halved by the causal mask (2 T^2 H d); forward + backward is 3x that.
``L`` layers, ``H`` query heads of ``d``. The recompute of activation
checkpointing is not counted (it is hardware work, not model work: the MFU
convention), so AC full costs MFU. Peak: 989 TFLOP/s dense bf16 for H100
SXM and H200 (looked up by the device's name; ``--peak-tflops`` overrides);
a device not in the table (and the CPU) prints ``-``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import long_step  # noqa: E402  (imports torchtitan_grpo before torchtitan)

LAYOUTS = ("fsdp", "fsdp_cp")
# Dense bf16 tensor-core peak in TFLOP/s, by a substring of the device name,
# first match wins (H100 PCIe / NVL before the SXM default).
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shape on CPU with gloo (the smoke test)")
    p.add_argument("--layout", default=None,
                   help=f"comma-separated, of {', '.join(LAYOUTS)} (default: both, in that order)")
    p.add_argument("--cp", type=int, default=2, help="context_parallel_degree of the fsdp_cp layout")
    p.add_argument("--layers", type=int, default=None, help="transformer layers (default 36; --tiny: 2)")
    p.add_argument("--tokens", default=None, help="tokens per sample, comma-separated (default 4096,8192,16384)")
    p.add_argument("--samples-per-rank", type=int, default=2,
                   help="samples per data-parallel rank and step (CP ranks share theirs)")
    p.add_argument("--chunk", type=int, default=None, help="grpo.logprob_chunk_tokens (default 2048; --tiny 32)")
    p.add_argument("--ac", choices=long_step.AC_CHOICES, default="full", help=long_step.AC_HELP)
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens of each sample (default 128; --tiny 32)")
    p.add_argument("--reps", type=int, default=3, help="timed steps per row (after one warm-up)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--ckpt", default=None, help="random-weight HF checkpoint dir, written if missing "
                                                "(default: under the temp dir, per shape)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak per GPU (default: by name)")
    p.add_argument("--timeout", type=float, default=600, help="process-group timeout, seconds")
    p.add_argument("--config-flags", default="",
                   help='more trainer flags for every layout, e.g. "--lora.enable --lora.rank 16" (rows tagged "+")')
    a = p.parse_args(argv)
    a.layouts = (a.layout or ",".join(LAYOUTS)).split(",")
    bad = [x for x in a.layouts if x not in LAYOUTS]
    if bad:
        p.error(f"--layout {','.join(bad)}: not one of {', '.join(LAYOUTS)}")
    a.layers = a.layers or (2 if a.tiny else 36)
    a.tokens = [int(t) for t in (a.tokens or ("64,128" if a.tiny else "4096,8192,16384")).split(",")]
    a.chunk = a.chunk or (32 if a.tiny else 2048)
    a.prompt_len = a.prompt_len or (32 if a.tiny else 128)
    a.device = "cpu" if a.tiny or not torch.cuda.is_available() else "cuda"
    if min(a.tokens) <= a.prompt_len:
        p.error(f"--tokens must exceed --prompt-len ({a.prompt_len}): a sample is a prompt plus a completion")
    if a.samples_per_rank < 1:
        p.error("--samples-per-rank must be >= 1: a rank without a sample measures nothing")
    shape = f"{'tiny' if a.tiny else 'qwen3_4b'}-{a.layers}l"
    a.ckpt = a.ckpt or str(Path(tempfile.gettempdir()) / f"long_step_dist-{shape}")
    return a


# ------------------------------------------------------------------ set-up


def init(args: argparse.Namespace):
    """This rank's ``trainer.Dist``: NCCL on its GPU (``trainer.init_distributed``),
    or gloo on the CPU for ``--tiny`` even where there is a GPU."""
    from datetime import timedelta

    from torchtitan_grpo.train.trainer import Dist, init_distributed

    if args.device == "cuda":
        return init_distributed(args.timeout)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if "MASTER_ADDR" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout))
    return Dist(rank, world, int(os.environ.get("LOCAL_RANK", "0")), torch.device("cpu"))


def _barrier(d) -> None:
    if dist.is_initialized():
        dist.barrier(device_ids=[d.device.index] if d.device.type == "cuda" else None)


def write_checkpoint(path: Path, config: dict, device: torch.device) -> None:
    """An HF checkpoint of ``config`` with TorchTitan's random init (bf16 on a
    GPU, where it is built; float32 on CPU), written beside ``path`` and
    renamed into place."""
    from safetensors.torch import save_file

    from torchtitan_grpo.models import hf_bridge as hf_model

    margs = hf_model.model_args_from_hf("qwen3", config, max_seq_len=1024)
    torch.manual_seed(0)  # the same weights on every machine
    model = hf_model.build_model("qwen3", margs, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    adapter = hf_model.state_dict_adapter("qwen3", margs, None)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in hf_model.hf_state_dict(model, adapter).items()}
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def ensure_checkpoint(path: Path, config: dict, d) -> None:
    """Rank 0 writes the checkpoint unless ``path`` holds one of this config;
    the other ranks wait for it."""
    if d.is_main:
        cfg_file = path / "config.json"
        same = cfg_file.is_file() and json.loads(cfg_file.read_text()) == config
        if not (same and (path / "model.safetensors").is_file()):
            write_checkpoint(path, config, d.device)
    _barrier(d)


def layout_flags(layout: str, world: int, cp: int) -> tuple[str, ...]:
    """The ``[parallelism]`` keys of ``layout`` on ``world`` ranks."""
    if layout == "fsdp":
        shard, cp = world, 1
    elif world % cp or world < cp:
        raise SystemExit(f"--layout fsdp_cp: {world} ranks do not divide into context_parallel_degree={cp}")
    else:
        shard = world // cp
    return ("--parallelism.data_parallel_shard_degree", str(shard), "--parallelism.context_parallel_degree", str(cp))


# ----------------------------------------------------------------- numbers


def peak_flops(name: str, override_tflops: float | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of the device called ``name`` (None: not in the table)."""
    if override_tflops:
        return override_tflops * 1e12
    return next((tflops * 1e12 for key, tflops in PEAK_TFLOPS if key in name), None)


def model_flops(n_params: int, layers: int, heads: int, head_dim: int, tokens: int, samples: int) -> float:
    """FLOPs of one training step (forward + backward, no recompute; module doc)."""
    dense = 6.0 * n_params * tokens * samples
    attention = 6.0 * layers * tokens**2 * heads * head_dim * samples
    return dense + attention


def agree(r: dict, d) -> dict:
    """The row as all ranks saw it: OOM anywhere, the slowest rank's median,
    the largest peaks."""
    vals = [float(r["oom"]), r.get("ms", 0.0), r["peak"] or 0.0, r["reserved"] or 0.0]
    if dist.is_initialized():
        t = torch.tensor(vals, dtype=torch.float64, device=d.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        vals = t.tolist()
    has_peak = r["peak"] is not None
    return {**r, "oom": vals[0] > 0, "ms": vals[1], "peak": vals[2] if has_peak else None,
            "reserved": vals[3] if has_peak else None}


HEADER = ("| layout | tokens/sample | samples/step | step s | tokens/s | MFU % | peak GiB | reserved GiB "
          "| loss | grad norm | status |")
SEPARATOR = "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"


def fmt_row(layout: str, tokens: int, n_samples: int, r: dict | None, flops: float, n_gpus: int,
            peak: float | None) -> str:
    if r is None:
        return f"| {layout} | {tokens} | {n_samples} | - | - | - | - | - | - | - | skipped (OOM at fewer tokens) |"
    mem = "-" if r["peak"] is None else f"{r['peak']:.1f}"
    res = "-" if r["reserved"] is None else f"{r['reserved']:.1f}"
    if r["oom"]:
        return f"| {layout} | {tokens} | {n_samples} | OOM | - | - | {mem} | {res} | - | - | OOM |"
    step_s = r["ms"] / 1e3
    mfu = "-" if peak is None else f"{100 * flops / (step_s * n_gpus * peak):.1f}"
    return (f"| {layout} | {tokens} | {n_samples} | {step_s:.3f} | {n_samples * tokens / step_s:,.0f} | {mfu} "
            f"| {mem} | {res} | {r['loss']:.5f} | {r['grad_norm']:.4f} | ok |")


# -------------------------------------------------------------------- run


def run_layout(layout: str, args: argparse.Namespace, config: dict, d, peak: float | None) -> None:
    """Build the trainer's policy for ``layout`` and run its rows."""
    from torchtitan_grpo.distributed import parallel
    from torchtitan_grpo.train.trainer import build_policy

    extra = shlex.split(args.config_flags)
    cfg = long_step.job_config(args, args.ckpt, (*layout_flags(layout, d.world_size, args.cp), *extra))
    if extra:  # the rows say what they ran (MFU still counts 6 N per token, as for full training)
        layout = f"{layout} + {args.config_flags}"
    policy = build_policy(cfg, args.ckpt, d)
    n_params = sum(p.numel() for p in policy.model.parameters())  # distinct (tied: once), global (DTensor)
    dp_rank, dp_degree = parallel.data_parallel_rank_and_degree(policy.parallel_dims)
    n_samples = args.samples_per_rank * dp_degree
    if d.is_main:
        dims = policy.parallel_dims
        print(f"\n# {layout}: dp_shard {dims.dp_shard} x cp {dims.cp} on {d.world_size} ranks, "
              f"{n_params:,} parameters\n\n{HEADER}\n{SEPARATOR}", flush=True)
    oomed = False
    for tokens in args.tokens:
        flops = model_flops(n_params, args.layers, config["num_attention_heads"], config["head_dim"], tokens,
                            n_samples)
        r = None
        if not oomed:
            batch = long_step.samples(n_samples, tokens, args.prompt_len, config["vocab_size"])
            r = agree(long_step.run_row(policy, batch, cfg, args.chunk, args, d.device, d=d,
                                        local=batch[dp_rank::dp_degree]), d)
            oomed = r["oom"]
        if d.is_main:
            print(fmt_row(layout, tokens, n_samples, r, flops, d.world_size, peak), flush=True)
    del policy
    gc.collect()
    if d.device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    d = init(args)
    try:
        config = long_step.hf_config(args)
        ensure_checkpoint(Path(args.ckpt), config, d)
        name = torch.cuda.get_device_name(d.device) if d.device.type == "cuda" else "cpu"
        peak = peak_flops(name, args.peak_tflops)
        if d.is_main:
            print(f"# long_step_dist: {'tiny' if args.tiny else 'Qwen3-4B'} shape, {args.layers} layers, "
                  f"{d.world_size} ranks on {name} (peak {'-' if peak is None else f'{peak / 1e12:g} TFLOP/s'}"
                  f" bf16 dense), {'bf16 FSDP2 mixed precision' if d.device.type == 'cuda' else 'float32'}, "
                  f"AC {args.ac}, logprob_chunk_tokens {args.chunk}, {args.samples_per_rank} samples per DP rank "
                  f"({args.prompt_len}-token prompt), micro-batch 1, median of {args.reps} steps after 1 warm-up; "
                  f"torch {torch.__version__}; checkpoint {args.ckpt}", flush=True)
        for layout in args.layouts:
            run_layout(layout, args, config, d, peak)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
