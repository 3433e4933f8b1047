#!/usr/bin/env bash
# Issue 41: the broadcast fan-out vs one group per replica, on a 4-GPU machine
# (trainer cuda:0, replicas cuda:1..3; kind nvidia-h100-x4 or nvidia-h200-x4).
# Per version: the trainer's own send time, the time until the last replica
# serves and the bytes the trainer sent, for 1, 2, 3 replicas, Qwen3-4B and
# -8B shapes (random bf16), both fan-outs measured in the same run. From the
# repo root:
#
#   OUT=... bash scripts/device_fanout.sh
#
# Each shape's table goes to $OUT/fanout_<shape>.log.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_fanout}
mkdir -p "$OUT"
BUDGET=${BUDGET:-560}
source scripts/device_env.sh
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$OUT/gpus.txt" 2>&1
nvidia-smi topo -m >> "$OUT/gpus.txt" 2>&1
rc=0
for shape in 4B 8B; do
  timeout "${SHAPE_S:-200}" python3 bench/fanout.py --sets "$shape" --replicas 1,2,3 --reps "${REPS:-3}" --bucket-mb 1024 \
    > "$OUT/fanout_$shape.log" 2>&1 || rc=1
  grep -E "^fan-out|^\|" "$OUT/fanout_$shape.log" || tail -20 "$OUT/fanout_$shape.log"
done
exit $rc
