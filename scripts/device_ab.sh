#!/usr/bin/env bash
# Same-host A/B of a benchmark: the code of another commit against this tree,
# alternated (old, new, old, new, ...) in one device call, so that a host's
# own speed cannot pass for a change of code. From the repo root, with the
# old tree extracted into a carried folder and .whl/ carried:
#
#   git archive <commit> | (mkdir -p old_base && tar -x -C old_base)
#   OUT=... BUDGET=560 bash scripts/device_ab.sh old_base 2 python3 bench/step_time.py --rounds 3
#
# Arguments: OLD_DIR PAIRS COMMAND...; COMMAND runs PAIRS times in each tree
# (its relative paths resolve there); logs go to $OUT/ab-<k>-<old|new>.log.
# Stops starting runs when BUDGET (seconds, default 560) is spent.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OLD=$1 PAIRS=$2
shift 2
OUT=${OUT:-$PWD/outputs/device_ab}
BUDGET=${BUDGET:-560}
mkdir -p "$OUT"
source scripts/device_env.sh
SITE=""
[ -d /tmp/site ] && SITE=/tmp/site:  # the wheels device_env.sh installed
NEW=$PWD
for k in $(seq 1 "$PAIRS"); do
  for side in old new; do
    dir=$([ $side = old ] && echo "$NEW/$OLD" || echo "$NEW")
    log="ab-$k-$side.log"
    echo "== $log: $* (in $dir, $(left) s left)"
    ( cd "$dir" && PYTHONPATH="$SITE$dir" timeout -k 5 "$(left)" "$@" > "$OUT/$log" 2>&1 )
    echo "   exit $? at $((SECONDS - T0)) s"
    (( $(left) > 60 )) || { echo "budget spent"; break 2; }
  done
done
