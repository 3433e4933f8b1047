"""Packed against padded micro-batches (``grpo.micro_batch_tokens``) on one
long-tailed batch, measured in one run.

    python bench/packed_vs_padded.py --device cuda                  # Qwen3-4B shape, 8 layers, 32 samples 256..16k
    python bench/packed_vs_padded.py --device cuda --layers 36 --mbs 1,2
    python bench/packed_vs_padded.py --tiny                         # CPU, tiny shape (the smoke test)

The batch: ``--samples`` lengths drawn (seeded) from a Pareto tail
``P(len > x) = (min / x) ** alpha`` clipped to ``[--min-len, --max-len]``
(alpha 0.7, 256..16384: median ~700 tokens, ~5% at the 16k cap), each a
128-token prompt (``--tiny``: 16) plus its completion, in drawn order.

What is timed is ``trainer.train_step`` (forward, GRPO loss, backward,
grad-norm clip, AdamW) on ``bench/long_step.py``'s one-device policy
(random weights, bf16 autocast over float32 master weights on a GPU, lr 0
so every row sees the same weights; ``--ac full``: TorchTitan's activation
checkpointing), with chunked log-probs (``--chunk``). First the padded rows
(``grpo.micro_batch_size`` = each of ``--mbs``: the trainer's order, each
micro-batch right-padded to its longest sample), then the model's attention
is switched to the document-masked one and the packed rows run
(``grpo.micro_batch_tokens`` = each of ``--budget``).

Per row: tokens/s of real tokens (the batch's tokens over the step's median
wall time after one warm-up step, which also compiles the packed attention),
the speed-up over the fastest padded row (packed rows), micro-batches, tokens computed
(padding included) over real tokens, the peak of
``torch.cuda.max_memory_allocated`` (weights, gradients and AdamW state
included), and the last step's loss, which must agree across rows to bf16
rounding (float32 on CPU).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import long_step  # noqa: E402  (imports torchtitan_grpo before torchtitan)
from torchtitan_grpo.train import packing  # noqa: E402
from torchtitan_grpo.train.sample import Sample  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shape on CPU (2 layers, hidden 64, lengths 16..512)")
    p.add_argument("--layers", type=int, default=None, help="transformer layers (default 8; --tiny: 2)")
    p.add_argument("--samples", type=int, default=None, help="samples in the batch (default 32; --tiny: 12)")
    p.add_argument("--min-len", type=int, default=None, help="shortest sample (default 256; --tiny: 24)")
    p.add_argument("--max-len", type=int, default=None, help="longest sample (default 16384; --tiny: 512)")
    p.add_argument("--alpha", type=float, default=0.7, help="Pareto tail index of the lengths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mbs", default="1,4", help="grpo.micro_batch_size of the padded rows, comma-separated")
    p.add_argument("--budget", default=None, help="grpo.micro_batch_tokens of the packed rows (default 16384; "
                   "--tiny: 512), comma-separated")
    p.add_argument("--chunk", type=int, default=None, help="logprob_chunk_tokens (default 2048; --tiny: 128)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if there is one; --tiny: cpu)")
    p.add_argument("--ac", choices=long_step.AC_CHOICES, default="full", help=long_step.AC_HELP)
    p.add_argument("--reps", type=int, default=2, help="timed steps per row (after one warm-up)")
    p.add_argument("--temperature", type=float, default=1.0)
    a = p.parse_args(argv)
    a.layers = a.layers or (2 if a.tiny else 8)
    a.samples = a.samples or (12 if a.tiny else 32)
    a.min_len = a.min_len or (24 if a.tiny else 256)
    a.max_len = a.max_len or (512 if a.tiny else 16384)
    a.mbs = [int(x) for x in a.mbs.split(",")]
    a.budget = [int(x) for x in (a.budget or ("512" if a.tiny else "16384")).split(",")]
    a.chunk = a.chunk or (128 if a.tiny else 2048)
    a.device = a.device or ("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
    a.prompt_len = 16 if a.tiny else 128
    a.tokens = [a.max_len]  # long_step.job_config's training.seq_len
    if a.min_len <= a.prompt_len:
        p.error(f"--min-len must exceed the prompt ({a.prompt_len} tokens)")
    return a


def tail_lengths(n: int, lo: int, hi: int, alpha: float, seed: int) -> list[int]:
    """``n`` lengths from a Pareto tail with minimum ``lo``, clipped at ``hi``."""
    rng = random.Random(seed)
    return [min(hi, int(lo * (1.0 - rng.random()) ** (-1.0 / alpha))) for _ in range(n)]


def batch(lengths: list[int], prompt_len: int, vocab: int, seed: int) -> list[Sample]:
    """One sample per length (random ids, rollout log-probs near uniform, advantages +-1)."""
    out = []
    for i, n in enumerate(lengths):
        (s,) = long_step.samples(1, n, prompt_len, vocab, seed=seed + i)
        s.advantage = s.reward = 1.0 if i % 2 == 0 else -1.0
        out.append(s)
    return out


def computed_tokens(lengths: list[int], mbs: int = 0, budget: int = 0, multiple: int = 1) -> tuple[int, int]:
    """``(micro-batches, tokens computed)``: padded rows of ``mbs`` samples, or packed rows."""
    if budget:
        rows = packing.plan(lengths, budget)
        return len(rows), sum(-(-sum(lengths[i] for i in r) // multiple) * multiple for r in rows)
    groups = [lengths[k : k + mbs] for k in range(0, len(lengths), mbs)]
    return len(groups), sum(len(g) * max(g) for g in groups)


def fmt_row(path: str, r: dict, real: int, micro: int, computed: int, base: dict | None) -> str:
    peak = "-" if r["peak"] is None else f"{r['peak']:.1f}"
    head = f"| {path} | {micro} | {computed / real:.2f} |"
    if r["oom"]:
        return f"{head} OOM | - | - | {peak} | - | OOM |"
    tps = real / (r["ms"] / 1e3)
    vs = "-" if base is None else f"{base['ms'] / r['ms']:.2f}x"
    return f"{head} {r['ms']:.0f} | {tps:,.0f} | {vs} | {peak} | {r['loss']:.5f} | ok |"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    config = long_step.hf_config(args)
    lengths = tail_lengths(args.samples, args.min_len, args.max_len, args.alpha, args.seed)
    real = sum(lengths)
    multiple = packing.CUDA_ROW_MULTIPLE if device.type == "cuda" else 1
    with tempfile.TemporaryDirectory() as model_dir:
        Path(model_dir, "config.json").write_text(json.dumps(config))
        cfg = long_step.job_config(args, model_dir)
        policy = long_step.build_policy(cfg, config, device)
        data = batch(lengths, args.prompt_len, config["vocab_size"], args.seed)
        n_params = sum(p.numel() for p in policy.model.parameters())
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        srt = sorted(lengths)
        print(f"# packed_vs_padded: {'tiny' if args.tiny else 'Qwen3-4B'} shape, {args.layers} layers, "
              f"{n_params / 1e6:,.1f} M parameters, amp {'bf16 autocast' if device.type == 'cuda' else 'off'}, "
              f"AC {args.ac}, chunk {args.chunk}; {len(lengths)} samples, {real} tokens, lengths "
              f"min {srt[0]} median {srt[len(srt) // 2]} max {srt[-1]} (Pareto alpha {args.alpha}, seed "
              f"{args.seed}); device {device} ({name}), torch {torch.__version__}", flush=True)
        print("| path | micro-batches | computed / real tokens | step ms | tokens/s | vs best padded | peak GiB "
              "| loss | status |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |", flush=True)
        best = None  # the fastest padded row: the packed rows' baseline
        for mbs in args.mbs:
            cfg.grpo.micro_batch_size, cfg.grpo.micro_batch_tokens = mbs, 0
            r = long_step.run_row(policy, data, cfg, args.chunk, args, device)
            print(fmt_row(f"padded, {mbs} a micro-batch", r, real, *computed_tokens(lengths, mbs=mbs), None),
                  flush=True)
            if not r["oom"] and (best is None or r["ms"] < best["ms"]):
                best = r
        packing.use_document_attention(policy.model)  # what build_policy does with micro_batch_tokens > 0
        for budget in args.budget:
            cfg.grpo.micro_batch_tokens = budget
            r = long_step.run_row(policy, data, cfg, args.chunk, args, device)
            print(fmt_row(f"packed, {budget} tokens a row", r, real,
                          *computed_tokens(lengths, budget=budget, multiple=multiple), best), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
