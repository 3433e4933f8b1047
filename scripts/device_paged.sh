#!/usr/bin/env bash
# The paged KV cache on one GPU in one device call (issue 38): its GPU tests,
# then bench/paged_speed.py (tok/s at 64 and 128 sequences up to long
# lengths against the HBM roofline). From the repo root with .whl/ carried:
#
#   OUT=... BUDGET=560 [SHAPE=qwen3-0.6b|qwen3-4b] [SEQS=64,128] [NEW=1024,4096,16384] \
#     [KV=paged,static] [PROMPT_LEN=256] [TESTS=tests/test_paged_batch.py] [ARGS=--hf-static] \
#     bash scripts/device_paged.sh
#
# PROMPT_LEN=12288 NEW=4096: decode at 12k-16k contexts in 4,096 steps (a
# 16k-token sample's last quarter) instead of 16,384 steps from a short prompt.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_paged}
BUDGET=${BUDGET:-560}
mkdir -p "$OUT"
source scripts/device_env.sh
if [ -n "${TESTS-tests/test_paged_batch.py}" ]; then
  budgeted gpu_tests.log python3 -m pytest -q -ra ${TESTS-tests/test_paged_batch.py}
  tail -5 "$OUT/gpu_tests.log"
fi
budgeted paged_speed.log python3 bench/paged_speed.py --shape "${SHAPE:-qwen3-0.6b}" --seqs "${SEQS:-64,128}" \
  --new "${NEW:-1024,4096,16384}" --kv-cache "${KV:-paged}" --prompt-len "${PROMPT_LEN:-256}" ${ARGS:-}
rc=$?
cat "$OUT/paged_speed.log"
exit $rc
