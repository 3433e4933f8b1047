"""Write the code-completion task (complete a held-out Python function from its
signature and docstring) as train.jsonl and eval.jsonl.

    python scripts/make_code_dataset.py --out-dir data/code                 # site-packages, like pretraining
    python scripts/make_code_dataset.py --out-dir /tmp/code --corpus DIR    # any folder of .py files

The functions come only from the files ``scripts/pretrain_moe.py`` holds out
(the same roots, the same ``--val-frac``: its own :func:`split_files`,
imported, so the GRPO prompts are text the pretrained model never trained
on). Those files are split again by a hash of their path: ``--eval-frac`` of
them give the eval rows, the rest the training rows, so no file gives both.
Rows and the reward (``reward_fn = "code_complete"``):
torchtitan_grpo/rollout/code_task.py; every row's reference body scores 1.0.

Why a script and not the package: the held-out split lives in
``scripts/pretrain_moe.py`` and the package imports no script; this builder
imports it, so the rule exists once.

Deterministic: the same files give the same bytes (files in hash order,
functions in file order; ``--max-train`` / ``--max-eval`` keep the first
rows of that order).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torchtitan_grpo  # noqa: E402,F401  (before torchtitan, which pretrain_moe's imports reach)

from scripts.pretrain_moe import default_roots, list_sources, split_files  # noqa: E402
from torchtitan_grpo.rollout.code_task import function_rows  # noqa: E402

EVAL_SALT = "code-eval:"  # a second hash of the path, independent of pretraining's split


def _eval_file(rel: str, eval_frac: float) -> bool:
    digest = hashlib.sha1((EVAL_SALT + rel).encode()).hexdigest()[:12]
    return int(digest, 16) / float(1 << 48) < eval_frac


def held_out_files(roots: list[str], val_frac: float) -> list[tuple[str, str]]:
    """``(path relative to its root, path)`` of the files pretraining held out, in its hash order."""
    files = list_sources(roots)
    if len(files) < 2:
        raise SystemExit(f"make_code_dataset.py: error: --corpus {' '.join(roots)}: {len(files)} .py file(s); "
                         "need >= 2 (pretraining's split holds one out)")
    rel_of = {path: rel for rel, path in files}
    return [(rel_of[p], p) for p in split_files(files, val_frac)[1]]


def read_source(path: str) -> str | None:
    """The file's text, or None if it cannot be read as UTF-8."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def build(a: argparse.Namespace) -> tuple[list[dict], list[dict], dict]:
    """(train rows, eval rows, counts)."""
    files = held_out_files(a.corpus or default_roots(), a.val_frac)
    train, held = [], []
    counts = {"held_out_files": len(files), "unreadable_files": 0}
    for rel, path in files:
        source = read_source(path)
        if source is None:
            counts["unreadable_files"] += 1
            continue
        rows = function_rows(source, rel, context_bytes=a.context_bytes, max_prompt_bytes=a.max_prompt_bytes,
                             max_body_bytes=a.max_body_bytes)
        (held if _eval_file(rel, a.eval_frac) else train).extend(rows)
    counts.update(train_rows_found=len(train), eval_rows_found=len(held))
    return train[: a.max_train], held[: a.max_eval], counts


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--out-dir", required=True, help="folder for train.jsonl and eval.jsonl")
    add("--corpus", action="append", metavar="DIR", help="root of .py files (repeatable); default: "
        "pretrain_moe.py's (site-packages, torch)")
    add("--val-frac", type=float, default=0.02, help="pretrain_moe.py's --val-frac (its default)")
    add("--eval-frac", type=float, default=0.3, help="share of the held-out files whose functions are eval rows")
    add("--context-bytes", type=int, default=256, help="source lines before the function kept in the prompt")
    add("--max-prompt-bytes", type=int, default=384, help="prompt limit, context and head together")
    add("--max-body-bytes", type=int, default=96, help="longest reference body kept")
    add("--max-train", type=int, default=100_000)
    add("--max-eval", type=int, default=256)
    a = p.parse_args(argv)
    for flag in ("context_bytes", "max_prompt_bytes", "max_body_bytes", "max_train", "max_eval"):
        if getattr(a, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(a, flag)}")
    for flag in ("val_frac", "eval_frac"):
        if not 0 < getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be in (0, 1), got {getattr(a, flag)}")
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    train, held, counts = build(a)
    if not train or not held:
        raise SystemExit(f"make_code_dataset.py: error: {counts['held_out_files']} held-out files gave "
                         f"{len(train)} train and {len(held)} eval rows; need both (a larger --corpus, "
                         "--val-frac or --eval-frac)")
    os.makedirs(a.out_dir, exist_ok=True)
    write_jsonl(os.path.join(a.out_dir, "train.jsonl"), train)
    write_jsonl(os.path.join(a.out_dir, "eval.jsonl"), held)
    counts.update(train_rows=len(train), eval_rows=len(held))
    prompt = sorted(len(r["prompt"].encode()) for r in train + held)
    body = sorted(len(r["answer"].encode()) for r in train + held)
    print(f"wrote {len(train)} train and {len(held)} eval rows to {a.out_dir} from {counts['held_out_files']} "
          f"held-out files ({counts['train_rows_found']} / {counts['eval_rows_found']} found, "
          f"{counts['unreadable_files']} unreadable); median prompt {prompt[len(prompt) // 2]} bytes, "
          f"median reference body {body[len(body) // 2]} bytes", flush=True)
    return counts


if __name__ == "__main__":
    main()
