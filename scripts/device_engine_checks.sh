#!/usr/bin/env bash
# Issue 50: the engine's GPU checks after a decode change, in one device call,
# from the repo root with .whl/ carried:
#
#   OUT=... [BUDGET=300] bash scripts/device_engine_checks.sh
#
# 1. the decode kernels on the GPU: tests/test_paged_attention.py (every
#    launch tuning, shared prompts, the static and paged batches through the
#    kernel with their CUDA graphs) and tests/test_shared_prompts.py;
# 2. the server-level GPU tests: tests/test_static_batch.py (bf16 tracks HF,
#    graph replay equals eager), then -m gpu of test_gpu_staging, test_server
#    and test_overlap (tests that need two GPUs skip on one);
# 3. scripts/verify_grpo_2gpu.sh --one-gpu: the GRPO loop with trainer and
#    server on this GPU, IPC push; the server's weights bit-equal to the
#    trainer's and the trainer-vs-server log-probs within tolerance.
# Logs: $OUT/kernels.log, server_tests.log, verify.log (the run's files in verify.tgz).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_engine_checks}
BUDGET=${BUDGET:-300}
mkdir -p "$OUT"
source scripts/device_env.sh
rc=0
PYTEST=(python3 -m pytest -q -ra -p no:cacheprovider -o addopts=)
budgeted kernels.log "${PYTEST[@]}" tests/test_paged_attention.py tests/test_shared_prompts.py || rc=1
tail -4 "$OUT/kernels.log"
budgeted server_tests.log bash -c "${PYTEST[*]} tests/test_static_batch.py && ${PYTEST[*]} -m gpu \
  tests/test_gpu_staging.py tests/test_server.py tests/test_overlap.py" || rc=1
grep -E "passed|failed|error" "$OUT/server_tests.log" | tail -4
VERIFY_DUMP=$OUT/verify budgeted verify.log bash scripts/verify_grpo_2gpu.sh --one-gpu || rc=1
grep -E "PASS|FAIL" "$OUT/verify.log" | tail -8
tar -czf "$OUT/verify.tgz" -C "$OUT" verify && rm -rf "$OUT/verify"  # a call brings back few files
exit $rc
