#!/usr/bin/env bash
# Three jobs side by side on a 4-GPU machine, in one device call (kind
# nvidia-h100-x4 / nvidia-h200-x4), each seeing only its own GPUs:
#
#   GPUs 0,1: scripts/device_long_dist.sh, FSDP2 only, with selective
#     activation checkpointing (AC=op, then AC=layer2 at 16k): issue 38's MFU
#     target at 16k tokens (34.0 % with full AC, run 111);
#   GPU 2: the SmolLM2 recipe, pipelined (scripts/device_recipe.sh MODES=async);
#   GPU 3: the same recipe with DAPO's dynamic sampling (--grpo.dynamic_sampling),
#     so the two held-out evaluations come from the same machine and call.
#
# The GGUF (98 MB) is more than one call carries: the previous call on the
# same warm machine left its first half at $PART_A; this call carries the
# second ($PART_B); they are joined and checked against the index's md5.
#
#   OUT=... BUDGET=540 [PART_A=/tmp/gguf.part.aa] [PART_B=outputs/gguf_b/gguf.part.ab] \
#     [STEPS=150] bash scripts/device_long_recipe.sh
#
# Logs: $OUT/long/{op,layer2}/ (long_dist.md), $OUT/plain/, $OUT/dynamic/.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_long_recipe}
BUDGET=${BUDGET:-540}
PART_A=${PART_A:-/tmp/gguf.part.aa}
PART_B=${PART_B:-outputs/gguf_b/gguf.part.ab}
GGUF=/tmp/smollm2.gguf
mkdir -p "$OUT/long/op" "$OUT/long/layer2" "$OUT/plain" "$OUT/dynamic"
source scripts/device_env.sh  # installs the wheels once, before the jobs start
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$OUT/gpus.txt" 2>&1

cat "$PART_A" "$PART_B" > "$GGUF" || exit 4
sum=$(md5sum "$GGUF" | cut -d' ' -f1)
echo "gguf md5 $sum" | tee "$OUT/gguf.md5"
[ "$sum" = a1231443440b107ff29f02bdb38c9d0a ] || { echo "device_long_recipe: the joined GGUF's md5 differs"; exit 4; }
MODEL=/tmp/smollm2-135m-instruct
python3 -m torchtitan_grpo.models.gguf "$GGUF" "$MODEL" --dtype float32 > "$OUT/convert.log" 2>&1 || exit 4
python3 scripts/make_arith_dataset.py --out-dir data/arith > "$OUT/data.log" 2>&1 || exit 5

long() {
  local b=$(( BUDGET - (SECONDS - T0) - 20 ))
  OUT=$OUT/long/op BUDGET=$(( b * 6 / 10 )) LAYOUT_S=400 AC=op LAYOUTS=fsdp TOKENS=8192,16384 \
    bash scripts/device_long_dist.sh > "$OUT/long/op.out" 2>&1
  b=$(( BUDGET - (SECONDS - T0) - 20 ))
  OUT=$OUT/long/layer2 BUDGET=$b LAYOUT_S=400 AC=layer2 LAYOUTS=fsdp TOKENS=16384 \
    bash scripts/device_long_dist.sh > "$OUT/long/layer2.out" 2>&1
}
recipe() {  # recipe NAME [ARGS]
  OUT=$OUT/$1 BUDGET=$(( BUDGET - (SECONDS - T0) - 15 )) PREP=0 BASE=0 MODES=async RUNS=/tmp/runs-$1 \
    GGUF=$GGUF STEPS=${STEPS:-150} ARGS="${2:-}" bash scripts/device_recipe.sh > "$OUT/$1/recipe.out" 2>&1
}
( export CUDA_VISIBLE_DEVICES=0,1; long ) &
a=$!
( export CUDA_VISIBLE_DEVICES=2; recipe plain ) &
b=$!
( export CUDA_VISIBLE_DEVICES=3; recipe dynamic --grpo.dynamic_sampling ) &
c=$!
rc=0
wait $a || rc=1
wait $b || rc=1
wait $c || rc=1
for ac in op layer2; do echo "== long step, AC=$ac"; grep -v -i warn "$OUT/long/$ac.out" | tail -12; done
for r in plain dynamic; do echo "== recipe $r"; tail -14 "$OUT/$r/recipe.out"; done
echo "device_long_recipe: exit $rc after $((SECONDS - T0)) s"
exit $rc
