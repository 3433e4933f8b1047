#!/usr/bin/env bash
# One GPU for both trainer and inference server (what a one-GPU box runs), in
# one device call: the CUDA tests of tests/test_gpu_staging.py (the 2-GPU ones
# skip), the start-up refusal of an NCCL push to a server on the trainer's GPU,
# verify_grpo_2gpu.sh --one-gpu over ipc, gloo and disk, then
# bench/step_time.py --one-gpu for each transport in $BENCH (default "ipc gloo";
# empty: none). From the repo root with .whl/ carried:
#
#   OUT=... BUDGET=560 [BENCH="ipc"] bash scripts/device_one_gpu.sh [--skip-tests]
#
# Logs go to $OUT/<step>.log; a summary (exit code and time of each step, its
# PASS/FAIL lines) ends the output. Exit code 0 iff every step passed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_one_gpu}
BUDGET=${BUDGET:-560}
mkdir -p "$OUT"
source scripts/device_env.sh
SUMMARY=()
step() {  # step NAME CMD...: run under the budget, remember exit code and time
  local name=$1 t=$SECONDS; shift
  echo "== $name ($(left) s left)"
  budgeted "$name.log" "$@"
  local rc=$?
  SUMMARY+=("$name: exit $rc in $((SECONDS - t)) s")
  grep -E "PASS|FAIL|passed|failed|^\| " "$OUT/$name.log" | tail -25
  return $rc
}

BENCH=${BENCH-ipc gloo}
if [ "${1:-}" != --skip-tests ]; then
step gpu_tests python3 -m pytest -q -ra -p no:cacheprovider -m gpu tests/test_gpu_staging.py

# An NCCL push to a server on cuda:0, the trainer's GPU: refused before anything starts.
t=$SECONDS
python3 -m torchtitan_grpo.models.demo_assets "$OUT/refused/tiny-qwen3" > /dev/null  # a model there: the refusal is the device's
timeout 120 python3 -m torch.distributed.run --standalone --nproc_per_node=1 grpo_train.py \
  --job.config_file train_configs/verify_2gpu.toml --job.dump_folder "$OUT/refused" \
  --model.hf_assets_path "$OUT/refused/tiny-qwen3" --inference.server_device cuda:0 > "$OUT/refused.log" 2>&1
rc=$?
if [ $rc -ne 0 ] && grep -q "config key inference.server_device = 'cuda:0': the built-in servers would share cuda:0" \
    "$OUT/refused.log"; then
  echo "PASS: an NCCL push to a server on the trainer's GPU is refused at start-up (exit $rc)" | tee -a "$OUT/refused.log"
  SUMMARY+=("nccl_same_gpu_refused: exit 0 in $((SECONDS - t)) s")
else
  echo "FAIL: no start-up refusal naming inference.server_device (exit $rc)" | tee -a "$OUT/refused.log"
  SUMMARY+=("nccl_same_gpu_refused: exit 1 in $((SECONDS - t)) s")
fi
grep -m3 "ConfigError\|config key" "$OUT/refused.log"

for t in ipc gloo disk; do
  step "verify_one_gpu_$t" env VERIFY_DUMP="$OUT/verify_$t" bash scripts/verify_grpo_2gpu.sh --one-gpu \
    --weight_sync.transport "$t"
done
fi
for t in $BENCH; do
  step "step_time_one_gpu_$t" python3 bench/step_time.py --one-gpu --transport "$t" --rounds 2 --steps 6 \
    --warmup 3 --slow-steps 8 --after-kill-steps 4
done

echo "== summary"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.log"
! grep -qv "exit 0 " "$OUT/summary.log"
