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
# RUNS="vllm-sync vllm-async builtin-sync" picks the runs (in that order). A run named
# <engine>-<mode>:<pause> pushes with that weight_sync.pause_mode (none, abort, in_place: vLLM's
# wait, abort, keep) for PAUSE_STEPS steps; VLLM_ARGS is appended to every vLLM run's
# inference.engine_args (e.g. --use-fp64-gumbel; --enforce-eager for PAUSE runs' quick start-up
# goes in PAUSE_VLLM_ARGS). LOOP_ARGS: more grpo_train flags for every run, e.g. the fp32-noise
# runs that isolate runs 128/131's slow learning: LOOP_ARGS="--inference.vllm_fp64_sampler false
# --rollout.seeded_requests false" (a launched vLLM gets --use-fp64-gumbel unless told not to).
# SERVER_DEVICE / TRANSPORT place every run's server and pick its push: the defaults (cuda:0, ipc)
# share the trainer's GPU; on a two-GPU machine SERVER_DEVICE=cuda:1 TRANSPORT=nccl gives the
# server the second GPU and pushes over an NCCL group (vLLM's own StatelessProcessGroup handshake,
# weight_sync/vllm_group.py), with vLLM at GPU_UTIL of it (default 0.3 shared, 0.85 alone).
# Logs: $OUT/<run>.log, $OUT/<run>-metrics.jsonl, $OUT/<run>-server.log (the
# launched server's own log), $OUT/summary.md (scripts/run_summary.py).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_vllm_loop}
BUDGET=${BUDGET:-570}
GGUF=${GGUF:-/tmp/smollm2.gguf}
STEPS=${STEPS:-50}
RUNS=${RUNS:-"vllm-sync vllm-async builtin-sync"}
VLLM_ARGS=${VLLM_ARGS:-}
PAUSE_STEPS=${PAUSE_STEPS:-8}
PAUSE_VLLM_ARGS=${PAUSE_VLLM_ARGS:-}
SERVER_DEVICE=${SERVER_DEVICE:-cuda:0}
TRANSPORT=${TRANSPORT:-ipc}
if [ "$SERVER_DEVICE" = cuda:0 ]; then GPU_UTIL=${GPU_UTIL:-0.3}; else GPU_UTIL=${GPU_UTIL:-0.85}; fi
read -r -a loop_args <<< "${LOOP_ARGS:-}"
mkdir -p "$OUT"
source scripts/device_vllm_env.sh
rc=0
tags=""
n=$(wc -w <<< "$RUNS")
for run in $RUNS; do
  share=$(( $(left) / n )); n=$((n - 1))
  name=${run%%:*}; pause=""; [ "$name" != "$run" ] && pause=${run#*:}
  engine=${name%-*}; mode=${name#*-}
  steps=$STEPS; eargs=$VLLM_ARGS
  [ -n "$pause" ] && { steps=$PAUSE_STEPS; eargs="$eargs${PAUSE_VLLM_ARGS:+,$PAUSE_VLLM_ARGS}"; }
  eargs=${eargs#,}
  args=(--weight_sync.mode "$mode" --training.steps "$steps" --job.dump_folder "/tmp/runs/$run"
        --inference.startup_timeout_s 400 --inference.server_device "$SERVER_DEVICE"
        --weight_sync.transport "$TRANSPORT")
  [ -n "$pause" ] && args+=(--weight_sync.pause_mode "$pause")
  if [ "$engine" = vllm ]; then
    # vLLM beside the trainer on cuda:0 takes a share of the GPU and the IPC push (NCCL cannot join
    # two processes on one GPU); on a GPU of its own, most of it.
    args+=(--inference.backend vllm --inference.gpu_memory_utilization "$GPU_UTIL")
    [ -n "$eargs" ] && args+=("--inference.engine_args=$eargs")
  fi
  tag=${run/:/_}
  timeout -k 10 "$share" python3 -m torch.distributed.run --standalone --nproc_per_node=1 grpo_train.py \
    --job.config_file train_configs/smollm2_arith.toml --model.hf_assets_path "$MODEL" "${args[@]}" "${loop_args[@]}" \
    > "$OUT/$tag.log" 2>&1 || rc=1
  cp "/tmp/runs/$run/metrics.jsonl" "$OUT/$tag-metrics.jsonl" 2>/dev/null
  tail -c 200000 "/tmp/runs/$run/servers/server_0.log" > "$OUT/$tag-server.log" 2>/dev/null
  echo "== $run: $(grep -E 'rollouts:|mean reward|stopped after|error' "$OUT/$tag.log" | sed 's/^\[rank0\] //' | head -5 | tr '\n' ' ')"
  grep -E "eval step|INFO step +(1|10|25|50) \|" "$OUT/$tag.log" | sed 's/^\[rank0\] //'
  tags="$tags $tag"
done
python3 scripts/run_summary.py "$OUT" $tags | tee "$OUT/summary.md"
echo "device_vllm_loop: exit $rc after $((SECONDS - T0)) s"
exit $rc
