"""Does a server's sampler draw from the distribution its log-probs report?
One server per call, over /v1/completions (a real vLLM or the built-in server),
then a table that sets the calls side by side.

    python scripts/sampler_check.py --url http://127.0.0.1:8000 --model-dir DIR --prompts data/arith/eval.jsonl \
        --label vllm --out /tmp/vllm.json
    python scripts/sampler_check.py --launch vllm --device cuda:0 --engine-args=--use-fp64-gumbel \
        --model-dir DIR --prompts data/arith/eval.jsonl --label vllm-fp64 --out /tmp/vllm64.json
    python scripts/sampler_check.py --compare /tmp/builtin.json /tmp/vllm.json

``--launch builtin|vllm`` starts the server the way grpo_train does
(fleet/launcher.py, fleet/engine_commands.py), checks it, and stops it.

Two measures, both at temperature 1 without truncation:

1. The first token of one fixed prompt, drawn ``--draws`` times (``max_tokens``
   1, top-20 log-probs reported). A chi-square test of the counts of the
   top-20 tokens (plus one bucket for the rest) against the probabilities the
   server itself reports. It catches a sampler whose head is wrong.
2. The tail: every sampled token of ``--prompts-n`` prompts x ``--n`` samples
   x up to ``--max-tokens`` tokens, binned by the log-probability the server
   reported for it. For an exact sampler, the chance that a step draws a
   token of probability below ``eps`` is the mass of those tokens; two exact
   samplers on the same weights and prompts give the same rate whatever their
   random streams. A sampler whose noise is coarse (fp32 exponential races:
   the smallest nonzero draw is about 6e-8, so a near-zero draw hands the step
   to a token far below its share) shows as an excess of rare tokens, and in
   the rewards and the truncated share of the completions, which are scored
   with ``--reward`` (default ``math``, the arithmetic recipe's reward, by the
   name grpo_train's ``rollout.reward_fn`` takes).

Between calls, only the server changes; ``--compare`` prints each call's rates
and, for each bin, a z-score of the difference from the first call (a
two-sample test of Poisson rates).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torchtitan_grpo  # noqa: E402,F401  (before torchtitan)

# Sampled-token log-probability bins, upper edges (the last bin is everything above -4).
BIN_EDGES = (-20.0, -16.0, -12.0, -8.0, -4.0)
BIN_NAMES = ("< -20", "-20..-16", "-16..-12", "-12..-8", "-8..-4", ">= -4")
TOP = 20


def _call(url: str, path: str, api_key: str | None, body: dict | None = None, timeout: float = 600.0) -> dict:
    """GET ``path`` (``body`` None) or POST ``body`` as JSON; the reply's JSON."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    data = None
    if body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    with urllib.request.urlopen(urllib.request.Request(url.rstrip("/") + path, data=data, headers=headers),
                                timeout=timeout) as r:
        return json.loads(r.read())


def _served_name(url: str, api_key: str | None) -> str:
    return _call(url, "/v1/models", api_key, timeout=60)["data"][0]["id"]


def _sample(url: str, model: str, prompt_ids: list[int], api_key: str | None, seed: dict, **fields) -> dict:
    """One /v1/completions request at temperature 1 with no truncation, its tokens as ids (``fields``:
    max_tokens, n, logprobs and the rest)."""
    return _call(url, "/v1/completions", api_key, {
        "model": model, "prompt": prompt_ids, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
        "return_token_ids": True, "return_tokens_as_token_ids": True, **seed, **fields})


def _seed(seed: int | None, offset: int) -> dict:
    # A distinct seed per request (vLLM gives its n samples seed, seed + 1, ...); None: unseeded,
    # the engine's own stream (vLLM then draws every row's noise in one batched call).
    return {} if seed is None else {"seed": seed + offset}


def _bin(lp: float) -> int:
    for i, edge in enumerate(BIN_EDGES):
        if lp < edge:
            return i
    return len(BIN_EDGES)


def _token_id(key: str) -> int:
    # With return_tokens_as_token_ids the keys are "token_id:<id>".
    return int(key.split(":", 1)[1])


def chi_square(counts: dict[int, int], probs: dict[int, float]) -> tuple[float, int, float]:
    """Pearson's statistic, degrees of freedom and p-value of ``counts`` (draws
    per token id) against ``probs`` (the reported head of the distribution):
    one cell per token expected at least 5 times, the rest pooled into one."""
    import torch

    n = sum(counts.values())
    big = {t: p for t, p in probs.items() if n * p >= 5}  # the test needs about 5 expected per cell
    cells = [(counts.get(t, 0), n * p) for t, p in big.items()]
    rest_p = max(0.0, 1.0 - sum(big.values()))
    if n * rest_p >= 5:
        cells.append((n - sum(counts.get(t, 0) for t in big), n * rest_p))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1  # the counts sum to n
    if dof <= 0:
        return stat, dof, float("nan")
    p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64))
    return stat, dof, float(p_value)


def first_token(url: str, model: str, prompt_ids: list[int], draws: int, per_request: int,
                api_key: str | None, seed: int | None) -> dict:
    """Counts of the first sampled token over ``draws`` draws, and the top-20
    probabilities the server reported for that position."""
    counts: dict[int, int] = {}
    probs: dict[int, float] | None = None
    calls = -(-draws // per_request)

    def one(i: int) -> dict:
        return _sample(url, model, prompt_ids, api_key, _seed(seed, 7919 * i), max_tokens=1, n=per_request,
                       logprobs=TOP)

    with ThreadPoolExecutor(8) as ex:
        for body in ex.map(one, range(calls)):
            for c in body["choices"]:
                counts[c["token_ids"][0]] = counts.get(c["token_ids"][0], 0) + 1
                if probs is None:
                    top = c["logprobs"]["top_logprobs"][0]
                    probs = {_token_id(k): math.exp(v) for k, v in top.items()}
    assert probs is not None, "no choices came back"
    stat, dof, p_value = chi_square(counts, probs)
    head = sorted(probs.items(), key=lambda kv: -kv[1])[:5]
    n = sum(counts.values())
    return {"draws": n, "chi2": stat, "dof": dof, "p_value": p_value,
            "head": [{"token": t, "p": p, "observed": counts.get(t, 0) / n} for t, p in head]}


def tail(url: str, model: str, prompts: list[list[int]], rows: list[dict], n: int, max_tokens: int,
         stop_ids: list[int], api_key: str | None, seed: int | None, tok, reward) -> dict:
    """Sampled-token log-prob bins, rewards and lengths over ``prompts`` x ``n``."""

    def one(k: int) -> dict:
        return _sample(url, model, prompts[k], api_key, _seed(seed, 1009 * k), max_tokens=max_tokens, n=n,
                       logprobs=0, stop_token_ids=stop_ids)

    bins = [0] * len(BIN_NAMES)
    tokens = truncated = stopped = stop_token_last = 0
    lp_sum = 0.0
    rewards: list[float] = []
    lowest: list[float] = []
    with ThreadPoolExecutor(16) as ex:
        for k, body in enumerate(ex.map(one, range(len(prompts)))):
            for c in body["choices"]:
                lps = c["logprobs"]["token_logprobs"]
                for lp in lps:
                    bins[_bin(lp)] += 1
                lp_sum += sum(lps)
                tokens += len(lps)
                lowest.append(min(lps) if lps else 0.0)
                truncated += c["finish_reason"] == "length"
                if c["finish_reason"] == "stop":
                    # Does the reply carry the stop token? The trainer learns to stop only from it.
                    stopped += 1
                    stop_token_last += bool(c["token_ids"]) and c["token_ids"][-1] in stop_ids
                text = tok.decode(c["token_ids"], skip_special_tokens=True)
                rewards.append(float(reward(rows[k]["prompt"], text, rows[k])))
    samples = len(rewards)
    return {"samples": samples, "tokens": tokens, "bins": bins,
            "per_1k": [1000.0 * b / max(tokens, 1) for b in bins],
            "reward_mean": sum(rewards) / max(samples, 1), "truncated_frac": truncated / max(samples, 1),
            "mean_len": tokens / max(samples, 1),
            # Minus the entropy of the visited distributions, for an exact sampler: a sharper one reads higher.
            "mean_sampled_logprob": lp_sum / max(tokens, 1),
            "stopped_with_stop_token_last": stop_token_last / max(stopped, 1),
            "samples_with_a_token_below_1e-6": sum(lp < math.log(1e-6) for lp in lowest) / max(samples, 1)}


def check(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from torchtitan_grpo.rollout.rewards import load_reward_fn
    from torchtitan_grpo.rollout.tasks import load_prompts

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    rows = load_prompts(args.prompts)[: args.prompts_n]
    if not rows:
        sys.exit(f"sampler_check: --prompts {args.prompts}: no prompts")

    def encode(text: str) -> list[int]:
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False))

    prompts = [encode(r["prompt"]) for r in rows]
    model = args.model or _served_name(args.url, args.api_key)
    stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
    seed = None if args.no_seed else args.seed
    out = {"label": args.label, "url": args.url, "seeded": seed is not None, "reward": args.reward,
           "first_token": first_token(args.url, model, prompts[0], args.draws, args.per_request, args.api_key, seed),
           "tail": tail(args.url, model, prompts, rows, args.n, args.max_tokens, stop, args.api_key, seed, tok,
                       load_reward_fn(args.reward))}
    return out


def launched(args: argparse.Namespace):
    """Start ``--launch``'s engine on ``--device`` as grpo_train would; return (url, stop)."""
    from torchtitan_grpo.fleet.engine_commands import EngineLaunch
    from torchtitan_grpo.fleet.launcher import ServerSpec, start_servers, stop_process

    launch = EngineLaunch(gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                          args=tuple(a for a in args.engine_args.split(",") if a))
    spec = ServerSpec(model_dir=args.model_dir, device=args.device, dtype=args.dtype, engine=args.launch,
                      launch=launch, seed=args.seed)
    (server,) = start_servers([spec], args.log_dir, timeout_s=args.startup_timeout_s)
    return server.url, lambda: stop_process(server.proc, grace_s=30)


def _z(a: int, ta: int, b: int, tb: int) -> float:
    """Two-sample z of Poisson rates a/ta vs b/tb (conditional binomial, normal approximation)."""
    if a + b == 0:
        return 0.0
    share = ta / (ta + tb)
    return (a - (a + b) * share) / math.sqrt((a + b) * share * (1 - share))


def compare(paths: list[str]) -> str:
    runs = []
    for p in paths:
        with open(p) as f:
            runs.append(json.load(f))
    ref = runs[0]["tail"]
    lines = ["| | " + " | ".join(r["label"] for r in runs) + " |", "| --- |" + " --- |" * len(runs)]

    def row(name: str, cells: list[str]) -> None:
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    row("first token: draws, chi2/dof, p", [f"{r['first_token']['draws']}, {r['first_token']['chi2']:.1f}/"
                                            f"{r['first_token']['dof']}, {r['first_token']['p_value']:.3f}"
                                            for r in runs])
    row("samples / tokens", [f"{r['tail']['samples']} / {r['tail']['tokens']}" for r in runs])
    row(f"reward ({runs[0].get('reward', 'math')}), mean", [f"{r['tail']['reward_mean']:.3f}" for r in runs])
    row("truncated share", [f"{r['tail']['truncated_frac']:.3f}" for r in runs])
    row("mean completion tokens", [f"{r['tail']['mean_len']:.1f}" for r in runs])
    row("mean sampled log-prob", [f"{r['tail']['mean_sampled_logprob']:.4f}" for r in runs])
    row("stopped replies ending in the stop token", [f"{r['tail']['stopped_with_stop_token_last']:.3f}" for r in runs])
    row("samples with a token p < 1e-6", [f"{r['tail']['samples_with_a_token_below_1e-6']:.3f}" for r in runs])
    for i, name in enumerate(BIN_NAMES):
        cells = []
        for r in runs:
            t = r["tail"]
            z = _z(t["bins"][i], t["tokens"], ref["bins"][i], ref["tokens"])
            cells.append(f"{t['per_1k'][i]:.3f}" + ("" if r is runs[0] else f" (z {z:+.1f})"))
        row(f"sampled log-prob {name}, per 1k tokens", cells)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="print the table of earlier calls' --out files")
    ap.add_argument("--url", help="the server (its /v1/completions)")
    ap.add_argument("--launch", choices=("builtin", "vllm"), help="start this engine instead of --url")
    ap.add_argument("--device", default="cuda:0", help="--launch: its device")
    ap.add_argument("--dtype", default="bfloat16", help="--launch: its dtype")
    ap.add_argument("--engine-args", default="", help="--launch vllm: flags appended, comma-separated")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="--launch vllm")
    ap.add_argument("--max-model-len", type=int, default=512, help="--launch vllm")
    ap.add_argument("--startup-timeout-s", type=float, default=400.0, help="--launch: a hang guard")
    ap.add_argument("--log-dir", default="/tmp/sampler_check", help="--launch: the server's log goes here")
    ap.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    ap.add_argument("--model-dir", help="the model's HF directory (its tokenizer and chat template)")
    ap.add_argument("--prompts", help="a jsonl of {'prompt', 'answer'} rows (scripts/make_arith_dataset.py)")
    ap.add_argument("--prompts-n", type=int, default=64)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--draws", type=int, default=4096, help="first-token draws")
    ap.add_argument("--per-request", type=int, default=64, help="first-token draws per request (n)")
    ap.add_argument("--reward", default="math", help="reward function, as rollout.reward_fn names it")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-seed", action="store_true", help="requests without a seed (the engine's own stream)")
    ap.add_argument("--also-unseeded", metavar="JSON",
                    help="then the same check without seeds, on the same server, written here")
    ap.add_argument("--api-key", default=os.environ.get("GRPO_API_KEY"))
    ap.add_argument("--label", default="server")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.compare:
        print(compare(args.compare))
        return
    for flag in ("model_dir", "prompts"):
        if not getattr(args, flag):
            ap.error(f"--{flag.replace('_', '-')} is required (or --compare)")
    if not (args.url or args.launch):
        ap.error("--url or --launch is required (or --compare)")
    stop = None
    if args.launch:
        args.url, stop = launched(args)
    runs = [(args.out, args)]
    if args.also_unseeded:
        runs.append((args.also_unseeded,
                     argparse.Namespace(**{**vars(args), "no_seed": True, "label": args.label + " unseeded"})))
    try:
        results = [(path, check(a)) for path, a in runs]
    finally:
        if stop is not None:
            stop()
    for path, result in results:
        if path:
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
        print(compare([path]) if path else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
