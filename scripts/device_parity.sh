#!/usr/bin/env bash
# The parallel-layout parity checks on the GPUs of one host (run from the repo
# root with the wheels of ../shared/tools/device-wheels.sh in .whl/, carried):
#
#   bash scripts/device_parity.sh        # 4 GPUs: every layout; 2 GPUs: the 2-rank ones
#
#   1. python -m pytest tests/test_parallel_parity.py: every layout (FSDP, TP,
#      DDP, PP, HSDP, FSDP+TP, PP+FSDP, PP+TP) against the single process, fp32
#      over NCCL with one GPU per rank, at the CPU test's tolerance (1e-5);
#   2. python tests/test_parallel_parity.py: the same as a table (docs/PARITY.md);
#   3. python tests/test_parallel_parity.py --dtype bfloat16: the table with every
#      layout and the single process computing in bf16 (FSDP mixed precision;
#      the same parameter casts without FSDP), fp32 master weights; no asserts.
# Logs go to $OUT (default outputs/device_parity/): pytest.log, table.log,
# table_bf16.log. Ends within BUDGET_S (default 420: on 4 GPUs steps 1 and 2
# took about 105 and 100 s, step 3 should take about as long as step 2); a
# step with no time left is skipped (exit 1).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-outputs/device_parity}
BUDGET=${BUDGET_S:-420}
mkdir -p "$OUT"
source scripts/device_env.sh

rc=0
budgeted pytest.log python3 -m pytest -q -ra -p no:cacheprovider tests/test_parallel_parity.py || rc=1
tail -15 "$OUT/pytest.log"
budgeted table.log python3 tests/test_parallel_parity.py || rc=1
tail -40 "$OUT/table.log"
budgeted table_bf16.log python3 tests/test_parallel_parity.py --dtype bfloat16 || rc=1
tail -40 "$OUT/table_bf16.log"
echo "device_parity: exit $rc after $((SECONDS - T0)) s"
exit $rc
