#!/usr/bin/env bash
# Issue 52 (first part) on one GPU in one device call: pretrain a small
# Qwen3-MoE from scratch on this machine's site-packages sources
# (scripts/pretrain_moe.py, MOE_S seconds of training) and run
# bench/moe_mismatch.py on it: the built-in server (bf16) generates SAMPLES x
# NEW_TOKENS from held-out code prompts and the trainer (bf16 autocast) scores
# the tokens, router replay off and on; then the same for the dense Qwen3 of
# the same active size (replay off only), trained on the same rows for as many
# steps as the MoE took (DENSE_S seconds at most). A finished MoE checkpoint
# already in $WORK/moe (its pretrain_stats.json is written last, e.g. by
# scripts/device_moe_grpo.sh earlier on the same warm machine) is reused, so
# the mismatch is measured on the model the GRPO runs trained. The models stay
# under WORK (/tmp), never in the repository. From the repo root with .whl/
# carried:
#
#   OUT=... BUDGET=540 bash scripts/device_pretrain_moe.sh
#
# Logs in $OUT: pretrain_moe.log, pretrain_dense.log, pretrain_stats_{moe,dense}.json,
# mismatch_moe.log, mismatch_dense.log (+ their server logs); the tables also on stdout.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_pretrain_moe}
BUDGET=${BUDGET:-540}
MOE_S=${MOE_S:-240}
DENSE_S=${DENSE_S:-240}
RESERVE_S=${RESERVE_S:-120}
SAMPLES=${SAMPLES:-64}
NEW_TOKENS=${NEW_TOKENS:-256}
WORK=${WORK:-/tmp/pretrain_moe}
mkdir -p "$OUT" "$WORK"
source scripts/device_env.sh
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee -a "$OUT/env.log"
rc=0

# pretrain KIND SECONDS FLAGS...: one checkpoint under $WORK/KIND, its log and stats into $OUT
pretrain() {
  local kind=$1 secs=$2; shift 2
  rm -rf "${WORK:?}/$kind"  # no stale checkpoint for the bench to find
  budgeted "pretrain_$kind.log" python3 scripts/pretrain_moe.py --out "$WORK/$kind" --time-limit-s "$secs" \
    --device cuda "$@" || rc=1
  grep -v -i "warn" "$OUT/pretrain_$kind.log" | grep -v "^step " | tail -20
  grep "^step " "$OUT/pretrain_$kind.log" | tail -3
  cp "$WORK/$kind/pretrain_stats.json" "$OUT/pretrain_stats_$kind.json" 2>/dev/null
}

# mismatch KIND: bench/moe_mismatch.py on $WORK/KIND, one GPU for trainer and server
mismatch() {
  local kind=$1
  if [ ! -f "$WORK/$kind/model.safetensors" ]; then
    echo "mismatch_$kind: no checkpoint" | tee "$OUT/mismatch_$kind.log"; rc=1; return
  fi
  budgeted "mismatch_$kind.log" python3 bench/moe_mismatch.py --model "$WORK/$kind" --device cuda:0 \
    --server-device cuda:0 --samples "$SAMPLES" --prompt-tokens 128 --new-tokens "$NEW_TOKENS" --reps 0 \
    --work "$WORK/bench_$kind" || rc=1
  grep -v -i "warn" "$OUT/mismatch_$kind.log" | tail -8
  cp "$WORK/bench_$kind/server.log" "$OUT/server_$kind.log" 2>/dev/null
}

# the MoE and its mismatch first: the dense baseline gets what is left, at
# most DENSE_S s of training, keeping RESERVE_S s for its overhead and bench
if [ -f "$WORK/moe/pretrain_stats.json" ]; then
  echo "pretrain: reusing $WORK/moe" | tee "$OUT/pretrain_moe.log"
  cp "$WORK/moe/pretrain_stats.json" "$OUT/pretrain_stats_moe.json"
else
  pretrain moe "$MOE_S"
fi
mismatch moe
# the dense twin sees the MoE's rows in the same order for the same number of steps
steps=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['train']['steps'])" \
  "$WORK/moe/pretrain_stats.json" 2>/dev/null || echo 100000)
secs=$(( $(left) - RESERVE_S ))
(( secs > DENSE_S )) && secs=$DENSE_S
if (( secs >= 20 )); then
  pretrain dense "$secs" --dense --steps "$steps"
  mismatch dense
else
  echo "dense baseline skipped: $(left) s left in BUDGET=$BUDGET" | tee "$OUT/pretrain_dense.log"; rc=1
fi
echo "device_pretrain_moe: exit $rc after $((SECONDS - T0)) s"
exit $rc
