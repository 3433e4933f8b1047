#!/usr/bin/env bash
# bench/long_step_dist.py on 2 GPUs in one device call: a whole GRPO
# train_step of a Qwen3-4B-shaped model, built by trainer.build_policy from a
# random-weight HF checkpoint, on samples of 4k, 8k and 16k tokens: FSDP2
# (dp_shard 2), then FSDP2 x CP 2 (dp_shard 1 x context_parallel_degree 2);
# AC full, grpo.logprob_chunk_tokens 2048, bf16 FSDP2 mixed precision.
# Per row: step s, tokens/s, MFU, peak memory per GPU. From the repo root with
# .whl/ carried:
#
#   OUT=... BUDGET=500 bash scripts/device_long_dist.sh
#
# Each layout is its own torchrun under its own timeout (LAYOUT_S, at most the
# budget left), so one hang (an OOM on one rank alone leaves the other in a
# collective) costs that layout only. The first run writes the checkpoint
# (~8 GB bf16) to $WORK/ckpt; the second reuses it.
# TINY=1: the same on CPU with gloo and the tiny shape (the script's smoke test).
# AC=full|none|layer2|op (bench/long_step.py's --ac: selective modes recompute
# less than full AC); LAYOUTS="fsdp" runs one layout.
# Logs: $OUT/long_dist-fsdp.log, $OUT/long_dist-fsdp_cp.log; both tables in
# $OUT/long_dist.md (the same on stdout).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_long_dist}
BUDGET=${BUDGET:-500}
LAYOUT_S=${LAYOUT_S:-240}
TOKENS=${TOKENS:-4096,8192,16384}
LAYERS=${LAYERS:-36}
SAMPLES=${SAMPLES:-2}  # per data-parallel rank (CP ranks share theirs)
REPS=${REPS:-3}
WORK=${WORK:-/tmp/device_long_dist}
AC=${AC:-full}
LAYOUTS=${LAYOUTS:-fsdp fsdp_cp}
mkdir -p "$OUT" "$WORK"
source scripts/device_env.sh
if [[ ${TINY:-0} == 1 ]]; then
  ARGS=(--tiny --tokens "${TOKENS_TINY:-64,128}" --reps 1)
else
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee -a "$OUT/env.log"
  if (( $(nvidia-smi -L | wc -l) < 2 )); then echo "device_long_dist: needs 2 GPUs"; exit 2; fi
  ARGS=(--layers "$LAYERS" --tokens "$TOKENS" --chunk 2048 --reps "$REPS")
fi

rc=0
for layout in $LAYOUTS; do
  left_s=$(left)
  limit=$(( left_s < LAYOUT_S ? left_s : LAYOUT_S ))
  if (( limit <= 0 )); then echo "$layout skipped: no time left in BUDGET=$BUDGET" | tee "$OUT/long_dist-$layout.log"; rc=1; continue; fi
  t=$SECONDS
  timeout -k 10 "$limit" torchrun --standalone --nproc_per_node=2 bench/long_step_dist.py --layout "$layout" \
    "${ARGS[@]}" --samples-per-rank "$SAMPLES" --ac "$AC" --ckpt "$WORK/ckpt" > "$OUT/long_dist-$layout.log" 2>&1
  status=$?
  echo "$layout: exit $status after $((SECONDS - t)) s (limit $limit s)" | tee -a "$OUT/long_dist-$layout.log"
  (( status == 0 )) || { rc=1; grep -v -i warn "$OUT/long_dist-$layout.log" | grep -v "^ " | tail -15; }
done
{ grep -h "^# long_step_dist" "$OUT"/long_dist-*.log | head -1
  for layout in $LAYOUTS; do echo; grep -h -E "^(# $layout:|\| )" "$OUT/long_dist-$layout.log" | sed '/^# /G'; done
} > "$OUT/long_dist.md"
cat "$OUT/long_dist.md"
echo "device_long_dist: exit $rc after $((SECONDS - T0)) s"
exit $rc
