"""Greedy accuracy of an HF checkpoint in transformers, outside the training
loop: the independent check of an exported policy (``[checkpoint]
hf_export``) against the last ``[eval]`` line of its run.

    python scripts/eval_hf.py outputs/smollm2_arith/hf data/arith/eval.jsonl --reward math [--max-samples 200]

Prompts go through the tokenizer's chat template as one user turn (as
``rollout.use_chat_template`` does), are decoded greedily in batches and
scored by the reward (a built-in name or "package.module:function");
prints one line: ``pass@1 <accuracy> over <n> prompts``.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("dataset")
    p.add_argument("--reward", default="math")
    p.add_argument("--prompt-key", default="prompt")
    p.add_argument("--max-samples", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threshold", type=float, default=1.0, help="a reward at least this counts as correct")
    a = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import torchtitan_grpo  # noqa: F401
    from torchtitan_grpo.rollout.rewards import load_reward_fn
    from torchtitan_grpo.rollout.tasks import load_prompts

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=getattr(torch, a.dtype)).to(device).eval()
    reward = load_reward_fn(a.reward)
    rows = load_prompts(a.dataset, a.prompt_key)
    rows = rows[:a.max_samples] if a.max_samples else rows
    correct = 0
    for start in range(0, len(rows), a.batch_size):
        batch = rows[start:start + a.batch_size]
        texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                         add_generation_prompt=True) for r in batch]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=a.max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        for r, ids in zip(batch, out[:, enc["input_ids"].shape[1]:]):
            completion = tok.decode(ids, skip_special_tokens=True)
            correct += reward(r["prompt"], completion, r) >= a.threshold
    acc = correct / max(len(rows), 1)
    print(f"pass@1 {acc:.4f} over {len(rows)} prompts ({a.model_dir}, {a.dtype}, greedy)")
    return acc


if __name__ == "__main__":
    main(sys.argv[1:])
