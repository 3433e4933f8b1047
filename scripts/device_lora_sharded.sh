#!/usr/bin/env bash
# Issue 40: LoRA on two trainer ranks (torchtitan_grpo/lora/sharded.py) on
# two GPUs of one host, over NCCL, one GPU per rank (run from the repo root
# with the wheels of ../shared/tools/device-wheels.sh in .whl/, carried):
#
#   bash scripts/device_lora_sharded.sh       # kind nvidia-h100-x2
#
# python -m pytest tests/test_lora_sharded.py: its one torchrun launch runs
# on the GPUs when there are two (CPU/gloo otherwise): FSDP2 x LoRA against
# one process after two GRPO steps (losses, adapter gradients and weights,
# merged HF weights, merged and adapter pushes, peft tensors; fp32, 1e-5),
# the frozen base untouched, a DCP save/resume, and lora.base_dtype =
# "bfloat16" under FSDP2 in float32 and in bf16 mixed precision (the GPU
# check of the bf16 base that the CPU run cannot give: NCCL all-gathers of a
# group whose frozen weights are bf16 and adapters float32).
# Log: $OUT/pytest.log (default outputs/device_lora_sharded/). Ends within
# BUDGET_S (default 240; on 2 CPU cores the launch takes about 30 s of CPU).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-outputs/device_lora_sharded}
BUDGET=${BUDGET_S:-240}
mkdir -p "$OUT"
source scripts/device_env.sh

rc=0
python3 -c "import torch, sys; n = torch.cuda.device_count(); print('GPUs:', n); sys.exit(0 if n >= 2 else 1)" \
  | tee "$OUT/gpus.log" || { echo "device_lora_sharded: needs 2 GPUs (the test would run on CPU)"; exit 1; }
budgeted pytest.log python3 -m pytest -q -ra -p no:cacheprovider tests/test_lora_sharded.py || rc=1
tail -15 "$OUT/pytest.log"
echo "device_lora_sharded: exit $rc after $((SECONDS - T0)) s"
exit $rc
