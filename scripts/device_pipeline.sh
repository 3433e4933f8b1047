#!/usr/bin/env bash
# The pipelined loop on one GPU in one device call: bench/pipeline_loop.py
# --one-gpu (Qwen3-0.6B shape, trainer and a bf16 built-in server sharing
# cuda:0, ipc push): serial, pipelined, and pipelined with the real-engine
# request order, each a real grpo_train.py run. From the repo root with .whl/
# carried:
#
#   OUT=... BUDGET=560 [STEPS=8] bash scripts/device_pipeline.sh
#
# Logs go to $OUT; the table ends the output.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_pipeline}
BUDGET=${BUDGET:-560}
mkdir -p "$OUT"
source scripts/device_env.sh
budgeted pipeline_loop.log python3 bench/pipeline_loop.py --one-gpu --steps "${STEPS:-8}" --warmup 2 \
  --out "$OUT/runs"
rc=$?
cat "$OUT/pipeline_loop.log"
# the trainers' logs (step lines) beside the table
for d in "$OUT"/runs/*/; do
  [ -f "$d/train.log" ] && { echo "== $d"; grep -E "INFO step|rollouts:|stopped|Error" "$d/train.log" | tail -12; }
done
find "$OUT/runs" -name "*.safetensors" -delete 2>/dev/null
exit $rc
