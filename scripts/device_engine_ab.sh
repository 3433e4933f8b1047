#!/usr/bin/env bash
# Issue 50's engine changes on one GPU in one device call, before the big table:
# the kernels' GPU tests (the fused q/k norm + rotary + KV write, the fused
# add + norm and SwiGLU, the paged attention kernel, the static and paged
# batches with CUDA graphs, the device-fault tests), then one decode profile
# of the Qwen3-4B shape (bench/engine_profile.py) per KV cache. From the repo
# root with .whl/ carried:
#
#   OUT=... [BUDGET=150] [PROFILE_KV="static paged"] [SEQS=64] bash scripts/device_engine_ab.sh
#
# Files in $OUT: env.log, gpu_tests.log, profile-<kv>.log (the breakdown
# table; traces are not kept: they are tens of MB).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_engine_ab}
BUDGET=${BUDGET:-150}
mkdir -p "$OUT"
source scripts/device_env.sh
rc=0
budgeted gpu_tests.log python3 -m pytest -q -ra -p no:cacheprovider -o addopts= tests/test_decode_rope.py \
  tests/test_fused_ops.py tests/test_paged_attention.py tests/test_static_batch.py tests/test_paged_batch.py \
  tests/test_engine_device_faults.py || rc=1
tail -15 "$OUT/gpu_tests.log"
for kv in ${PROFILE_KV:-static paged}; do
  budgeted "profile-$kv.log" python3 bench/engine_profile.py --shape 4b --seqs "${SEQS:-64}" --kv-cache "$kv" \
    --reply-lengths= --steps 12 --out /tmp/engine_ab_profile-$kv || rc=1
  sed -n '/^| per decode step/,/^| status/p' "$OUT/profile-$kv.log"
done
exit $rc
