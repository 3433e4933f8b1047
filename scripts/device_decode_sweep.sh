#!/usr/bin/env bash
# Issue 50: where the Qwen3-4B decode step at 64 sequences can still gain, in one
# device call, from the repo root with .whl/ carried:
#
#   OUT=... [BUDGET=420] [PARTS=attention,gemm,trace] bash scripts/device_decode_sweep.sh
#
# - attention: bench/paged_attention.py --sweep, the decode kernel's launch
#   tunings at the engine's static-cache shapes (64 and 256 rows; 192, 640 and
#   1,100 positions: the mean of a 128-token row, of a 1,024-token row, its end);
# - trace: our server alone on /generate at 4B, 64 x 128 and 64 x 1,024 tokens
#   under bench/server_trace.py (prefills, decode steps, gaps);
# - gemm: bench/decode_gemm.py, cuBLAS against the Triton split-K GEMM's sweep
#   (last: it gets the time left; its rows are printed as they finish).
# Results: $OUT/attention.md, gemm.md, trace.tgz (the pieces and
# their summary.md) and the logs.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_decode_sweep}
BUDGET=${BUDGET:-420}
PARTS=${PARTS:-attention,gemm,trace}
mkdir -p "$OUT"
source scripts/device_env.sh
rc=0
if [[ ",$PARTS," == *",attention,"* ]]; then
  budgeted attention.md python3 bench/paged_attention.py --sweep --layout slot --rows 64,256 \
    --context 192,640,1100 --reps 10 || rc=1
  tail -25 "$OUT/attention.md"
fi
if [[ ",$PARTS," == *",trace,"* ]]; then
  budgeted trace.log python3 bench/engine_vs_vllm.py --shapes 4b --lengths 128,1024 --seqs 64 --routes generate \
    --engines ours --out "$OUT/trace-table" --trace "$OUT/trace" --budget-s $(( $(left) - 15 )) || rc=1
  tail -8 "$OUT/trace.log"
  tar -czf "$OUT/trace.tgz" -C "$OUT" trace && rm -rf "$OUT/trace"  # a call brings back few files
fi
if [[ ",$PARTS," == *",gemm,"* ]]; then
  budgeted gemm.md python3 bench/decode_gemm.py --shape 4b --rows 64 256 --backends cublas splitk || rc=1
  tail -16 "$OUT/gemm.md"
fi
exit $rc
