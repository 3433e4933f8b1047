#!/usr/bin/env bash
# The GRPO step on one GPU before and after the static-cache engine, in one
# device call: bench/pipeline_loop.py --one-gpu (Qwen3-0.6B shape, trainer and
# a bf16 built-in server sharing cuda:0, ipc push, 64 x 128 tokens per step)
# with the servers' KV cache static (the default on a GPU) and dynamic (the
# engine before issue 22). From the repo root with .whl/ carried:
#
#   OUT=... BUDGET=560 [STEPS=6] [KVS="static dynamic"] bash scripts/device_grpo_engine.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_grpo_engine}
BUDGET=${BUDGET:-560}
mkdir -p "$OUT"
source scripts/device_env.sh
rc=0
for kv in ${KVS:-static dynamic}; do
  budgeted "pipeline_$kv.log" python3 bench/pipeline_loop.py --one-gpu --steps "${STEPS:-6}" --warmup 2 \
    --out "$OUT/runs-$kv" --server-args "--kv-cache $kv" || rc=$?
  echo "== kv_cache $kv"; cat "$OUT/pipeline_$kv.log"
  for d in "$OUT/runs-$kv"/*/; do
    [ -f "$d/train.log" ] && { echo "== $d"; grep -E "INFO step|static KV|rollouts:|stopped|Error" "$d/train.log" | tail -8; }
  done
done
find "$OUT" -name "*.safetensors" -delete 2>/dev/null
exit $rc
