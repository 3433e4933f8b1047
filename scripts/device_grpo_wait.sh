#!/usr/bin/env bash
# Where the one-GPU serial GRPO step's generation wait goes, in one device
# call: bench/pipeline_loop.py --one-gpu, serial loop only, with the push
# async (a version installed while the step generates: after the running
# batch drains, the serial default, or between decode steps, in_place) and
# sync (installed before it); then per step the trainer's wait, the span from
# the first group's start to the last group's end, the mean group latency.
# From the repo root with .whl/ carried:
#
#   OUT=... BUDGET=400 [STEPS=8] bash scripts/device_grpo_wait.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_grpo_wait}
BUDGET=${BUDGET:-400}
mkdir -p "$OUT"
source scripts/device_env.sh
budgeted pipeline.log python3 bench/pipeline_loop.py --one-gpu --steps "${STEPS:-8}" --warmup 2 \
  --out "$OUT/runs" --only serial-1,serial-1-in-place,serial-1-sync
rc=$?
grep -E "^#|^\|" "$OUT/pipeline.log"
for d in "$OUT/runs"/serial-1*/; do
  echo "== $d (per step: wait s, generate span s, mean group latency s, train s, version lag)"
  python3 - "$d/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    print(f"step {m['step']:>2}  wait {m.get('time/wait_s', float('nan')):.3f}  "
          f"span {m.get('time/generate_s', float('nan')):.3f}  group {m.get('rollout/group_latency_s', float('nan')):.3f}  "
          f"train {m.get('time/train_s', float('nan')):.3f}  lag {m.get('push/replica0_version_lag', float('nan')):.0f}")
PY
done
find "$OUT" -name "*.safetensors" -delete 2>/dev/null
exit $rc
