#!/usr/bin/env bash
# The CPU demo's task with its trainer on cuda:0 (the tiny Qwen3; the built-in
# server stays on CPU), trained in float32 and in bf16 autocast
# (training.mixed_precision_param), with the sync push (serial, on-policy) and
# the async one (pipelined): every run should learn as the demo does (first 10
# steps ~0.01, last 10 >= 0.95). One device call, from the repo root with
# .whl/ carried:
#
#   OUT=... BUDGET=420 bash scripts/device_demo_precision.sh
#
# Logs: $OUT/<mode>-<dtype>.log (each run's step lines); each run's folder
# (metrics.jsonl, server log) in $OUT/runs.tgz.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_demo_precision}
BUDGET=${BUDGET:-420}
mkdir -p "$OUT"
source scripts/device_env.sh
rc=0
names=()
for mode in sync async; do
  for dtype in float32 bfloat16; do
    name=$mode-$dtype
    names+=("$name")
    budgeted "$name.log" python3 -m torch.distributed.run --standalone --nproc_per_node=1 grpo_train.py \
      --job.config_file train_configs/demo_cpu.toml --training.mixed_precision_param "$dtype" \
      --weight_sync.mode "$mode" --job.dump_folder "$OUT/$name" || rc=1
    echo "== $name: $(grep -E 'policy qwen3|rollouts:|mean reward' "$OUT/$name.log" | sed 's/^\[rank0\] //' | tr '\n' ' ')"
    grep -E "INFO step +(1|10|50|100|150) \|" "$OUT/$name.log"
  done
done
# The device tool brings back only a few files: the runs' folders go in one
# archive (their TensorBoard folders left out).
tar czf "$OUT/runs.tgz" --exclude=tb -C "$OUT" "${names[@]}" 2>/dev/null && (cd "$OUT" && rm -rf "${names[@]}")
echo "device_demo_precision: exit $rc after $((SECONDS - T0)) s"
exit $rc
