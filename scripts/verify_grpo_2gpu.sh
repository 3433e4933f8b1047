#!/usr/bin/env bash
# 2-GPU smoke test of the whole GRPO loop, with its result checked:
#
#   bash scripts/verify_grpo_2gpu.sh            # trainer on cuda:0, built-in server on cuda:1, async NCCL push
#   bash scripts/verify_grpo_2gpu.sh --cpu      # the same on CPU (gloo push, CPU server)
#   bash scripts/verify_grpo_2gpu.sh --one-gpu  # one GPU for both: trainer and server on cuda:0, CUDA IPC push
#   bash scripts/verify_grpo_2gpu.sh [--cpu|--one-gpu] --training.steps 10 ...   # extra grpo_train overrides
#     (e.g. --one-gpu --weight_sync.transport gloo, or disk)
#
# Runs grpo_train.py (torchrun, one trainer rank) with train_configs/verify_2gpu.toml:
# the demo's tiny Qwen3 (written to $DUMP/tiny-qwen3 first), the digits task, one built-in server
# in float32. The driver below calls grpo_train.main unchanged and only
# observes: it keeps a handle on the policy that train_step receives, and just
# before the run's summary (after the last push, which waits for delivery,
# and while the server is still up) it checks:
#
#   1. weights: every tensor the server holds (GET /get_weights_by_name) is
#      bit-equal to the trainer's final weights (trainer.hf_weights), and the
#      server serves version == the number of optimizer steps taken;
#   2. logprobs: the server samples a few completions (POST /generate with
#      logprobs) and the trainer's model scores the same tokens at the same
#      temperature: max |trainer - server| must be <= tol. This is the
#      on-policy check for the final, synchronised version; metrics.jsonl's
#      per-step trainer_vs_rollout_logprob_max_abs_diff is also printed, but
#      in async mode a step's rollouts may come from the previous version, so
#      only step 1 (initial weights on both sides) is held to tol.
#
# Prints PASS/FAIL lines and "VERIFY PASS" or "VERIFY FAIL"; exit code 0 iff PASS.
# Output (metrics.jsonl, server logs, check.json) goes to $OUT/verify_2gpu when
# $OUT is set, else outputs/verify_2gpu. Set PYTHON to choose the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
CPU=0
ONE_GPU=0
EXTRA=()
for a in "$@"; do
  case "$a" in
    --cpu) CPU=1 ;;
    --one-gpu) ONE_GPU=1 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) EXTRA+=("$a") ;;
  esac
done

DUMP=${VERIFY_DUMP:-${OUT:-outputs}/verify_2gpu}
mkdir -p "$DUMP"
rm -f "$DUMP/metrics.jsonl" "$DUMP/check.json"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# The trainer creates a missing model only at the demo's own path: write ours first (kept if there).
"$PYTHON" -m torchtitan_grpo.models.demo_assets "$DUMP/tiny-qwen3" > /dev/null
ARGS=(--job.config_file train_configs/verify_2gpu.toml --job.dump_folder "$DUMP"
      --model.hf_assets_path "$DUMP/tiny-qwen3")
if [ "$CPU" = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
  ARGS+=(--inference.server_device cpu --weight_sync.transport gloo)
  export VERIFY_TOL=${VERIFY_TOL:-1e-4}
else
  n=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
  need=$(( ONE_GPU ? 1 : 2 ))
  if [ "$n" -lt "$need" ]; then
    echo "verify_grpo_2gpu: needs $need GPU(s), found $n (use --cpu for the CPU version)" >&2
    exit 2
  fi
  # NCCL cannot join two processes on one GPU: a server beside the trainer maps the trainer's
  # staging buffers (CUDA IPC), or takes gloo or disk if asked.
  if [ "$ONE_GPU" = 1 ]; then
    ARGS+=(--inference.server_device cuda:0 --weight_sync.transport ipc)
  fi
  export VERIFY_TOL=${VERIFY_TOL:-1e-3}
fi

DRIVER=$(mktemp --suffix=_verify_driver.py)
trap 'rm -f "$DRIVER"' EXIT
cat > "$DRIVER" <<'PY'
"""grpo_train.main, unchanged, plus the final checks (see verify_grpo_2gpu.sh)."""
import json
import os
import sys
import traceback
import urllib.parse
import urllib.request

import torch
from transformers import AutoTokenizer

import grpo_train
from torchtitan_grpo.train import loss as grpo_losses
from torchtitan_grpo import session
from torchtitan_grpo.config.parse import parse_config
from torchtitan_grpo.train.trainer import hf_weights

TOL = float(os.environ["VERIFY_TOL"])
PROMPTS = ["3>", "7>", "0>", "12345>", "hello>"]
seen = {}


def _get(url):
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def final_check(side):
    """Server weights and logprobs against the trainer's, while the server is up."""
    policy, temperature, device = seen["policy"], seen["temperature"], seen["device"]
    weights = hf_weights(policy)
    # The run's tokenizer (the rollout client that holds one may be a process of its own).
    tok = AutoTokenizer.from_pretrained(seen["hf_dir"])
    out = {"replicas": []}
    for rep in side.pusher.replicas:
        url = rep.url
        info = _get(url + "/model_info")
        worst, unequal = 0.0, []
        for name, t in weights.items():
            q = urllib.parse.urlencode({"name": name, "truncate_size": t.shape[0] if t.dim() else 1})
            ref = t.detach().to("cpu", torch.float32)
            served = torch.tensor(_get(f"{url}/get_weights_by_name?{q}"), dtype=torch.float32).reshape(ref.shape)
            worst = max(worst, float((served - ref).abs().max()))
            if not torch.equal(served, ref):
                unequal.append(name)
        ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]  # the digits task's encoding
        gen = _post(url + "/generate", {"input_ids": ids, "return_logprob": True, "sampling_params": {
            "max_new_tokens": 8, "temperature": temperature, "ignore_eos": True, "sampling_seed": 1234}})
        lp_diff, gen_versions = 0.0, set()
        with torch.no_grad():
            for prompt, g in zip(ids, gen):
                out_ids = g["output_ids"]
                server_lp = torch.tensor([x[0] for x in g["meta_info"]["output_token_logprobs"]])
                tokens = torch.tensor([prompt + out_ids], device=device)
                logits = policy.model(tokens)[:, :-1].float()
                lp = grpo_losses.token_logprobs(logits, tokens[:, 1:], temperature)[0, len(prompt) - 1:]
                lp_diff = max(lp_diff, float((lp.cpu() - server_lp).abs().max()))
                gen_versions.add(g["meta_info"]["weight_version"])
        out["replicas"].append({"url": url, "version": info["weight_version"], "device": info.get("device"),
                                "dtype": info.get("dtype"), "tensors": len(weights), "unequal": unequal,
                                "weights_max_abs_diff": worst, "logprob_max_abs_diff": lp_diff,
                                "generated_under": sorted(gen_versions),
                                "generated_tokens": sum(len(g["output_ids"]) for g in gen)})
    return out


_train_step = grpo_train.train_step


def train_step(policy, local, grpo_cfg, temperature, max_new_tokens, **kw):
    seen.update(policy=policy, temperature=temperature, device=kw["d"].device)
    return _train_step(policy, local, grpo_cfg, temperature, max_new_tokens, **kw)


_summary = session.RolloutSide.summary


def summary(self):
    try:
        seen["check"] = final_check(self)
    except Exception as e:  # reported as a FAIL below
        seen["check"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    return _summary(self)


grpo_train.train_step = train_step
session.RolloutSide.summary = summary


def main(argv):
    cfg = parse_config(argv)
    seen["hf_dir"] = cfg.model.hf_assets_path
    grpo_train.main(argv)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    steps, dump = cfg.training.steps, cfg.job.dump_folder
    check = seen.get("check", {"error": "the run ended before its summary"})
    with open(os.path.join(dump, "check.json"), "w") as f:
        json.dump(check, f, indent=2)
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    # A step whose samples were all dropped (grpo.max_staleness) trains nothing and makes no version.
    trained = [r for r in rows if "trainer_vs_rollout_logprob_max_abs_diff" in r]
    diffs = [r["trainer_vs_rollout_logprob_max_abs_diff"] for r in trained]
    results = []

    def report(ok, msg):
        results.append(ok)
        print(("PASS " if ok else "FAIL ") + msg, flush=True)

    print(f"# verify: {cfg.weight_sync.mode} {cfg.weight_sync.transport} push, server on "
          f"{cfg.inference.server_device} ({cfg.inference.server_dtype}), {steps} steps, tol {TOL:g}")
    report(len(rows) == steps and bool(trained) and rows[-1].get("weight_version") == len(trained),
           f"run: {len(rows)}/{steps} steps logged, {len(trained)} trained (others: every sample staler than "
           f"grpo.max_staleness), last weight_version {rows[-1].get('weight_version') if rows else None}")
    if "error" in check:
        report(False, f"final check could not run: {check['error']}\n{check.get('traceback', '')}")
    else:
        for rep in check["replicas"]:
            report(rep["version"] == str(len(trained)) and not rep["unequal"],
                   f"weights: server {rep['url']} ({rep['device']}, {rep['dtype']}) serves version {rep['version']} "
                   f"(expected {len(trained)}); {rep['tensors'] - len(rep['unequal'])}/{rep['tensors']} tensors bit-equal "
                   f"to the trainer's final weights, max abs diff {rep['weights_max_abs_diff']:.3g}"
                   + (f"; unequal: {rep['unequal'][:5]}" if rep["unequal"] else ""))
            report(rep["logprob_max_abs_diff"] <= TOL and rep["generated_under"] == [str(len(trained))],
                   f"logprobs (final version): {rep['generated_tokens']} tokens sampled by the server under version "
                   f"{rep['generated_under']}, trainer vs server max abs diff {rep['logprob_max_abs_diff']:.3g} "
                   f"(<= {TOL:g})")
    if diffs:
        report(diffs[0] <= TOL, f"logprobs (step 1, initial weights on both sides): metrics.jsonl "
                                f"trainer_vs_rollout_logprob_max_abs_diff {diffs[0]:.3g} (<= {TOL:g})")
        on_policy = sum(d <= TOL for d in diffs)
        print(f"INFO per-step trainer_vs_rollout_logprob_max_abs_diff: {', '.join(f'{d:.2g}' for d in diffs)} "
              f"({on_policy}/{len(diffs)} steps within tol; async rollouts may be one version behind)")
    ok = bool(results) and all(results)
    print("VERIFY PASS" if ok else "VERIFY FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
PY

"$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=1 "$DRIVER" "${ARGS[@]}" ${EXTRA[@]+"${EXTRA[@]}"}
