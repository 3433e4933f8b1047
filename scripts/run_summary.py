"""One table of the figures a device run's loops are compared on, from each
run's metrics file: held-out pass@1 at its first and last evaluation, reward,
step and push seconds, the trainer-vs-server log-prob gap, staleness.

    python scripts/run_summary.py OUT_DIR RUN [RUN ...]    # reads OUT_DIR/<RUN>-metrics.jsonl
"""

from __future__ import annotations

import json
import os
import statistics
import sys


def _rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else None


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(vals) / len(vals) if vals else None


def summary(rows: list[dict]) -> dict[str, str]:
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/pass@1" in r]
    late = steps[1:]  # the first step carries start-up costs

    def fmt(v: float | None, spec: str = ".3f") -> str:
        return "-" if v is None else format(v, spec)

    rewards = [r["reward/mean"] for r in steps if "reward/mean" in r]
    k = min(10, len(rewards))
    return {
        "steps": str(len(steps)),
        "pass@1 first -> last eval": (f"{evals[0]['eval/pass@1']:.3f} (step {evals[0]['step']}) -> "
                                      f"{evals[-1]['eval/pass@1']:.3f} (step {evals[-1]['step']})") if evals else "-",
        "reward, first / last 10 steps": (f"{sum(rewards[:k]) / k:.3f} / {sum(rewards[-k:]) / k:.3f}" if k else "-"),
        "step s (median)": fmt(_median(late, "time/step_s")),
        "push s (median, sync: until served)": fmt(_median(late, "time/push_s")),
        "push stall s (median)": fmt(_median(late, "time/push_stall_s"), ".4f"),
        "generate s (median)": fmt(_median(late, "time/generate_s")),
        "abs dlogp trainer vs server, mean (median of steps)": fmt(_median(steps, "trainer_vs_rollout_logprob_mean_abs_diff"), ".4f"),
        "abs dlogp max (median of steps)": fmt(_median(steps, "trainer_vs_rollout_logprob_max_abs_diff")),
        "abs dlogp max (worst step)": fmt(max((r.get("trainer_vs_rollout_logprob_max_abs_diff", 0.0) for r in steps),
                                            default=None)),
        "reward, steps 2-6": (", ".join(f"{x:.3f}" for x in rewards[1:6]) if len(rewards) > 1 else "-"),
        "truncated share (median of steps)": fmt(_median(steps, "rollout/truncated_frac")),
        "groups aborted by a push and resent (last count)": fmt(steps[-1].get("pool/aborts") if steps else None, ".0f"),
        "k3 KL trainer vs rollout (median of steps)": fmt(_median(steps, "trainer_vs_rollout_k3"), ".2e"),
        "tokens with abs dlogp > 0.5 / > 1.0 (mean of steps)": (
            f"{fmt(_mean(steps, 'trainer_vs_rollout_extreme_frac_0.5'), '.2e')} / "
            f"{fmt(_mean(steps, 'trainer_vs_rollout_extreme_frac_1.0'), '.2e')}"),
        "importance weight mean / max (median of steps)": (
            f"{fmt(_median(steps, 'offpolicy/is_weight_mean'), '.4f')} / {fmt(_median(steps, 'offpolicy/is_weight_max'), '.3f')}"),
        "importance weights capped, clip fraction (median of steps)": (
            f"{fmt(_median(steps, 'offpolicy/is_capped_frac'), '.4f')}, {fmt(_median(steps, 'clip_fraction'), '.4f')}"),
        "staleness mean (median of steps)": fmt(_median(steps, "offpolicy/staleness_mean")),
        "unknown-version samples (sum)": fmt(sum(r.get("offpolicy/unknown_version", 0.0) for r in steps), ".0f"),
        "push failures (last)": fmt(steps[-1].get("push/failures") if steps else None, ".0f"),
    }


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit(__doc__)
    out, runs = argv[0], argv[1:]
    table = {run: summary(_rows(os.path.join(out, f"{run}-metrics.jsonl"))) for run in runs}
    keys = list(next(iter(table.values())))
    print("| | " + " | ".join(runs) + " |")
    print("| --- |" + " --- |" * len(runs))
    for key in keys:
        print(f"| {key} | " + " | ".join(table[run][key] for run in runs) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
