#!/usr/bin/env bash
# Engine speed on one GPU in one device call: the static-batch GPU tests, then
# bench/engine_speed.py (built-in server over HTTP and its engine, static and
# dynamic KV batch, against transformers). From the repo root with .whl/ carried:
#
#   OUT=... BUDGET=560 [WORKLOADS=64x128,256x512] [ROWS=...] [TESTS=tests/test_static_batch.py] bash scripts/device_engine.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_engine}
BUDGET=${BUDGET:-560}
mkdir -p "$OUT"
source scripts/device_env.sh
if [ -n "${TESTS-tests/test_static_batch.py}" ]; then
  budgeted gpu_tests.log python3 -m pytest -q -ra ${TESTS-tests/test_static_batch.py}
  tail -5 "$OUT/gpu_tests.log"
fi
budgeted engine_speed.log python3 bench/engine_speed.py --workloads "${WORKLOADS:-64x128,256x512}" \
  ${ROWS:+--rows "$ROWS"}
rc=$?
cat "$OUT/engine_speed.log"
exit $rc
