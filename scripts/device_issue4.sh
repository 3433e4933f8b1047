#!/usr/bin/env bash
# The one command for a 2-GPU machine (trainer GPU 0, inference GPU 1), run
# from the repo root with the wheels of ../shared/tools/device-wheels.sh in
# .whl/ (git-ignored: carry it). Ends within BUDGET_S (470 s) whatever happens.
#
#   bash scripts/device_issue4.sh                    # everything, on the GPUs
#   bash scripts/device_issue4.sh --cpu              # the same flow on CPU (gloo), for tests
#   bash scripts/device_issue4.sh --only verify      # a subset: weight_push,verify,step_time
#   WEIGHT_PUSH_ARGS="--bucket-mb 4096 --trace" STEP_TIME_ARGS="--bucket-mb 1024" bash scripts/device_issue4.sh
#                                                    # extra arguments of the two benchmarks
#   VERIFY_ARGS="--weight_sync.staging host" ...     # extra config keys of the verify run
#
# Steps, each under `timeout` (the whole process group is killed at its limit),
# each log tee'd to $OUT/<step>.log (default outputs/device_issue4/):
#   0. install .whl/*.whl into /tmp/site (GPU only) and report the environment
#      (nvidia-smi topo -m, versions, imports);
#   1. bench/weight_push.py   raw NCCL broadcast vs our push path, qwen3 0.6B/4B/8B-sized sets, SGLang and vLLM protocols, disk (~2 min)
#   2. scripts/verify_grpo_2gpu.sh   grpo_train async NCCL, server weights == trainer weights, logprobs (~40 s)
#   3. bench/step_time.py     step time off/sync/async, slow replica, killed replica (~150 s)
# then prints a summary: each step's exit code and time, its final table and
# its PASS/FAIL lines (also in $OUT/summary.log). Exit code 0 iff every step passed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

T0=$SECONDS
BUDGET=${BUDGET_S:-470}
PYTHON=${PYTHON:-python3}
CPU=0
ONLY="weight_push,verify,step_time,gpu_tests"
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) CPU=1 ;;
    --only) ONLY="$2"; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "device_issue4: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
OUT=${OUT:-$PWD/outputs/device_issue4}
mkdir -p "$OUT"
: > "$OUT/summary.log"
MODE_ARGS=()
[ "$CPU" = 1 ] && MODE_ARGS=(--cpu)
export OUT PYTHON PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

say() { echo "$@" | tee -a "$OUT/summary.log"; }

# ---- 0. packages and environment
if [ "$CPU" = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl > "$OUT/install.log" 2>&1 || say "WARNING wheel install failed (see install.log)"
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  [ "$CPU" = 0 ] && say "WARNING no .whl/*.whl here: using the packages already installed"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
{
  echo "date: $(date -u +%FT%TZ)  host: $(hostname)  cpus: $(nproc)"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,memory.used,memory.total,driver_version --format=csv
    nvidia-smi topo -m
  else
    echo "no nvidia-smi"
  fi
  timeout 60 "$PYTHON" - <<'PY'
import importlib, sys, traceback
import torch
import torchtitan_grpo  # noqa: F401  (its triton shim goes in before torchtitan)
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| gpus", torch.cuda.device_count(),
      "| nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else "-")
for m in ("torchtitan", "transformers", "tokenizers", "safetensors", "datasets", "aiohttp", "tyro", "tensorboard"):
    try:
        print(f"  {m} {getattr(importlib.import_module(m), '__version__', '?')}")
    except Exception as e:
        print(f"  {m} MISSING: {type(e).__name__}: {e}")
try:
    import grpo_train, torchtitan_grpo.train.trainer, torchtitan_grpo.weight_sync.pusher  # noqa: F401
    import torchtitan.distributed.utils  # noqa: F401  (pulls in torch.utils.tensorboard)
    print("imports ok")
except Exception:
    traceback.print_exc()
    print("IMPORTS FAILED: the steps below will fail the same way")
PY
} 2>&1 | tee "$OUT/env.log"

# ---- 1-3. the scripts, each with a time limit
declare -A RC SECS
ORDER=()
run_step() {  # name, budget_s, command...
  local name=$1 budget=$2
  shift 2
  case ",$ONLY," in *",$name,"*) ;; *) return ;; esac
  ORDER+=("$name")
  local left=$((BUDGET - (SECONDS - T0) - 15))  # -k 10 below may add 10 s
  local limit=$((budget < left ? budget : left))
  if [ "$limit" -lt 15 ]; then
    RC[$name]="skipped (time budget spent)"
    SECS[$name]=0
    return
  fi
  echo "==== $name (limit ${limit}s): $*" | tee "$OUT/$name.log"
  local t=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  SECS[$name]=$((SECONDS - t))
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then RC[$name]="$rc (timed out after ${limit}s)"; else RC[$name]=$rc; fi
}

run_step weight_push 200 "$PYTHON" bench/weight_push.py ${MODE_ARGS[@]+"${MODE_ARGS[@]}"} ${WEIGHT_PUSH_ARGS:-}
run_step verify 100 bash scripts/verify_grpo_2gpu.sh ${MODE_ARGS[@]+"${MODE_ARGS[@]}"} ${VERIFY_ARGS:-}
run_step step_time 250 "$PYTHON" bench/step_time.py ${MODE_ARGS[@]+"${MODE_ARGS[@]}"} --log-dir "$OUT/step_time_servers" \
  ${STEP_TIME_ARGS:-}
# The GPU-only tests (they skip without CUDA): recorded in docs/ from this log.
[ "$CPU" = 0 ] && run_step gpu_tests 90 "$PYTHON" -m pytest -q -ra -p no:cacheprovider -m gpu tests/

# ---- summary
final_block() {  # lines from the last line matching $2 to the end of file $1
  awk -v pat="$2" '$0 ~ pat {buf=""; keep=1} keep {buf = buf $0 "\n"} END {printf "%s", buf}' "$1"
}
say ""
say "==================== device_issue4 summary ($((SECONDS - T0)) s, budget ${BUDGET} s) ===================="
status=0
for name in "${ORDER[@]}"; do
  say "---- $name: exit ${RC[$name]} in ${SECS[$name]} s (log: $OUT/$name.log)"
  [ "${RC[$name]}" = 0 ] || status=1
  log="$OUT/$name.log"
  [ -f "$log" ] || continue
  case "$name" in
    weight_push)
      if grep -q '^| set ' "$log"; then final_block "$log" '^# weight push' | grep -E '^(#|\|)' ; else grep '^row:' "$log"; fi ;;
    step_time)
      grep '^# \(batch\|normal\|trainer\)' "$log"
      if grep -q '^# step time' "$log"; then final_block "$log" '^# step time' | grep -E '^(#|\||PASS|FAIL)'
      else final_block "$log" '^# interim:' | grep -E '^(#|\|)'; fi ;;
    verify)
      grep -E '^(# verify|PASS|FAIL|INFO|VERIFY)' "$log" ;;
    gpu_tests)
      tail -n 5 "$log" ;;
  esac | tee -a "$OUT/summary.log"
  if [ "${RC[$name]}" != 0 ]; then
    say "  last lines of $name.log:"
    tail -n 15 "$log" | sed 's/^/  | /' | tee -a "$OUT/summary.log"
  fi
done
say "RESULT: $([ $status = 0 ] && echo 'ALL PASSED' || echo 'SOME FAILED') ($((SECONDS - T0)) s)"
exit $status
