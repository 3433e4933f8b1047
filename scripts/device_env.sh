# Sourced (not run) by the scripts/device_*.sh that run tests and benchmarks,
# from the repo root, with OUT and BUDGET set: the wheels of
# `bash ../shared/tools/device-wheels.sh orjson gguf math-verify jsonschema
# jsonschema-specifications referencing rpds-py attrs` (in .whl/, carried; the
# GPU machines lack orjson, and without it the server's replies fall back to
# the standard library's encoder; without jsonschema tests/test_server.py
# skips whole) installed into /tmp/site, the
# environment recorded in $OUT/env.log (with the replies' encoder), the time
# budget, and test_models for the gather test's checkpoints.
T0=$SECONDS
left() { echo $(( BUDGET - (SECONDS - T0) )); }
# budgeted LOG CMD...: CMD under the time left, output to $OUT/LOG (timeout 0 would mean no limit)
budgeted() {
  local log=$1; shift
  if (( $(left) <= 0 )); then echo "skipped: no time left in BUDGET_S=$BUDGET" > "$OUT/$log"; return 1; fi
  timeout -k 5 "$(left)" "$@" > "$OUT/$log" 2>&1
}

if compgen -G ".whl/*.whl" > /dev/null; then
  # Once per machine: scripts run side by side (scripts/device_pairs.sh) must
  # not reinstall under each other's imports.
  if [ ! -f /tmp/site/.installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || exit 3
    touch /tmp/site/.installed
  fi
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name --format=csv,noheader;
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'transformers', transformers.__version__)"
  python3 -c "from torchtitan_grpo import jsonfast as j; print('replies encoded by', 'orjson ' + j.orjson.__version__ if j.orjson else 'json (no orjson: carry its wheel in .whl/)')"; } 2>&1 | tee "$OUT/env.log"

# test_models DIR: write tests/rank_cases.py's tiny checkpoints under
# DIR and set MODELS to the matching --model=NAME=PATH flags of
# tests/test_gather.py (empty, and a non-zero status, if writing them failed).
test_models() {
  MODELS=""
  python3 -c "
import json, sys
from tests.rank_cases import write_models
print(json.dumps(write_models(sys.argv[1])))" "$1" > "$1.json" 2> "$OUT/models.log" || return 1
  MODELS=$(python3 -c "import json,sys; print(' '.join(f'--model={k}={v}' for k,v in json.load(open(sys.argv[1])).items()))" "$1.json")
}
