#!/usr/bin/env bash
# The real-model recipe (train_configs/smollm2_arith.toml) on one GPU, serial
# (sync push, on-policy) then pipelined (async push), each followed by the
# exported checkpoint's greedy accuracy in transformers (scripts/eval_hf.py),
# to set beside the run's last [eval] line. One device call, from the repo
# root with .whl/ carried and the SmolLM2 GGUF at $GGUF:
#
#   OUT=... BUDGET=560 GGUF=/tmp/smollm2.gguf STEPS=150 bash scripts/device_recipe.sh
#
# MODES="async" runs one loop only; ARGS="--lora.enable ..." is passed to every
# run; BASE=0 skips the base model's transformers check (known from run 102);
# PREP=0 skips the conversion and the dataset (a caller running two recipes side
# by side makes them once); RUNS names the folder of the runs' dump folders.
# The GGUF (98 MB) is more than one call carries: the device tool brings it
# in two parts (split -b 50M), joined in /tmp by the caller's command.
# Logs: $OUT/<mode>.log (step and eval lines), $OUT/<mode>-metrics.jsonl,
# $OUT/<mode>-eval_hf-<dtype>.log, $OUT/convert.log.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_recipe}
BUDGET=${BUDGET:-560}
GGUF=${GGUF:-/tmp/smollm2.gguf}
STEPS=${STEPS:-150}
MODES=${MODES:-"sync async"}
RUNS=${RUNS:-/tmp/runs}
mkdir -p "$OUT"
source scripts/device_env.sh
rc=0
MODEL=/tmp/smollm2-135m-instruct
if [ "${PREP:-1}" = 1 ]; then
  budgeted convert.log python3 -m torchtitan_grpo.models.gguf "$GGUF" "$MODEL" --dtype float32 || exit 4
  budgeted data.log python3 scripts/make_arith_dataset.py --out-dir data/arith || exit 5
fi
if [ "${BASE:-1}" = 1 ]; then
  budgeted eval_hf-base.log python3 scripts/eval_hf.py "$MODEL" data/arith/eval.jsonl --max-new-tokens 192 --dtype bfloat16
fi
n_modes=$(wc -w <<< "$MODES")
for mode in $MODES; do
  # the time left, shared by the runs still to go (60 s kept for each run's transformers check)
  share=$(( ($(left) - 60 * n_modes) / n_modes ))
  n_modes=$((n_modes - 1))
  run=$RUNS/$mode
  timeout -k 5 "$share" python3 -m torch.distributed.run --standalone --nproc_per_node=1 grpo_train.py \
    --job.config_file train_configs/smollm2_arith.toml --model.hf_assets_path "$MODEL" \
    --weight_sync.mode "$mode" --training.steps "$STEPS" --job.dump_folder "$run" ${ARGS:-} > "$OUT/$mode.log" 2>&1 || rc=1
  cp "$run/metrics.jsonl" "$OUT/$mode-metrics.jsonl" 2>/dev/null
  echo "== $mode: $(grep -E 'rollouts:|mean reward|eval pass@1' "$OUT/$mode.log" | sed 's/^\[rank0\] //' | tr '\n' ' ')"
  grep -E "eval step|INFO step +(1|10|25|50|75|100|125|150) \|" "$OUT/$mode.log" | sed 's/^\[rank0\] //'
  if [ -d "$run/hf" ]; then
    budgeted "$mode-eval_hf-bfloat16.log" python3 scripts/eval_hf.py "$run/hf" data/arith/eval.jsonl \
      --max-new-tokens 192 --dtype bfloat16
    tail -1 "$OUT/$mode-eval_hf-bfloat16.log"
  fi
done
[ -f "$OUT/eval_hf-base.log" ] && tail -1 "$OUT/eval_hf-base.log"
echo "device_recipe: exit $rc after $((SECONDS - T0)) s"
exit $rc
