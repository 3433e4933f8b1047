#!/usr/bin/env bash
# A whole pipelined GRPO run on long, long-tailed samples on a 4-GPU machine
# in one device call (issue 38; issue 41's servers on several GPUs):
# bench/long_pipeline.py writes a random Qwen3-4B-shaped checkpoint and a
# dataset whose rows carry Pareto-distributed max_new_tokens (MIN_NEW..MAX_NEW),
# then runs ONE torchrun --nproc_per_node=2 grpo_train.py: trainer FSDP2 on
# cuda:0-1 (bf16, full AC, packed micro-batches, chunked log-probs), two
# built-in servers it launches on cuda:2 and cuda:3 (inference.server_devices,
# paged KV cache), pipeline_depth 1, async NCCL push. Printed per step: step
# time, trainer wait / train / busy fraction, fleet tok/s, mean / max
# completion length, groups in flight, admission lag and staleness. From the
# repo root with .whl/ carried, on nvidia-h100-x4 (or nvidia-h200-x4):
#
#   OUT=... BUDGET=560 [STEPS=8] [MAX_NEW=8192] [MIN_NEW=512] [ALPHA=0.8] [PROMPTS=8] [GROUP=8] \
#     [LAYERS=36] [ARGS="--max-staleness 8"] bash scripts/device_long_pipeline.sh
#
# MODE=cpu runs the smoke test instead (--cpu --tiny: 2 gloo ranks, 2 CPU
# servers). The run is stopped ~50 s before BUDGET runs out; the steps it
# logged are still tabled. Logs go to $OUT: long_pipeline.log (the table),
# and the run folder (train.log, server logs, metrics.jsonl, the TOML) in
# $OUT/run.tgz, checkpoints left out.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_long_pipeline}
BUDGET=${BUDGET:-560}
mkdir -p "$OUT"
source scripts/device_env.sh
WORK=${WORK:-/tmp/long_pipeline}  # the 8 GB checkpoint stays off $OUT
if [ "${MODE:-gpu}" = cpu ]; then
  flags=(--cpu --tiny)
else
  nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv | tee -a "$OUT/env.log"
  flags=(--steps "${STEPS:-8}" --max-new "${MAX_NEW:-8192}" --min-new "${MIN_NEW:-512}" --alpha "${ALPHA:-0.8}"
         --prompts "${PROMPTS:-8}" --group-size "${GROUP:-8}" --layers "${LAYERS:-36}")
fi
# The bench's own limit (the run stopped 30 s before it) leaves time for the table and the archive.
budgeted long_pipeline.log python3 bench/long_pipeline.py "${flags[@]}" --out "$WORK" \
  --budget-s "$(( $(left) - 20 > 60 ? $(left) - 20 : 60 ))" ${ARGS:-}
rc=$?
cat "$OUT/long_pipeline.log" | grep -v -i "warn"
if [ -d "$WORK/run" ]; then
  grep -E "INFO step|rollouts:|stopped|Error|captured|paged KV" "$WORK/run/train.log" 2>/dev/null | tail -20
  find "$WORK/run" -name "*.safetensors" -delete 2>/dev/null
  tar czf "$OUT/run.tgz" --exclude=tb --exclude=checkpoint -C "$WORK" run
fi
echo "device_long_pipeline: exit $rc after $((SECONDS - T0)) s"
exit $rc
