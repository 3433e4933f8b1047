#!/usr/bin/env bash
# Where the one-GPU serial GRPO step's generation wait goes, in one device
# call: bench/pipeline_loop.py --one-gpu, serial loop only, with the push
# async (a version installed while the step generates) and sync (installed
# before it), then per step the trainer's wait against the pool's request
# latency. From the repo root with .whl/ carried:
#
#   OUT=... BUDGET=400 [STEPS=8] bash scripts/device_grpo_wait.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_grpo_wait}
BUDGET=${BUDGET:-400}
mkdir -p "$OUT"
source scripts/device_env.sh
budgeted pipeline.log python3 bench/pipeline_loop.py --one-gpu --steps "${STEPS:-8}" --warmup 2 \
  --out "$OUT/runs" --only serial-1,serial-1-sync
rc=$?
grep -E "^#|^\|" "$OUT/pipeline.log"
for d in "$OUT/runs"/serial-1*/; do
  echo "== $d (per step: wait s, request latency p50 / p99 s, train s, version lag)"
  python3 - "$d/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    print(f"step {m['step']:>2}  wait {m.get('time/wait_s', float('nan')):.3f}  "
          f"latency {m.get('pool/latency_p50_s', float('nan')):.3f} / {m.get('pool/latency_p99_s', float('nan')):.3f}  "
          f"train {m.get('time/train_s', float('nan')):.3f}  lag {m.get('push/replica0_version_lag', float('nan')):.0f}")
PY
done
find "$OUT" -name "*.safetensors" -delete 2>/dev/null
exit $rc
