#!/usr/bin/env bash
# The built-in server against a real vLLM 0.26 on one GPU in one device call
# (issue 50): bench/engine_vs_vllm.py, our server then vLLM on the same model
# files and prompts. From the repo root with .whl/ carried, after vLLM's parts
# were carried to /tmp/vparts (../shared/tools/vllm-parts.sh); this script
# unpacks them into /tmp/vsite when that is not there yet (~20 s):
#
#   OUT=... [BUDGET=570] [SHAPES=0.6b|4b] [LENGTHS=128,1024] [SEQS=64,256] \
#     [ROUTES=generate,completions,chat] [ENGINES=ours,vllm] [ARGS=...] \
#     [PROFILE=0|1|vllm] [TABLE=1|0] [PROFILE_SEQS=64] [PROFILE_ARGS=...] bash scripts/device_engine_vllm.sh
#
# PROFILE=1: after the table, bench/engine_profile.py for each shape in SHAPES:
# our engine in-process, 20 decode steps of PROFILE_SEQS sequences profiled
# after 512 (GEMM / attention / sampling / logprobs / copies / other / GPU
# idle per step, launches, graph coverage, HBM roofline) and the reply-building
# cost of each route; ~40 s for 0.6b (model written, engine up, ~3 s of
# decode), ~60 s for 4b. The table's budget keeps 70 s per shape for it.
# PROFILE=vllm adds vLLM's own profile of the same decode (--profiler-config,
# /start_profile): a second vLLM start, ~150 s more a shape, so it fits the
# 0.6b call only with TABLE=0 or a shorter table. TABLE=0: the profile alone.
#
# A baseline in the same call: carry a tree of the baseline commit (e.g.
# `mkdir -p .before && git archive REV torchtitan_grpo | tar -x -C .before`, carry
# ".before") and pass ENGINES=before,ours,vllm ARGS="--before-src .before
# --before-routes generate,chat".
#
# One shape per call: the whole table (both shapes) does not fit 10 minutes
# (vLLM starts in ~100 s per model). SHAPES=0.6b takes ~6 min, SHAPES=4b ~8.
# Results: $OUT/engine_vs_vllm.{md,json} (rewritten after every row, so a
# call cut short keeps its rows), engine_vs_vllm.log, servers.log, env.log.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_engine_vllm}
BUDGET=${BUDGET:-570}
ENGINES=${ENGINES:-ours,vllm}
mkdir -p "$OUT"
source scripts/device_env.sh
VLLM_ENV=/tmp/vsite/env.sh
PROFILE=${PROFILE:-0}
if [[ ( ",$ENGINES," == *",vllm,"* || $PROFILE == vllm ) && ! -f $VLLM_ENV ]]; then
  if [ -f /tmp/vparts/vllm-install.sh ]; then
    budgeted vllm_install.log bash /tmp/vparts/vllm-install.sh || { tail -5 "$OUT/vllm_install.log"; exit 2; }
  else
    echo "error: no vLLM on this machine: neither $VLLM_ENV nor /tmp/vparts/vllm-install.sh (carry vLLM's parts" \
         "there first: ../shared/tools/vllm-parts.sh), or run with ENGINES=ours" | tee "$OUT/engine_vs_vllm.log" >&2
    exit 2
  fi
fi
SHAPE_LIST=${SHAPES:-0.6b}
N_SHAPES=$(( $(tr -cd , <<< "$SHAPE_LIST" | wc -c) + 1 ))
RESERVE=0
[ "$PROFILE" != 0 ] && RESERVE=$(( 70 * N_SHAPES ))
[ "$PROFILE" = vllm ] && RESERVE=$(( 220 * N_SHAPES ))
rc=0
if [ "${TABLE:-1}" != 0 ]; then
  # vLLM runs with $VLLM_ENV sourced (its own site-packages); this process and our server keep the plain env.
  budgeted engine_vs_vllm.log python3 bench/engine_vs_vllm.py --shapes "$SHAPE_LIST" --lengths "${LENGTHS:-128,1024}" \
    --seqs "${SEQS:-64,256}" --routes "${ROUTES:-generate,completions,chat}" --engines "$ENGINES" \
    --vllm-env "$VLLM_ENV" --budget-s $(( $(left) - 25 - RESERVE )) --out "$OUT" ${ARGS:-}
  rc=$?
  cat "$OUT/engine_vs_vllm.log"
fi
if [ "$PROFILE" != 0 ]; then
  PROFILE_ENGINES=ours
  [ "$PROFILE" = vllm ] && PROFILE_ENGINES=ours,vllm
  for shape in ${SHAPE_LIST//,/ }; do
    budgeted "engine_profile_$shape.log" python3 bench/engine_profile.py --shape "$shape" \
      --seqs "${PROFILE_SEQS:-64}" --engines "$PROFILE_ENGINES" --vllm-env "$VLLM_ENV" \
      --budget-s $(( $(left) - 20 )) --out "$OUT/profile-$shape" ${PROFILE_ARGS:-} || rc=1
    cat "$OUT/engine_profile_$shape.log"
  done
fi
exit $rc
