"""Write a generated arithmetic task as train.jsonl and eval.jsonl (no downloads).

    python scripts/make_arith_dataset.py --out-dir data/arith [--train 5000] [--eval 200] [--seed 0] [--kind mix]

Rows are ``{"prompt": ..., "answer": "... #### <value>"}`` (GSM8K's answer
format), for ``[rollout] task = "jsonl"`` with ``reward_fn = "math"``; the two
files never share a problem. Kinds and sizes: torchtitan_grpo/rollout/arith_task.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from torchtitan_grpo.rollout.arith_task import KINDS, make_arith_splits


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True, help="folder for train.jsonl and eval.jsonl")
    p.add_argument("--train", type=int, default=5000, help="train rows")
    p.add_argument("--eval", type=int, default=200, help="eval rows (held out)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kind", default="mix", choices=KINDS)
    a = p.parse_args(argv)
    try:
        train, held_out = make_arith_splits(a.train, a.eval, seed=a.seed, kind=a.kind)
    except ValueError as e:
        p.error(str(e))
    os.makedirs(a.out_dir, exist_ok=True)
    write_jsonl(os.path.join(a.out_dir, "train.jsonl"), train)
    write_jsonl(os.path.join(a.out_dir, "eval.jsonl"), held_out)
    print(f"wrote {len(train)} train and {len(held_out)} eval rows ({a.kind}, seed {a.seed}) to {a.out_dir}")


if __name__ == "__main__":
    main(sys.argv[1:])
