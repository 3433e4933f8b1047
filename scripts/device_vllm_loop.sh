#!/usr/bin/env bash
# The loop against a real vLLM 0.26 on one GPU (issue 49): grpo_train starts
# vLLM itself on the trainer's GPU (inference.backend = "vllm", no urls) and
# pushes every version over vLLM's CUDA IPC engine; the SmolLM2 recipe
# (train_configs/smollm2_arith.toml) serial then pipelined, each with its
# held-out pass@1 before and after; then the same recipe on the built-in
# server, same GPU, serial, as the baseline for push seconds and the
# trainer-vs-server log-prob gap. One device call, from the repo root, with
# .whl/ carried, vLLM unpacked by ../shared/tools/vllm-install.sh into
# /tmp/vsite (or its parts in /tmp/vparts) and the SmolLM2 GGUF at $GGUF:
#
#   OUT=... BUDGET=570 GGUF=/tmp/smollm2.gguf STEPS=50 bash scripts/device_vllm_loop.sh
#
# RUNS="vllm-sync vllm-async builtin-sync" picks the runs (in that order).
# Logs: $OUT/<run>.log, $OUT/<run>-metrics.jsonl, $OUT/<run>-server.log (the
# launched server's own log), $OUT/summary.md (scripts/run_summary.py).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_vllm_loop}
BUDGET=${BUDGET:-570}
GGUF=${GGUF:-/tmp/smollm2.gguf}
STEPS=${STEPS:-50}
RUNS=${RUNS:-"vllm-sync vllm-async builtin-sync"}
mkdir -p "$OUT"
source scripts/device_env.sh
if [ ! -d /tmp/vsite ]; then
  bash /tmp/vparts/vllm-install.sh > "$OUT/vllm-install.log" 2>&1 || { echo "vLLM install failed: $OUT/vllm-install.log"; exit 6; }
fi
. /tmp/vsite/env.sh
# vLLM 0.26's IPC weight-transfer engine imports ray at module level and uses it
# only in the trainer-side "ray" send mode; ray is not carried (vllm-parts.sh):
# a stand-in that fails if anything actually uses it.
if ! python3 -c "import ray" 2>/dev/null; then
  mkdir -p /tmp/vstub/ray
  printf '%s\n' '"""Stand-in: ray is not installed here (scripts/device_vllm_loop.sh)."""' \
    'def __getattr__(name):' '    raise AttributeError(f"ray is not installed (stand-in module; ray.{name} was asked for)")' \
    > /tmp/vstub/ray/__init__.py
  export PYTHONPATH=$PYTHONPATH:/tmp/vstub
fi
python3 -c "import vllm; print('vllm', vllm.__version__)" | tee -a "$OUT/env.log"
MODEL=/tmp/smollm2-135m-instruct
if [ ! -f "$MODEL/config.json" ]; then
  budgeted convert.log python3 -m torchtitan_grpo.models.gguf "$GGUF" "$MODEL" --dtype float32 || exit 4
fi
[ -f data/arith/eval.jsonl ] || budgeted data.log python3 scripts/make_arith_dataset.py --out-dir data/arith || exit 5
rc=0
n=$(wc -w <<< "$RUNS")
for run in $RUNS; do
  share=$(( $(left) / n )); n=$((n - 1))
  engine=${run%-*}; mode=${run#*-}
  args=(--weight_sync.mode "$mode" --training.steps "$STEPS" --job.dump_folder "/tmp/runs/$run"
        --inference.startup_timeout_s 400)
  if [ "$engine" = vllm ]; then
    # vLLM beside the trainer on cuda:0: a share of the GPU, and the IPC push (NCCL cannot join two
    # processes on one GPU).
    args+=(--inference.backend vllm --inference.gpu_memory_utilization 0.3 --weight_sync.transport ipc)
  fi
  timeout -k 10 "$share" python3 -m torch.distributed.run --standalone --nproc_per_node=1 grpo_train.py \
    --job.config_file train_configs/smollm2_arith.toml --model.hf_assets_path "$MODEL" "${args[@]}" \
    > "$OUT/$run.log" 2>&1 || rc=1
  cp "/tmp/runs/$run/metrics.jsonl" "$OUT/$run-metrics.jsonl" 2>/dev/null
  tail -c 200000 "/tmp/runs/$run/servers/server_0.log" > "$OUT/$run-server.log" 2>/dev/null
  echo "== $run: $(grep -E 'rollouts:|mean reward|stopped after|error' "$OUT/$run.log" | sed 's/^\[rank0\] //' | head -5 | tr '\n' ' ')"
  grep -E "eval step|INFO step +(1|10|25|50) \|" "$OUT/$run.log" | sed 's/^\[rank0\] //'
done
python3 scripts/run_summary.py "$OUT" $RUNS | tee "$OUT/summary.md"
echo "device_vllm_loop: exit $rc after $((SECONDS - T0)) s"
exit $rc
