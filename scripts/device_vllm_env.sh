# Sourced (not run) by the scripts/device_vllm_*.sh, from the repo root, with OUT, BUDGET and GGUF
# set: scripts/device_env.sh, then a real vLLM 0.26 (unpacked by ../shared/tools/vllm-install.sh
# into /tmp/vsite, or its parts in /tmp/vparts), the SmolLM2 GGUF converted to $MODEL, and the
# arithmetic data in data/arith.
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
  printf '%s\n' '"""Stand-in: ray is not installed here (scripts/device_vllm_env.sh)."""' \
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
