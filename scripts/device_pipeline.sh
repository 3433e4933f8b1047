#!/usr/bin/env bash
# The pipelined loop on one GPU in one device call: bench/pipeline_loop.py
# --one-gpu (Qwen3-0.6B shape, trainer and a bf16 built-in server sharing
# cuda:0, ipc push): serial, pipelined, pipelined with the real-engine request
# order, and the serial loop with the push sync or installed in place, each a
# real grpo_train.py run ($ONLY: a comma-separated subset of those rows). Then
# per run and step: the trainer's wait, the generation span (first group's
# start to last group's end), the mean group latency, train time and version
# lag, and the trainer's step lines. From the repo root with .whl/ carried:
#
#   OUT=... BUDGET=560 [STEPS=8] [ONLY=serial-1,serial-1-in-place,serial-1-sync] bash scripts/device_pipeline.sh
#
# MODE=two-gpu (a 2-GPU machine): the trainer on cuda:0 and the server on
# cuda:1, NCCL push, the phases no longer sharing a GPU; REPEATS=N runs the
# rows N times and ends with the median. MODE=cpu runs the CPU rows on the
# device machine's cores (16+: the cores no longer cap the overlap). ARGS:
# more bench flags (e.g. "--slow-factor 0").
#
# Logs go to $OUT (each run's metrics.jsonl, train.log and server logs in
# $OUT/runs.tgz); the table ends the bench's output.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_pipeline}
BUDGET=${BUDGET:-560}
mkdir -p "$OUT"
source scripts/device_env.sh
budgeted pipeline_loop.log python3 bench/pipeline_loop.py "--${MODE:-one-gpu}" --steps "${STEPS:-8}" --warmup 2 \
  --out "$OUT/runs" --repeats "${REPEATS:-1}" ${ONLY:+--only "$ONLY"} ${ARGS:-}
rc=$?
cat "$OUT/pipeline_loop.log"
for d in "$OUT"/runs/*/ "$OUT"/runs/repeat*/*/; do
  [ -f "$d/metrics.jsonl" ] || continue
  echo "== $d (per step: wait s, generate span s, mean group latency s, train s (its thread's CPU s, the trainer's other threads' CPU s), version lag)"
  python3 - "$d/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    print(f"step {m['step']:>2}  wait {m.get('time/wait_s', float('nan')):.3f}  "
          f"span {m.get('time/generate_s', float('nan')):.3f}  group {m.get('rollout/group_latency_s', float('nan')):.3f}  "
          f"train {m.get('time/train_s', float('nan')):.3f} (on CPU {m.get('cpu/train_thread_s', float('nan')):.3f}, "
          f"other threads {m.get('cpu/other_threads_s', float('nan')):.3f})  lag {m.get('push/replica0_version_lag', float('nan')):.0f}")
PY
  [ -f "$d/train.log" ] && grep -E "INFO step|rollouts:|stopped|Error" "$d/train.log" | tail -12
done
# The device tool brings back only a few files: every run's metrics and logs
# go in one archive (the servers' checkpoints and TensorBoard folders left out).
find "$OUT/runs" -name "*.safetensors" -delete 2>/dev/null
tar czf "$OUT/runs.tgz" --exclude=tb -C "$OUT" runs && rm -rf "$OUT/runs"
exit $rc
