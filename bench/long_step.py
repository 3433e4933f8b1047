"""A whole GRPO training step on long samples: full logits against chunked
log-probs (``grpo.logprob_chunk_tokens``), measured in one run.

    python bench/long_step.py --device cuda                        # Qwen3-4B shape, T = 4k, 8k, 16k
    python bench/long_step.py --device cuda --layers 4 --tokens 4096
    python bench/long_step.py --tiny                               # CPU, tiny shape (the smoke test)

What is timed is ``trainer.train_step`` itself (micro-batched forward, GRPO
loss, backward, grad-norm clip, TorchTitan's AdamW step), on a TorchTitan
qwen3 of Qwen3-4B's shape (36 layers, hidden 2560, 32 / 8 heads of 128,
intermediate 9728, vocabulary 151,936, tied embeddings) with random weights.
The ``Policy`` is assembled as ``trainer.build_policy`` assembles it on one
device, from the same functions (``model_args_from_hf`` on an in-memory HF
config dict, ``build_model``, ``parallel.parallelize`` for the
``ParallelDims``, TorchTitan's ``build_optimizers`` / ``build_lr_schedulers``,
``parallel.mixed_precision``: bf16 autocast over float32 master weights on a
GPU), minus the checkpoint: nothing but a config.json is written.

``--ac full`` wraps each block with TorchTitan's ``apply_ac``, as TorchTitan's
qwen3 ``parallelize_fn`` does; ``parallel.parallelize`` applies it to a
one-process model too (since 2026-11-27), so it is applied there, once.
``bench/long_step_dist.py`` is the same step on several GPUs (FSDP2, CP).

Per row: tokens per sample, the path (``full``: ``logprob_chunk_tokens = 0``;
``chunk N``), the step's median wall time over ``--reps`` steps after one
warm-up, the change against the full row of the same length, the peak of
``torch.cuda.max_memory_allocated`` over the row (reset before it; it
includes the weights, gradients and AdamW state), and the loss / entropy of
the last step (the learning rate is 0, so both paths see the same weights
and must agree to bf16 rounding; AdamW still runs its whole update). A row
that runs out of memory says ``OOM``; its memory is freed and the next row
runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchtitan_grpo import _titan  # noqa: E402,F401  (before torchtitan)
from torchtitan_grpo.train.sample import Sample  # noqa: E402

# Qwen3-4B's config.json (shape only; the weights are random)
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728,
    "vocab_size": 151936, "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
    "max_position_embeddings": 40960, "use_sliding_window": False, "eos_token_id": 151645,
}
TINY = {**QWEN3_4B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 256, "vocab_size": 4096, "eos_token_id": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shape on CPU (2 layers, hidden 64, vocab 4096, T 256/512)")
    p.add_argument("--layers", type=int, default=None, help="transformer layers (default 36; --tiny: 2)")
    p.add_argument("--tokens", default=None, help="tokens per sample, comma-separated (default 4096,8192,16384)")
    p.add_argument("--chunk", type=int, default=None, help="logprob_chunk_tokens of the chunked rows (default 2048)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if there is one; --tiny: cpu)")
    p.add_argument("--ac", choices=AC_CHOICES, default="full", help=AC_HELP)
    p.add_argument("--samples", type=int, default=2, help="samples per step (one micro-batch each)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens of each sample (default 128; --tiny 32)")
    p.add_argument("--reps", type=int, default=3, help="timed steps per row (after one warm-up)")
    p.add_argument("--temperature", type=float, default=1.0)
    a = p.parse_args(argv)
    a.layers = a.layers or (2 if a.tiny else 36)
    a.tokens = [int(t) for t in (a.tokens or ("256,512" if a.tiny else "4096,8192,16384")).split(",")]
    a.chunk = a.chunk or (128 if a.tiny else 2048)
    a.device = a.device or ("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
    a.prompt_len = a.prompt_len or (32 if a.tiny else 128)
    if min(a.tokens) <= a.prompt_len:
        p.error(f"--tokens must exceed --prompt-len ({a.prompt_len}): a sample is a prompt plus a completion")
    return a


def hf_config(args: argparse.Namespace) -> dict:
    return {**(TINY if args.tiny else QWEN3_4B), "num_hidden_layers": args.layers}


AC_CHOICES = ("full", "none", "layer2", "op")
AC_HELP = ("TorchTitan activation checkpointing: full, none, layer2 (selective: every second block), "
           "op (selective per op: matmul outputs kept, the rest recomputed)")


def ac_flags(ac: str) -> tuple[str, ...]:
    """``--ac`` as ``[activation_checkpoint]`` flags: the selective modes
    trade memory for less recompute, which full AC spends (about a third
    more compute, not counted in MFU)."""
    if ac in ("full", "none"):
        return ("--activation_checkpoint.mode", ac)
    option = {"layer2": "2", "op": "op"}[ac]
    return ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", option)


def job_config(args: argparse.Namespace, model_dir: str, extra: tuple[str, ...] = ()):
    """The trainer's validated JobConfig (the model dir holds only config.json);
    ``extra``: more ``--section.key value`` flags (e.g. ``[parallelism]``)."""
    from torchtitan_grpo.config.parse import parse_config

    argv = ["--model.name", "qwen3", "--model.hf_assets_path", model_dir,
            "--training.seq_len", str(max(args.tokens)), "--training.steps", "1000000",
            "--training.max_norm", "1.0", "--training.mixed_precision_param", "bfloat16",
            # lr 0: both paths see the same weights every step (AdamW still runs its update)
            "--optimizer.lr", "0", "--optimizer.weight_decay", "0.0", "--lr_scheduler.warmup_steps", "1",
            *ac_flags(args.ac), "--grpo.micro_batch_size", "1",
            "--job.dump_folder", model_dir, *extra]
    if args.device == "cpu":
        argv += ["--optimizer.implementation", "for-loop"]
    return parse_config(argv)


def build_policy(cfg, config: dict, device: torch.device):
    """``trainer.build_policy``'s one-device policy, random weights instead of a checkpoint."""
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers

    from torchtitan_grpo.models import hf_bridge as hf_model
    from torchtitan_grpo.distributed import parallel
    from torchtitan_grpo.train.trainer import Policy

    args = hf_model.model_args_from_hf("qwen3", config, max_seq_len=cfg.training.seq_len)
    model = hf_model.build_model("qwen3", args, device, torch.float32)
    model, dims = parallel.parallelize(model, cfg, 1, device)  # one process: [activation_checkpoint] only
    model.train()
    optimizers = build_optimizers([model], cfg.optimizer, dims)
    schedulers = build_lr_schedulers(optimizers, cfg.lr_scheduler, cfg.training.steps)
    return Policy(model, args, None, optimizers, schedulers, dims, float(cfg.training.max_norm),
                  amp=parallel.mixed_precision(cfg, dims, device))


def samples(n: int, tokens: int, prompt_len: int, vocab: int, seed: int = 0) -> list[Sample]:
    """``n`` samples of ``tokens`` tokens (a prompt + a long completion), rollout
    log-probs near uniform, advantages +1, -1, ..."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(2, vocab, (tokens,), generator=g).tolist()
        lp = (-math.log(vocab) + 0.1 * torch.randn(tokens - prompt_len, generator=g)).tolist()
        adv = 1.0 if i % 2 == 0 else -1.0
        out.append(Sample(ids[:prompt_len], ids[prompt_len:], lp, adv, float(adv > 0), "length", ["0"]))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(policy, device: torch.device, collect: bool = False) -> None:
    """Gradients dropped, the allocator's cache emptied (after an OOM, the
    step's dead tensors collected first: gc.collect costs ~0.5 s here)."""
    policy.optimizers.zero_grad()
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_row(policy, batch: list[Sample], cfg, chunk: int, args, device: torch.device, d=None,
            local: list[Sample] | None = None) -> dict:
    """One warm-up step and ``args.reps`` timed ``train_step`` calls; OOM -> ``{"oom": True}``.
    ``batch``: the whole step's samples; ``local``: this rank's share of them
    (default: all), ``d``: this rank's ``trainer.Dist`` (default: one process)."""
    from torchtitan_grpo.train.trainer import Dist, train_step

    cfg.grpo.logprob_chunk_tokens = chunk
    d = d or Dist(0, 1, 0, device)
    local = batch if local is None else local
    n_tok = sum(len(s.completion_ids) for s in batch)
    max_new = max(len(s.completion_ids) for s in batch)
    _free(policy, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, metrics, oom = [], {}, False
    try:
        for _ in range(1 + args.reps):
            _sync(device)
            t0 = time.perf_counter()
            metrics = train_step(policy, local, cfg.grpo, args.temperature, max_new, len(batch), n_tok, 0, d)
            _sync(device)
            times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        oom = True  # freed below, outside the handler: its traceback holds the step's tensors
    except RuntimeError as e:  # cuBLAS / cuDNN failing to allocate its workspace is an OOM too
        if "ALLOC_FAILED" not in str(e) and "out of memory" not in str(e):
            raise
        oom = True
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    reserved = torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None
    _free(policy, device, collect=oom)
    if oom:
        return {"oom": True, "peak": peak, "reserved": reserved}
    return {"oom": False, "ms": 1e3 * statistics.median(times[1:]), "peak": peak, "reserved": reserved,
            "loss": metrics["loss"], "entropy": metrics["entropy"], "grad_norm": metrics["grad_norm"]}


def fmt_row(tokens: int, path: str, r: dict, base: dict | None) -> str:
    peak = "-" if r["peak"] is None else f"{r['peak']:.1f}"
    if r["oom"]:
        return f"| {tokens} | {path} | OOM | - | {peak} | - | - | OOM |"
    vs = "-"
    if base is not None and not base["oom"]:
        vs = f"{r['ms'] - base['ms']:+.0f} ms ({100 * (r['ms'] / base['ms'] - 1):+.1f}%)"
    return (f"| {tokens} | {path} | {r['ms']:.1f} | {vs} | {peak} | {r['loss']:.5f} | {r['entropy']:.4f} | ok |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:  # "cuda": the current device, with its index (set_device needs one)
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    config = hf_config(args)
    with tempfile.TemporaryDirectory() as model_dir:
        Path(model_dir, "config.json").write_text(json.dumps(config))
        cfg = job_config(args, model_dir)
        policy = build_policy(cfg, config, device)
        n_params = sum(p.numel() for p in policy.model.parameters())
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"# long_step: {'tiny' if args.tiny else 'Qwen3-4B'} shape, {args.layers} layers, "
              f"{n_params / 1e9:.2f} B parameters (float32 master weights, AdamW {cfg.optimizer.implementation}), "
              f"amp {'bf16 autocast' if device.type == 'cuda' else 'off (float32)'}, AC {args.ac}, "
              f"{args.samples} samples x T tokens ({args.prompt_len}-token prompt), micro-batch 1, "
              f"T={args.temperature}; device {device} ({name}), torch {torch.__version__}", flush=True)
        print("| tokens | path | step ms | vs full | peak GiB | loss | entropy | status |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |", flush=True)
        for tokens in args.tokens:
            batch = samples(args.samples, tokens, args.prompt_len, config["vocab_size"])
            base = run_row(policy, batch, cfg, 0, args, device)
            print(fmt_row(tokens, "full", base, None), flush=True)
            r = run_row(policy, batch, cfg, args.chunk, args, device)
            print(fmt_row(tokens, f"chunk {args.chunk}", r, base), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
