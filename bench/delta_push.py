"""Delta push after real GRPO steps (issue 41): how many bf16 elements change
per version, and what sending only those costs against the full weights.

    python -m torchtitan_grpo.models.gguf SmolLM2-135M-Instruct.Q4_1.gguf OUT --dtype float32
    python bench/delta_push.py --model OUT                # the recipe's task, lr 1e-5, 1e-4, 1e-6
    python bench/delta_push.py --tiny                     # the demo's tiny Qwen3 (what the tests run)

The real-model recipe (train_configs/smollm2_arith.toml) on CPU: TorchTitan's
llama3 with float32 master weights (``trainer.build_policy``), one built-in
server (a subprocess) holding the pushed bf16 weights, the generated
arithmetic task scored by the ``math`` reward. Each step generates
``--prompts`` groups of ``--group`` samples from the server, takes one real
GRPO step (``trainer.train_step``, AdamW at a constant lr: the recipe's after
its warm-up, and 10x and 0.1x it) and pushes the HF-named weights as bf16
through the delta transport (``weight_sync/delta_push.py``, sync): version 1
goes whole (the server's weights came from disk), each later version as the
changes against the one before. ``--tiny``: the demo's tiny Qwen3 on its
digits task, for tests/test_bench_scripts.py.

Per version: the fraction of bf16 elements whose bits changed, the delta's
bytes against the full weights', the trainer's encode seconds, the POST
(transfer + the server's apply and load) and the server's apply seconds; and
for the codec choice, the other candidates on the same versions: int32
indices only (no bitmap), and the XOR of the old and new bits compressed
with zlib (level 1), its bytes and seconds.
After the last version of each lr, ``check`` compares weights read back from
the server (/get_weights_by_name) with the trainer's bf16 cast, bit for bit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torchtitan_grpo  # noqa: E402,F401  (before torchtitan)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, dtype: str, log: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "torchtitan_grpo.server", "--model", model_dir, "--port", str(port),
           "--dtype", dtype, "--num-threads", "1", "--max-batch-size", "64"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server not healthy within 300 s: see {log}")


def text_hash_reward(prompt: str, completion: str, row: dict) -> float:
    """``--tiny``'s reward: 0 or 1 by a hash of the text, so that (almost) every
    group of a random tiny model has a gradient; its meaning does not matter here."""
    return float(zlib.crc32(completion.encode()) % 2)


def build_trainer(model_dir: str, family: str, lr: float, seq_len: int, dump: str):
    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.train.trainer import Dist, build_policy

    cfg = parse_config(["--model.name", family, "--model.hf_assets_path", model_dir, "--training.seq_len",
                        str(seq_len), "--training.steps", "1000000", "--training.max_norm", "1.0",
                        "--optimizer.lr", str(lr), "--optimizer.beta1", "0.9", "--optimizer.beta2", "0.99",
                        "--optimizer.weight_decay", "0.0", "--optimizer.implementation", "for-loop",
                        "--lr_scheduler.warmup_steps", "1", "--lr_scheduler.min_lr_factor", "1.0",
                        "--grpo.micro_batch_size", "8", "--job.dump_folder", dump])
    d = Dist(0, 1, 0, torch.device("cpu"))
    return cfg, d, build_policy(cfg, model_dir, d)


def xor_zlib(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> tuple[int, float]:
    """The other codec: bytes and seconds of zlib (level 1) over the XOR of the raw bits."""
    from torchtitan_grpo.weight_sync.delta import bits

    t0 = time.perf_counter()
    size = 0
    for k, t in new.items():
        x = torch.bitwise_xor(bits(old[k]), bits(t))
        if bool(x.any()):
            size += len(zlib.compress(x.numpy().tobytes(), 1))
    return size, time.perf_counter() - t0


def changed_fraction(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> tuple[float, int]:
    """(fraction of elements whose bits changed, bytes of the delta with int32
    indices only, no bitmap: each tensor the smaller of indices + values and whole)."""
    from torchtitan_grpo.weight_sync.delta import bits

    changed = index_only = 0
    for k, t in new.items():
        n = int(torch.ne(bits(old[k]), bits(t)).sum())
        changed += n
        index_only += min(n * (4 + t.element_size()), t.numel() * t.element_size()) if n else 0
    return changed / sum(t.numel() for t in new.values()), index_only


def served_equal(url: str, want: dict[str, torch.Tensor], names: list[str]) -> bool:
    """Weights read back from the server are the trainer's bf16 cast, bit for bit."""
    for name in names:
        q = urllib.parse.urlencode({"name": name, "truncate_size": want[name].shape[0]})
        with urllib.request.urlopen(f"{url}/get_weights_by_name?{q}", timeout=120) as r:
            got = torch.tensor(json.loads(r.read()), dtype=torch.float32).bfloat16()
        if not torch.equal(got.view(-1).view(torch.int16), want[name].reshape(-1).view(torch.int16)):
            return False
    return True


def run_lr(args, lr: float, url: str, rows, scorer, tok, log_dir: str) -> list[dict]:
    from torchtitan_grpo.aio import LoopThread
    from torchtitan_grpo.fleet.pool import InferencePool, PoolConfig
    from torchtitan_grpo.fleet.types import SamplingParams
    from torchtitan_grpo.train.trainer import hf_weights, train_step
    from torchtitan_grpo.weight_sync.pusher import Pusher, PushConfig

    cfg, d, policy = build_trainer(args.model, args.family, lr, args.seq_len, log_dir)
    loop = LoopThread()
    pool = InferencePool([url], PoolConfig(backend="sglang", model=args.model, request_timeout_s=600))
    loop.run(pool.start())
    pusher = Pusher(loop, [url], PushConfig(mode="sync", backend="delta", dtype=torch.bfloat16, deadline_s=600),
                    torch.device("cpu"))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    out = []
    try:
        pusher.connect(initial_version=0)
        prev = None
        for v in range(1, args.steps + 1):
            batch = [next(rows) for _ in range(args.prompts)]
            ids = [scorer.encode_prompt(r["prompt"]) for r in batch]

            async def sample():
                return await asyncio.gather(*(pool.generate(p, args.group, params) for p in ids))

            groups = loop.run(sample(), timeout=1800)
            scored = [scorer.score(i, r, p, g) for i, (r, p, g) in enumerate(zip(batch, ids, groups))]
            samples = [s for g in scored for s in g.samples]
            tokens = sum(len(s.completion_ids) for s in samples)
            m = train_step(policy, samples, cfg.grpo, 1.0, args.max_new_tokens, global_num_samples=len(samples),
                           global_num_tokens=tokens, pad_id=tok.pad_token_id or 0, d=d)
            with torch.no_grad():
                new = {k: t.detach().to(torch.bfloat16) for k, t in hf_weights(policy).items()}
            pusher.push(new, v)  # bf16 already: the snapshot copies it as is
            h = pusher.transport.history[-1]
            row = {"lr": lr, "version": v, "reward": sum(r for g in scored for r in g.rewards) / len(samples),
                   "grad_norm": m["grad_norm"], **{k: h[k] for k in ("base", "bytes", "full_bytes", "encode_s",
                                                                    "post_s", "apply_s")}}
            if prev is not None:
                row["changed"], row["index_only"] = changed_fraction(prev, new)
                row["xor_bytes"], row["xor_s"] = xor_zlib(prev, new)
            prev = new
            out.append(row)
            print(format_row(row), flush=True)
        names = [n for n in new if n.endswith("norm.weight")][:2] + [next(n for n in new if "q_proj" in n)]
        out[-1]["check"] = "ok" if served_equal(url, new, names) else "MISMATCH"
    finally:
        pusher.close()
        loop.run(pool.close(), timeout=10)
        loop.close()
    return out


def format_row(r: dict) -> str:
    mb = 1e6
    changed = f"{100 * r['changed']:.3f}" if "changed" in r else "-"
    xor = (f"{r['index_only'] / mb:.2f} | {r['xor_bytes'] / mb:.2f} | {r['xor_s']:.2f}" if "xor_bytes" in r
           else "- | - | -")
    return (f"| {r['lr']:g} | {r['version']} | {'full' if r['base'] is None else 'delta'} | {changed} | "
            f"{r['bytes'] / mb:.2f} | {r['full_bytes'] / mb:.2f} | {r['bytes'] / r['full_bytes']:.4f} | "
            f"{r['encode_s']:.3f} | {r['post_s']:.3f} | {r['apply_s']:.3f} | {xor} | {r['reward']:.3f} | "
            f"{r.get('check', '')} |")


HEADER = ("| lr | version | sent | changed % | sent MB | full MB | sent / full | encode s | post s | apply s "
          "| indices-only MB | xor+zlib MB | xor+zlib s | reward | check |\n" + "|---" * 15 + "|")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="HF checkpoint dir (float32), e.g. SmolLM2-135M-Instruct converted")
    p.add_argument("--tiny", action="store_true", help="the demo's tiny Qwen3 on the digits task (smoke test)")
    p.add_argument("--lrs", default="1e-5,1e-4,1e-6", help="comma-separated learning rates (recipe: 1e-5)")
    p.add_argument("--steps", type=int, default=5, help="versions per lr (the first goes whole)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--server-dtype", default="float32",
                   help="the server's dtype (float32 is the fast one on CPU; it holds the pushed bf16 values)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from transformers import AutoTokenizer

    from torchtitan_grpo.rollout.producer import task_scorer

    log_dir = tempfile.mkdtemp(prefix="delta_push_")
    if args.tiny:
        from torchtitan_grpo.models.demo_assets import ensure_tiny_qwen3
        from torchtitan_grpo.rollout.tasks import digits_task_rows

        args.model = ensure_tiny_qwen3(os.path.join(log_dir, "tiny-qwen3"))
        args.family, args.seq_len, task, reward = "qwen3", 64, "digits", f"{__name__}:text_hash_reward"
        args.max_new_tokens = min(args.max_new_tokens, 8)
        rows = digits_task_rows(args.seed)
    else:
        from torchtitan_grpo.rollout.arith_task import make_arith_splits

        if not args.model:
            p.error("--model (a float32 HF checkpoint of SmolLM2-135M-Instruct) or --tiny")
        args.family, args.seq_len, task, reward = "llama3", 512, "jsonl", "math"
        n = args.prompts * args.steps * len(args.lrs.split(","))
        rows = iter(make_arith_splits(n, 0, seed=args.seed)[0])
    tok = AutoTokenizer.from_pretrained(args.model)
    scorer = task_scorer(tok, task, reward, use_chat_template=True, group_size=args.group)
    proc, url = start_server(args.model, args.server_dtype, os.path.join(log_dir, "server.log"))
    print(f"model {args.model}; server {url} ({args.server_dtype}); logs {log_dir}", flush=True)
    print(HEADER, flush=True)
    results = []
    try:
        for lr in (float(x) for x in args.lrs.split(",")):
            results += run_lr(args, lr, url, rows, scorer, tok, log_dir)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print("\n" + HEADER)
    for r in results:
        print(format_row(r))
    checks = [r["check"] for r in results if "check" in r]
    ok = all(c == "ok" for c in checks) and all(r["base"] is None for r in results if r["version"] == 1)
    deltas = [r for r in results if r["version"] > 1]
    ok = ok and all(r["base"] == r["version"] - 1 for r in deltas)
    print(("PASS" if ok else "FAIL") + ": every version after the first went as a delta against the one before, "
          "and the server's weights read back equal the trainer's bf16 cast")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
