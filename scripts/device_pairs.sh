#!/usr/bin/env bash
# Two 2-GPU jobs side by side on a 4-GPU machine, in one device call (kind
# nvidia-h100-x4 / nvidia-h200-x4), each pair seeing only its own GPUs:
#
#   pair A (GPUs 0,1): scripts/device_long_dist.sh: the Qwen3-4B-shaped GRPO
#     step at 4k/8k/16k tokens, FSDP2 and FSDP2 x CP 2 (issue 38's MFU table);
#   pair B (GPUs 2,3): scripts/device_cp.sh (CP 2 = one process, fp32),
#     scripts/device_lora_sharded.sh (LoRA x FSDP2 = one process, bf16 base
#     over NCCL), then the MoE demo with expert parallelism 2 (EP x FSDP 2
#     trainer ranks, router replay on, the built-in server beside rank 1, gloo
#     push; issue 39's EP on GPUs): reward, mismatch and step time per step.
#
#   OUT=... BUDGET=540 bash scripts/device_pairs.sh
#
# The pairs share the host (64 cores) and NVLink, not their GPUs; pair A's
# timings are what one pair of GPUs gives while another pair runs
# correctness checks (little NVLink traffic). Logs: $OUT/A/, $OUT/B/.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_pairs}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT/A" "$OUT/B"
source scripts/device_env.sh  # installs the wheels once, before the pairs start
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$OUT/gpus.txt" 2>&1

pair_b() {
  local rc=0
  OUT=$OUT/B BUDGET_S=120 WORK=/tmp/pairB_cp bash scripts/device_cp.sh > "$OUT/B/cp.out" 2>&1 || rc=1
  OUT=$OUT/B BUDGET_S=150 bash scripts/device_lora_sharded.sh > "$OUT/B/lora_sharded.out" 2>&1 || rc=1
  local left=$(( BUDGET - (SECONDS - T0) - 15 ))
  if (( left > 60 )); then
    rm -rf /tmp/pairB_moe
    timeout -k 5 "$left" torchrun --standalone --nproc_per_node=2 grpo_train.py \
      --job.config_file train_configs/demo_moe_cpu.toml --job.dump_folder /tmp/pairB_moe \
      --training.steps "${MOE_STEPS:-60}" \
      --parallelism.expert_parallel_degree 2 --inference.server_devices cuda:1 \
      > "$OUT/B/moe_ep.log" 2>&1 || rc=1
    cp /tmp/pairB_moe/metrics.jsonl "$OUT/B/moe_ep_metrics.jsonl" 2>/dev/null
  else
    echo "skipped: no time left" > "$OUT/B/moe_ep.log"; rc=1
  fi
  return $rc
}

( export CUDA_VISIBLE_DEVICES=0,1; OUT=$OUT/A BUDGET=$(( BUDGET - 20 )) bash scripts/device_long_dist.sh \
    > "$OUT/A/long_dist.out" 2>&1 ) &
a=$!
( export CUDA_VISIBLE_DEVICES=2,3; pair_b ) &
b=$!
rc=0
wait $a || rc=1
wait $b || rc=1
echo "== pair A: device_long_dist"; grep -v -i warn "$OUT/A/long_dist.out" | tail -25
echo "== pair B: device_cp"; grep -E "PASS|FAIL|exit" "$OUT/B/cp.out"
echo "== pair B: device_lora_sharded"; tail -4 "$OUT/B/lora_sharded.out"
echo "== pair B: MoE demo, EP 2"; grep -E "INFO step|Error|stopped|rollouts:" "$OUT/B/moe_ep.log" | sed -n '1,3p;$p' 
grep -E "INFO step" "$OUT/B/moe_ep.log" | tail -3
echo "device_pairs: exit $rc after $((SECONDS - T0)) s"
exit $rc
