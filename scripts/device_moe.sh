#!/usr/bin/env bash
# Issue 39 on a GPU machine in one device call: tests/test_moe_serving.py and
# tests/test_moe_push.py on the GPU image, then bench/moe_mismatch.py: a
# Qwen3-30B-A3B-wide MoE (LAYERS layers, random weights trained STEPS
# next-token steps), the built-in server (bf16, static cache, CUDA graphs) on
# the second GPU (or the same one with one GPU: the push goes over ipc), the
# trainer's bf16-autocast log-probs against the rollout's with router replay
# off and on, and the full push of a version. From the repo root with .whl/
# carried:
#
#   OUT=... BUDGET=540 bash scripts/device_moe.sh
#
# Logs: $OUT/pytest_moe.log, $OUT/moe_mismatch.log (the table also on stdout).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_moe}
BUDGET=${BUDGET:-540}
LAYERS=${LAYERS:-4}
STEPS=${STEPS:-40}
mkdir -p "$OUT"
source scripts/device_env.sh
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee -a "$OUT/env.log"
SERVER=cuda:1
(( $(nvidia-smi -L | wc -l) > 1 )) || SERVER=cuda:0
rc=0
budgeted pytest_moe.log python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_moe_push.py \
  tests/test_moe_train.py -ra || rc=1
tail -3 "$OUT/pytest_moe.log"
budgeted moe_mismatch.log python3 bench/moe_mismatch.py --shape 30b-a3b --layers "$LAYERS" --device cuda:0 \
  --server-device "$SERVER" --train-steps "$STEPS" --work /tmp/bench_moe || rc=1
grep -v -i "warn" "$OUT/moe_mismatch.log" | tail -12
cp /tmp/bench_moe/server.log "$OUT/server.log" 2>/dev/null
echo "device_moe: exit $rc after $((SECONDS - T0)) s"
exit $rc
