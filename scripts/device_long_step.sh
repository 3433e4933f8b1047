#!/usr/bin/env bash
# bench/long_step.py on one GPU in one device call: a whole GRPO train_step of
# a Qwen3-4B-shaped model on samples of 4k, 8k and 16k tokens, full logits
# against grpo.logprob_chunk_tokens = 2048 (the baseline in the same run),
# first with TorchTitan's full activation checkpointing, then without (what
# the one-GPU trainer runs today: build_policy applies AC only through
# parallelize_fn, i.e. with more than one rank). From the repo root with .whl/
# carried:
#
#   OUT=... BUDGET=280 bash scripts/device_long_step.sh
#
# Tables: $OUT/long_step-ac_full.log, $OUT/long_step-ac_none.log (the same on stdout).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_long_step}
BUDGET=${BUDGET:-280}
TOKENS=${TOKENS:-4096,8192,16384}
LAYERS=${LAYERS:-36}
mkdir -p "$OUT"
source scripts/device_env.sh
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee -a "$OUT/env.log"
rc=0
for ac in full none; do
  budgeted "long_step-ac_$ac.log" python3 bench/long_step.py --device cuda --layers "$LAYERS" --tokens "$TOKENS" \
    --chunk 2048 --ac "$ac" || rc=1
  cat "$OUT/long_step-ac_$ac.log" | grep -v -i "warn" | tail -12
done
echo "device_long_step: exit $rc after $((SECONDS - T0)) s"
exit $rc
