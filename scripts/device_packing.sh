#!/usr/bin/env bash
# Packed micro-batches (grpo.micro_batch_tokens, issue 38) on one GPU in one
# device call: tests/test_packing.py (its CUDA tests run the compiled flex
# attention against the padded path in float32; the rest are the CPU tests,
# here on the GPU image's torch), then bench/packed_vs_padded.py: one
# long-tailed batch (32 samples, 256..16k tokens, seeded) padded
# (grpo.micro_batch_size 1, 2, 4: the baseline, in the same run) vs packed
# (16k and 32k tokens a row), Qwen3-4B shape with 8 layers, bf16, full
# activation checkpointing, chunked log-probs. From the repo root with .whl/
# carried:
#
#   OUT=... BUDGET=540 bash scripts/device_packing.sh
#
# Logs: $OUT/pytest_packing.log, $OUT/packed_vs_padded.log (the table also on stdout).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_packing}
BUDGET=${BUDGET:-540}
LAYERS=${LAYERS:-8}
MBS=${MBS:-1,2,4}
BUDGETS=${BUDGETS:-16384,32768}
mkdir -p "$OUT"
source scripts/device_env.sh
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee -a "$OUT/env.log"
rc=0
budgeted pytest_packing.log python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_packing.py -ra || rc=1
tail -5 "$OUT/pytest_packing.log"
budgeted packed_vs_padded.log python3 bench/packed_vs_padded.py --device cuda --layers "$LAYERS" --mbs "$MBS" \
  --budget "$BUDGETS" || rc=1
grep -v -i "warn" "$OUT/packed_vs_padded.log" | tail -12
echo "device_packing: exit $rc after $((SECONDS - T0)) s"
exit $rc
