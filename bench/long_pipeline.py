"""A whole pipelined GRPO run on long, long-tailed samples, on 4 GPUs.

    python bench/long_pipeline.py                  # Qwen3-4B shape: trainer on cuda:0-1, servers on cuda:2, 3
    python bench/long_pipeline.py --max-new 16384  # the tail up to 16k tokens
    python bench/long_pipeline.py --cpu --tiny     # the smoke test: tiny Qwen3, 2 gloo ranks, 2 CPU servers

One real ``torchrun --nproc_per_node=2 grpo_train.py`` run: the trainer on
two ranks (FSDP2, bf16 autocast over float32 master weights, full activation
checkpointing, packed micro-batches ``grpo.micro_batch_tokens``, chunked
log-probs ``grpo.logprob_chunk_tokens``), two built-in servers it launches
itself (``inference.server_devices cuda:2,cuda:3``, bf16, the paged KV cache,
``max_model_len`` = prompt + the longest budget), the pipelined loop
(``rollout.pipeline_depth 1``) and the async NCCL push.

The workload is the long tail: every dataset row carries its own
``max_new_tokens`` (rollout/prompt_budget.py), Pareto-distributed from
``--min-new`` to ``--max-new`` (seeded), and the model is random (Qwen3-4B's
config.json, a character tokenizer): it almost never samples EOS, so each
group's completions run to their row's budget and the lengths are the drawn
budgets. A step takes the first ``prompts_per_step`` groups that finish, so a
long group reaches the trainer steps after it was admitted: the staleness
this produces is what the table shows.

Printed from the run's metrics.jsonl, per step: the step's wall time, the
trainer's wait for data (``time/wait_s``), its train time (``time/train_s``)
and busy fraction (train / step), the generated tokens of the batch and the
rate at which the fleet delivered them (batch tokens / time since the last
take), mean and max completion length, groups in flight and buffered at the
take, and the staleness: the largest version lag at admission
(``rollout/admitted_lag_max``), the samples' mean / max staleness when
trained (``offpolicy/staleness_*``), and what ``grpo.max_staleness`` dropped
or masked. Then a summary over the steps after ``--warmup``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import string
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Qwen3-4B's config.json shape (bench/long_step.py's), EOS / pad the character tokenizer's
QWEN3_4B = {"hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151936, "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "max_position_embeddings": 40960}


_COIN = random.Random(0)


def reward(prompt: str, completion: str, row: dict) -> float:
    """``rollout.reward_fn`` of the run: a coin flip per completion, so groups
    are not constant and every step trains (the figures are about time, not
    learning). Not a function of the text: the character tokenizer decodes
    almost none of a 151,936-entry vocabulary, so most completions read as
    the same few characters."""
    return float(_COIN.random() < 0.5)


# --------------------------------------------------------------------- assets


def write_model(out_dir: str, layers: int, device: str, seed: int = 0) -> str:
    """A random Qwen3-4B-shaped HF checkpoint (bf16 safetensors) and the demo's
    character tokenizer; initialised on ``device`` (a GPU: seconds, not the
    minutes a CPU takes for 4B parameters). Kept if ``out_dir`` has one."""
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from torchtitan_grpo.models.demo_assets import write_tokenizer

    config = Qwen3Config(**{**QWEN3_4B, "num_hidden_layers": layers}, bos_token_id=None, eos_token_id=1,
                         pad_token_id=0, attention_bias=False, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    model.save_pretrained(tmp, safe_serialization=True)
    write_tokenizer(tmp)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # cuda:0 is trainer rank 0's: only this process's context stays on it
    os.rename(tmp, out_dir)
    return out_dir


def budgets(n: int, low: int, high: int, alpha: float, seed: int) -> list[int]:
    """``n`` Pareto(``alpha``) draws from ``low``, capped at ``high``: most rows
    short, a few at the cap (alpha 0.8 from 512: 11% of rows reach 8192)."""
    rng = random.Random(seed)
    return [min(high, int(low * (1.0 - rng.random()) ** (-1.0 / alpha))) for _ in range(n)]


def write_dataset(path: str, args: argparse.Namespace) -> list[int]:
    """Rows of random printable prompts (``--prompt-len`` characters, one
    token each) with a long-tailed ``max_new_tokens``; returns the budgets."""
    rng = random.Random(args.seed + 1)
    alphabet = string.ascii_letters + string.digits + " "
    drawn = budgets(args.rows, args.min_new, args.max_new, args.alpha, args.seed)
    with open(path, "w") as f:
        for i, b in enumerate(drawn):
            prompt = f"{i}: " + "".join(rng.choice(alphabet) for _ in range(args.prompt_len))
            f.write(json.dumps({"prompt": prompt, "max_new_tokens": b}) + "\n")
    return drawn


def _toml(sections: dict[str, dict]) -> str:
    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v)  # str (quoted), int, float
    return "".join(f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in body.items()) + "\n"
                   for name, body in sections.items())


def train_config(args: argparse.Namespace, model_dir: str, data: str, run_dir: str) -> str:
    """The run's TOML (written beside the run, so its logs say what ran)."""
    max_len = args.prompt_len + 16 + args.max_new  # the prompt's "i: " prefix and its rounding
    max_len = -(-max_len // 64) * 64
    gpu = not args.cpu
    sections = {
        "job": {"dump_folder": run_dir, "description": "long-tailed pipelined GRPO run (bench/long_pipeline.py)"},
        "model": {"name": "qwen3", "hf_assets_path": model_dir},
        "optimizer": {"name": "AdamW", "lr": args.lr, "weight_decay": 0.0,
                      **({} if gpu else {"implementation": "for-loop"})},
        "lr_scheduler": {"warmup_steps": 1},
        "training": {"steps": args.steps, "seq_len": max_len, "max_norm": 1.0,
                     "mixed_precision_param": "bfloat16" if gpu else "float32"},
        "parallelism": {"data_parallel_shard_degree": 2},
        "activation_checkpoint": {"mode": "full"},
        "metrics": {"enable_tensorboard": False},
        "grpo": {"group_size": args.group_size, "prompts_per_step": args.prompts, "micro_batch_size": 1,
                 "micro_batch_tokens": max(args.micro_batch_tokens, max_len),
                 "logprob_chunk_tokens": args.logprob_chunk_tokens, "max_staleness": args.max_staleness},
        "rollout": {"task": "jsonl", "dataset_path": data, "reward_fn": "bench.long_pipeline:reward",
                    "max_new_tokens": args.max_new, "temperature": 1.0, "pipeline_depth": 1,
                    "use_chat_template": False},
        "inference": {"backend": "builtin", "num_servers": 2, "server_devices": args.server_devices.split(","),
                      "server_dtype": "bfloat16" if gpu else "float32", "kv_cache": "paged",
                      "max_model_len": max_len, "max_batch_size": args.max_batch_size,
                      # a group of the tail decodes for minutes: no retry for being long
                      "request_timeout_s": args.run_timeout_s, "startup_timeout_s": 600.0},
        "weight_sync": {"mode": "async", "transport": "nccl" if gpu else "gloo",
                        "dtype": "bfloat16" if gpu else "float32"},
    }
    path = os.path.join(run_dir, "long_pipeline.toml")
    with open(path, "w") as f:
        f.write(_toml(sections))
    return path


# --------------------------------------------------------------------- the run


def run(args: argparse.Namespace, config: str, run_dir: str) -> tuple[int, float]:
    """torchrun of grpo_train.py (2 ranks); killed with its process group after
    ``--run-timeout-s`` (the metrics logged until then are still read)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "grpo_train.py"), "--job.config_file", config, *args.extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    print("# " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(os.path.join(run_dir, "train.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)  # its own group: the servers it starts go with it
        try:
            rc = proc.wait(timeout=args.run_timeout_s)
        except subprocess.TimeoutExpired:
            print(f"# run stopped after --run-timeout-s {args.run_timeout_s:.0f} s", flush=True)
            rc = 124
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=grace)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
    return rc, time.perf_counter() - t0


# --------------------------------------------------------------------- table

COLUMNS = [  # (header, metric or a function of the row, format)
    ("step", "step", "{:.0f}"),
    ("step s", "time/step_s", "{:.1f}"),
    ("wait s", "time/wait_s", "{:.1f}"),
    ("train s", "time/train_s", "{:.1f}"),
    ("busy", lambda m: m.get("time/train_s", float("nan")) / m["time/step_s"], "{:.0%}"),
    ("push stall ms", lambda m: 1e3 * m.get("time/push_stall_s", float("nan")), "{:.0f}"),
    ("tokens", "rollout/tokens", "{:.0f}"),
    ("fleet tok/s", lambda m: m["rollout/tokens"] / m["rollout/interval_s"], "{:.0f}"),
    ("mean len", "rollout/completion_len", "{:.0f}"),
    ("max len", "rollout/completion_len_max", "{:.0f}"),
    ("trunc", "rollout/truncated_frac", "{:.2f}"),
    ("in flight", "rollout/in_flight_groups", "{:.0f}"),
    ("buffered", "rollout/buffered_groups", "{:.0f}"),
    ("admit lag", "rollout/admitted_lag_max", "{:.0f}"),
    ("stale mean", "offpolicy/staleness_mean", "{:.2f}"),
    ("stale max", "offpolicy/staleness_max", "{:.0f}"),
    ("dropped", "offpolicy/stale_dropped", "{:.0f}"),
    ("masked tok", "offpolicy/stale_tokens_masked", "{:.0f}"),
    ("srv lag", lambda m: max((v for k, v in m.items() if k.startswith("push/replica") and k.endswith("_version_lag")),
                              default=float("nan")), "{:.0f}"),
]


def _cell(m: dict, key, fmt: str) -> str:
    try:
        v = key(m) if callable(key) else m[key]
        return fmt.format(v)
    except (KeyError, ZeroDivisionError, TypeError, ValueError):
        return "-"


def print_table(rows: list[dict], warmup: int) -> None:
    print("| " + " | ".join(h for h, _, _ in COLUMNS) + " |")
    print("|" + " ---: |" * len(COLUMNS))
    for m in rows:
        print("| " + " | ".join(_cell(m, k, f) for _, k, f in COLUMNS) + " |")
    after = rows[warmup:] or rows
    if not after:
        print("\nno step was logged")
        return

    def mean(key: str) -> float:
        vals = [m[key] for m in after if key in m]
        return statistics.fmean(vals) if vals else float("nan")

    step, train, wait = sum(m["time/step_s"] for m in after), mean("time/train_s"), mean("time/wait_s")
    tokens = sum(m.get("rollout/tokens", 0.0) for m in after)
    fracs = {k: mean(k) for k in sorted({k for m in after for k in m if k.startswith("offpolicy/staleness_")
                                         and k.endswith("_frac")})}
    print(f"\nsummary over steps {after[0]['step']}-{after[-1]['step']} ({len(after)} steps, first {warmup} left out): "
          f"step {step / len(after):.1f} s, trainer busy {sum(m.get('time/train_s', 0.0) for m in after) / step:.0%} "
          f"(train {train:.1f} s, wait {wait:.1f} s per step), fleet {tokens / step:.0f} generated tok/s, "
          f"completion mean {mean('rollout/completion_len'):.0f} / max "
          f"{max(m.get('rollout/completion_len_max', 0) for m in after):.0f} tokens, "
          f"staleness mean {mean('offpolicy/staleness_mean'):.2f} / max "
          f"{max(m.get('offpolicy/staleness_max', 0) for m in after):.0f} versions, admitted lag max "
          f"{max(m.get('rollout/admitted_lag_max', 0) for m in after):.0f}, stale samples dropped "
          f"{sum(m.get('offpolicy/stale_dropped', 0) for m in after):.0f}, stale tokens masked "
          f"{sum(m.get('offpolicy/stale_tokens_masked', 0) for m in after):.0f}")
    if fracs:
        print("share of tokens by staleness (0, 1, 2, 3+ versions): " + ", ".join(f"{v:.2f}" for v in fracs.values()))
    outstanding = [k for k in after[-1] if k.startswith("pool/replica") and k.endswith("_outstanding")]
    if outstanding:
        print("groups outstanding per server at the takes (mean): "
              + ", ".join(f"{k.split('/')[1].split('_')[0]} {mean(k):.1f}" for k in sorted(outstanding)))


def read_metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "time/step_s" in r]  # step rows (no eval rows here)


# --------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Arguments after -- go to grpo_train.py.")
    ap.add_argument("--cpu", action="store_true", help="gloo ranks and CPU servers (with --tiny: the smoke test)")
    ap.add_argument("--tiny", action="store_true", help="the demo's tiny Qwen3 instead of the Qwen3-4B shape")
    ap.add_argument("--layers", type=int, default=36, help="layers of the Qwen3-4B shape")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 8; --tiny 3)")
    ap.add_argument("--warmup", type=int, default=1, help="steps left out of the summary")
    ap.add_argument("--prompts", type=int, default=None, help="grpo.prompts_per_step (default 8; --tiny 2)")
    ap.add_argument("--group-size", type=int, default=None, help="grpo.group_size (default 8; --tiny 2)")
    ap.add_argument("--min-new", type=int, default=None, help="smallest row budget (default 512; --tiny 8)")
    ap.add_argument("--max-new", type=int, default=None,
                    help="largest row budget = rollout.max_new_tokens (default 8192; --tiny 48)")
    ap.add_argument("--alpha", type=float, default=0.8, help="Pareto shape of the budgets (smaller: heavier tail)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt characters = tokens (default 128; --tiny 12)")
    ap.add_argument("--rows", type=int, default=512, help="dataset rows")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384,
                    help="grpo.micro_batch_tokens (at least max_model_len)")
    ap.add_argument("--logprob-chunk-tokens", type=int, default=None,
                    help="grpo.logprob_chunk_tokens (default 2048; --tiny 32)")
    ap.add_argument("--max-staleness", type=int, default=4, help="grpo.max_staleness")
    ap.add_argument("--max-batch-size", type=int, default=None, help="inference.max_batch_size (default 64; --tiny 8)")
    ap.add_argument("--server-devices", default=None, help="default cuda:2,cuda:3 (--cpu: cpu,cpu)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-timeout-s", type=float, default=1800.0,
                    help="the run is stopped after this (its logged steps are still tabled)")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="the whole bench's wall limit (assets included): the run is stopped 30 s before it; 0: none")
    ap.add_argument("--out", default=os.path.join(ROOT, "outputs", "bench_long_pipeline"))
    ap.add_argument("extra", nargs="*", help="more grpo_train.py overrides, after --")
    a = ap.parse_args(argv)
    tiny = a.tiny

    def pick(v, full, small):
        return v if v is not None else (small if tiny else full)
    a.steps, a.prompts, a.group_size = pick(a.steps, 8, 3), pick(a.prompts, 8, 2), pick(a.group_size, 8, 2)
    a.min_new, a.max_new, a.prompt_len = pick(a.min_new, 512, 8), pick(a.max_new, 8192, 48), pick(a.prompt_len, 128, 12)
    a.logprob_chunk_tokens = pick(a.logprob_chunk_tokens, 2048, 32)
    a.max_batch_size = pick(a.max_batch_size, 64, 8)
    a.server_devices = a.server_devices or ("cpu,cpu" if a.cpu else "cuda:2,cuda:3")
    if not 0 < a.min_new <= a.max_new:
        ap.error("need 0 < --min-new <= --max-new")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, ROOT)
    os.makedirs(args.out, exist_ok=True)
    run_dir = os.path.join(args.out, "run")
    os.makedirs(run_dir, exist_ok=True)
    for stale in ("metrics.jsonl", "train.log"):  # a rerun into the same folder tables only itself
        if os.path.exists(os.path.join(run_dir, stale)):
            os.remove(os.path.join(run_dir, stale))
    t0 = time.perf_counter()
    if args.tiny:
        from torchtitan_grpo.models.demo_assets import TinyQwen3, ensure_tiny_qwen3

        model_dir = ensure_tiny_qwen3(os.path.join(args.out, "tiny-qwen3"), TinyQwen3())
        shape = "tiny Qwen3 (2 layers, hidden 64)"
    else:
        device = "cpu" if args.cpu else "cuda:0"
        model_dir = write_model(os.path.join(args.out, f"qwen3-4b-shape-{args.layers}l"), args.layers, device,
                                args.seed)
        shape = f"Qwen3-4B shape ({args.layers} layers, random weights)"
    data = os.path.join(args.out, "prompts.jsonl")
    drawn = write_dataset(data, args)
    config = train_config(args, model_dir, data, run_dir)
    q = statistics.quantiles(drawn, n=10)
    print(f"# long_pipeline: {shape}, assets in {time.perf_counter() - t0:.0f} s; {args.prompts} prompts x "
          f"{args.group_size} samples per step, {args.steps} steps; row budgets Pareto(alpha {args.alpha}) "
          f"{args.min_new}..{args.max_new}: mean {statistics.fmean(drawn):.0f}, median {q[4]:.0f}, p90 {q[8]:.0f}, "
          f"at the cap {sum(b == args.max_new for b in drawn) / len(drawn):.0%}; servers on {args.server_devices} "
          f"(paged KV), trainer FSDP2 over 2 ranks, config {config}", flush=True)
    if args.budget_s > 0:
        args.run_timeout_s = min(args.run_timeout_s, max(args.budget_s - (time.perf_counter() - t0) - 30.0, 30.0))
    rc, wall = run(args, config, run_dir)
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    print(f"# run: exit {rc} after {wall:.0f} s, {len(rows)} of {args.steps} steps logged", flush=True)
    print_table(rows, min(args.warmup, max(len(rows) - 1, 0)))
    if rc != 0:
        with open(os.path.join(run_dir, "train.log"), errors="replace") as f:
            print("".join(f.readlines()[-40:]))
    return 0 if rc == 0 and len(rows) == args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
