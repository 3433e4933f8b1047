# Sourced (not run) by scripts/device_multirank.sh and scripts/device_parity.sh,
# from the repo root, with OUT and BUDGET set: the wheels of
# ../shared/tools/device-wheels.sh (in .whl/, carried) installed into
# /tmp/site, the environment recorded in $OUT/env.log, and the time budget.
T0=$SECONDS
left() { echo $(( BUDGET - (SECONDS - T0) )); }
# budgeted LOG CMD...: CMD under the time left, output to $OUT/LOG (timeout 0 would mean no limit)
budgeted() {
  local log=$1; shift
  if (( $(left) <= 0 )); then echo "skipped: no time left in BUDGET_S=$BUDGET" > "$OUT/$log"; return 1; fi
  timeout -k 5 "$(left)" "$@" > "$OUT/$log" 2>&1
}

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 3
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name --format=csv,noheader;
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'transformers', transformers.__version__)"; } 2>&1 | tee "$OUT/env.log"
