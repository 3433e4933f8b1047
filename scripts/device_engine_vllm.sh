#!/usr/bin/env bash
# The built-in server against a real vLLM 0.26 on one GPU in one device call
# (issue 50): bench/engine_vs_vllm.py, our server then vLLM on the same model
# files and prompts. From the repo root with .whl/ carried, after vLLM's parts
# were carried to /tmp/vparts (../shared/tools/vllm-parts.sh); this script
# unpacks them into /tmp/vsite when that is not there yet (~20 s):
#
#   OUT=... [BUDGET=570] [SHAPES=0.6b|4b] [LENGTHS=128,1024] [SEQS=64,256] \
#     [ROUTES=generate,completions,chat] [ENGINES=ours,vllm] [ARGS=...] bash scripts/device_engine_vllm.sh
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
if [[ ",$ENGINES," == *",vllm,"* && ! -f $VLLM_ENV ]]; then
  if [ -f /tmp/vparts/vllm-install.sh ]; then
    budgeted vllm_install.log bash /tmp/vparts/vllm-install.sh || { tail -5 "$OUT/vllm_install.log"; exit 2; }
  else
    echo "error: no vLLM on this machine: neither $VLLM_ENV nor /tmp/vparts/vllm-install.sh (carry vLLM's parts" \
         "there first: ../shared/tools/vllm-parts.sh), or run with ENGINES=ours" | tee "$OUT/engine_vs_vllm.log" >&2
    exit 2
  fi
fi
# vLLM runs with $VLLM_ENV sourced (its own site-packages); this process and our server keep the plain env.
budgeted engine_vs_vllm.log python3 bench/engine_vs_vllm.py --shapes "${SHAPES:-0.6b}" --lengths "${LENGTHS:-128,1024}" \
  --seqs "${SEQS:-64,256}" --routes "${ROUTES:-generate,completions,chat}" --engines "$ENGINES" \
  --vllm-env "$VLLM_ENV" --budget-s $(( $(left) - 25 )) --out "$OUT" ${ARGS:-}
rc=$?
cat "$OUT/engine_vs_vllm.log"
exit $rc
