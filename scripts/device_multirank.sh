#!/usr/bin/env bash
# The multi-rank trainer on 2 GPUs, in one command (run from the repo root
# with the wheels of ../shared/tools/device-wheels.sh in .whl/, carried):
#
#   bash scripts/device_multirank.sh          # on a 2-GPU machine
#
#   1. tests/test_gather.py's worker under torchrun x2 with NCCL (FSDP, TP, DDP;
#      qwen3 untied/tied, llama3): the sidecar gather delivers exactly the
#      trainer's weights of each version, on process groups of its own, while
#      the trainer runs its own collectives; PASS/FAIL per case.
#   2. bench/gather_step.py under torchrun x2: step time with no export, with
#      the trainer's collective export, and with the sidecar gather (Qwen3-0.6B
#      shape, FSDP over both GPUs).
# Logs go to $OUT (default outputs/device_multirank/). Ends within BUDGET_S.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-outputs/device_multirank}
BUDGET=${BUDGET_S:-220}
WORK=${WORK:-/tmp/device_multirank}  # models and gathered tensors: not brought back
mkdir -p "$OUT" "$WORK/gather"
source scripts/device_env.sh

rc=0
test_models "$WORK/models" || rc=1
budgeted gather.log torchrun --standalone --nproc_per_node=2 tests/test_gather.py --out "$WORK/gather" \
  --layouts fsdp,tp,ddp $MODELS || { rc=1; tail -40 "$OUT/gather.log"; }
python3 tests/test_gather.py --out "$WORK/gather" --check | tee "$OUT/gather_check.log" || rc=1

budgeted gather_step.log torchrun --standalone --nproc_per_node=2 bench/gather_step.py --push-dtype bfloat16 \
  || { rc=1; tail -40 "$OUT/gather_step.log"; }
grep -E "^# gather_step|^\| " "$OUT/gather_step.log"
echo "device_multirank: exit $rc after $((SECONDS - T0)) s"
exit $rc
