#!/usr/bin/env bash
# Runs one task of a job step started by grpo.sbatch:
#
#   step.sh GPU_START GPU_COUNT CMD [ARGS...]
#
# * GPU_COUNT > 0: CUDA_VISIBLE_DEVICES becomes GPUs GPU_START .. GPU_START+GPU_COUNT-1
#   of the GPUs this task can see (its CUDA_VISIBLE_DEVICES as SLURM set it, or
#   every GPU nvidia-smi lists), so two steps on one node get disjoint GPUs.
#   GPU_COUNT = 0 leaves the environment alone (CPU).
# * An argument equal to @NODE_RANK@ becomes this task's rank in the step
#   (SLURM_PROCID: one task per node, in node order), for torchrun --node_rank.
#
# Then it execs CMD, so signals from srun reach the program itself.
set -euo pipefail

gpu_start=$1 gpu_count=$2
shift 2

if (( gpu_count > 0 )); then
    if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
        IFS=, read -ra gpus <<<"$CUDA_VISIBLE_DEVICES"
    else
        mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null || true)
    fi
    if (( gpu_start + gpu_count > ${#gpus[@]} )); then
        echo "step.sh on $(hostname -s): needs GPUs $gpu_start..$((gpu_start + gpu_count - 1)) but sees ${#gpus[@]} (${gpus[*]:-none})" >&2
        exit 1
    fi
    CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${gpus[*]:gpu_start:gpu_count}")
    export CUDA_VISIBLE_DEVICES
fi

args=()
for a in "$@"; do
    if [[ $a == @NODE_RANK@ ]]; then args+=("${SLURM_PROCID:-0}"); else args+=("$a"); fi
done
exec "${args[@]}"
