#!/usr/bin/env bash
# Context parallelism on 2 GPUs in one device call (repo root, .whl/ of
# ../shared/tools/device-wheels.sh carried):
#
#   bash scripts/device_cp.sh
#
# tests/test_context_parallel.py's cases: the worker under torchrun x2 with
# NCCL (CP 2, one GPU per rank, fp32: PyTorch's CUDA ring attention over the
# memory-efficient kernel), then the same steps in one process on cuda:0 and a
# PASS/FAIL line per case (loss, grad norm, gradients, weights after AdamW
# <= 1e-6). Logs in $OUT (default outputs/device_cp/). Ends within BUDGET_S.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-outputs/device_cp}
BUDGET=${BUDGET_S:-300}
WORK=${WORK:-/tmp/device_cp}
mkdir -p "$OUT" "$WORK/results"
source scripts/device_env.sh

rc=0
FLAGS=$(python3 tests/test_context_parallel.py models --out "$WORK/models" 2> "$OUT/models.log") || rc=1
budgeted cp_worker.log torchrun --standalone --nproc_per_node=2 tests/test_context_parallel.py worker \
  --out "$WORK/results" $FLAGS || { rc=1; grep -v -i warn "$OUT/cp_worker.log" | tail -40; }
budgeted cp_check.log python3 tests/test_context_parallel.py check --out "$WORK/results" $FLAGS || rc=1
grep -E "PASS|FAIL|Error" "$OUT/cp_check.log"
echo "device_cp: exit $rc after $((SECONDS - T0)) s"
exit $rc
