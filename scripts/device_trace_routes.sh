#!/usr/bin/env bash
# Issue 50: the built-in server's routes on 0.6B x 128 tokens under
# bench/server_trace.py (stack samples and the engine's timeline per row), once
# per server variant, one device call; from the repo root with .whl/ carried:
#
#   OUT=... [BUDGET=400] [VARIANTS="base|--admission-window-ms 40"] bash scripts/device_trace_routes.sh
#
# VARIANTS: '|'-separated server arguments ("base" = none), each may start with
# NAME=value words put in the server's environment (e.g. TRACE_SWITCH_INTERVAL_MS=1,
# bench/server_trace.py's GIL switch interval). Results:
# $OUT/<i>/engine_vs_vllm.md and $OUT/<i>/trace/summary.md per variant, all
# packed in $OUT/trace.tgz (a device call brings back few files).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_trace_routes}
BUDGET=${BUDGET:-400}
mkdir -p "$OUT"
source scripts/device_env.sh
IFS='|' read -ra VARS <<< "${VARIANTS:-base}"
i=0
for v in "${VARS[@]}"; do
  [ "$v" = base ] && v=""
  envs=(); args=()
  for w in $v; do if [[ $w =~ ^[A-Z_]+= ]]; then envs+=("$w"); else args+=("$w"); fi; done
  mkdir -p "$OUT/$i"
  echo "== variant $i: environment '${envs[*]}', server args '${args[*]}'" | tee -a "$OUT/variants.log"
  timeout -k 5 "$(left)" env "${envs[@]}" python3 bench/engine_vs_vllm.py --shapes 0.6b --lengths "${LENGTHS:-128}" --seqs "${SEQS:-64,256}" \
    --routes "${ROUTES:-generate,completions,chat}" --engines ours --server-args "${args[*]}" --out "$OUT/$i" \
    --trace "$OUT/$i/trace" ${ARGS:-} > "$OUT/$i/bench.log" 2>&1
  grep "^| ours" "$OUT/$i/engine_vs_vllm.md" | tee -a "$OUT/variants.log"
  i=$((i + 1))
done
tar -czf "$OUT/trace.tgz" -C "$OUT" $(seq 0 $((i - 1))) variants.log env.log
