#!/usr/bin/env bash
# tests/test_gather.py's worker on 2 GPUs, several times in one device call,
# to catch a rare hang (run 33) with every thread's stack in the logs. Run
# from the repo root on a 2-GPU machine with the wheels of
# ../shared/tools/device-wheels.sh in .whl/:
#
#   OUT=... BUDGET_S=300 LAYOUTS=fsdp,tp VARIANTS="a: b: host:STAGING=host" bash scripts/device_gather_repeat.sh
#
# VARIANTS: space-separated "name:ENV=V,..."; each runs the worker under
# torchrun x2 (at most LIMIT_S seconds) and then its --check. A variant's
# environment may set STAGING (the worker's --staging), NODUMP=1 (no stack
# dumps; else every DUMP_S seconds, by the worker's faulthandler) and
# NOREDIR=1 (the ranks' output into torchrun's log instead of one file per
# rank under $OUT/NAME/ranks). PATCH: a patch applied to this copy of the
# tree first (run 34 applied run 33's three-version patch, since landed).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-outputs/device_gather_repeat}
BUDGET=${BUDGET_S:-300}
LIMIT=${LIMIT_S:-90}
DUMP_S=${DUMP_S:-35}
VARIANTS=${VARIANTS:-"plain:"}
WORK=/tmp/gather_repeat
mkdir -p "$OUT" "$WORK"
source scripts/device_env.sh

if [[ -n "${PATCH:-}" ]]; then
  patch -p1 < "$PATCH" > "$OUT/patch.log" 2>&1 || exit 4
fi
test_models "$WORK/models" || exit 5

for variant in $VARIANTS; do
  name=${variant%%:*}; envs=${variant#*:}
  (( $(left) > 20 )) || { echo "$name: skipped, no time left"; continue; }
  mkdir -p "$OUT/$name" "$WORK/$name"
  (
    [[ -n "$envs" ]] && export ${envs//,/ }
    export GRPO_TEST_DUMP_S=$DUMP_S; [[ -z "${NODUMP:-}" ]] || export GRPO_TEST_DUMP_S=0
    redirect=(--log-dir "$OUT/$name/ranks" --redirects 3); [[ -z "${NOREDIR:-}" ]] || redirect=()
    limit=$(( LIMIT < $(left) - 10 ? LIMIT : $(left) - 10 ))
    t=$SECONDS
    timeout -k 5 "$limit" torchrun --standalone --nproc_per_node=2 "${redirect[@]}" \
      tests/test_gather.py --out "$WORK/$name" --layouts "${LAYOUTS:-fsdp}" ${STAGING:+--staging $STAGING} $MODELS \
      > "$OUT/$name/torchrun.log" 2>&1
    echo "$name ($envs): exit $? after $((SECONDS - t)) s"
  )
  python3 tests/test_gather.py --out "$WORK/$name" --check > "$OUT/$name/check.log" 2>&1
  echo "$name check: $(tr '\n' ' ' < "$OUT/$name/check.log")"
done
echo "device_gather_repeat: done after $((SECONDS - T0)) s"
