#!/usr/bin/env bash
# Issue 40: bytes and seconds per pushed version, full weights (disk; ipc needs the server in another process) vs the
# LoRA adapter alone (rank 16 and 64), Qwen3-4B and -8B shapes with random
# weights, one GPU with the built-in server in the bench's process. From the
# repo root:
#
#   OUT=... bash scripts/device_lora_push.sh
#
# Each shape's table goes to $OUT/lora_push_<shape>.log; model folders are
# written once under $WORK (bf16: ~8 GB for 4B, ~16 GB for 8B).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_lora_push}
WORK=${WORK:-/tmp/bench_lora_push}
mkdir -p "$OUT"
rc=0
for shape in qwen3-4b qwen3-8b; do
  timeout 280 python3 bench/lora_push.py --shape "$shape" --ranks 16,64 --reps 3 --full-backend disk \
    --device cuda:0 --work "$WORK" > "$OUT/lora_push_$shape.log" 2>&1 || rc=1
  grep -E "^shape|^\|" "$OUT/lora_push_$shape.log" || tail -5 "$OUT/lora_push_$shape.log"
  rm -rf "$WORK/$shape"  # disk: one model at a time
done
exit $rc
