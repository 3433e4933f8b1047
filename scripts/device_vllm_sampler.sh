#!/usr/bin/env bash
# Does a real vLLM 0.26 sample what it reports (issue 49's open finding: through vLLM the
# SmolLM2 recipe's rollouts scored 3-4 x lower than through the built-in server at near-equal
# weights)? scripts/sampler_check.py against, one after the other on one GPU, same SmolLM2
# weights and the same 200 held-out prompts x 8 samples at temperature 1: the built-in server;
# vLLM as grpo_train starts it, seeded requests then unseeded ones; vLLM with --use-fp64-gumbel.
# One device call, from the repo root, with .whl/ carried and vLLM as for
# scripts/device_vllm_loop.sh (scripts/device_vllm_env.sh):
#
#   OUT=... BUDGET=420 GGUF=/tmp/smollm2.gguf bash scripts/device_vllm_sampler.sh
#
# Run 130-131: the built-in server's check took ~60 s (start-up included), each vLLM ~150 s
# (start-up ~100 s even eager; 64 prompts x 8). SAMPLER_VLLM_ARGS (default --enforce-eager: no
# torch.compile or graph capture; the sampler runs outside the model's graphs either way) goes to
# every vLLM. Table: $OUT/sampler.md; each server's log under $OUT/sampler-servers/<label>/.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_vllm_sampler}
BUDGET=${BUDGET:-420}
GGUF=${GGUF:-/tmp/smollm2.gguf}
SAMPLER_VLLM_ARGS=${SAMPLER_VLLM_ARGS:---enforce-eager}
mkdir -p "$OUT"
source scripts/device_vllm_env.sh
common=(--model-dir "$MODEL" --prompts data/arith/eval.jsonl --prompts-n 200 --n 8 --max-tokens 192
        --draws 8192 --per-request 128 --device cuda:0)
rc=0
budgeted sampler-builtin.log python3 scripts/sampler_check.py --launch builtin "${common[@]}" --label builtin \
  --log-dir "$OUT/sampler-servers/builtin" --out "$OUT/s-builtin.json" || rc=1
budgeted sampler-vllm.log python3 scripts/sampler_check.py --launch vllm "--engine-args=$SAMPLER_VLLM_ARGS" \
  "${common[@]}" --label vllm --log-dir "$OUT/sampler-servers/vllm" --out "$OUT/s-vllm.json" \
  --also-unseeded "$OUT/s-vllm-unseeded.json" || rc=1
budgeted sampler-vllm64.log python3 scripts/sampler_check.py --launch vllm \
  "--engine-args=$SAMPLER_VLLM_ARGS,--use-fp64-gumbel" "${common[@]}" --label "vllm fp64" \
  --log-dir "$OUT/sampler-servers/vllm64" --out "$OUT/s-vllm64.json" || rc=1
present=()
for f in s-builtin s-vllm s-vllm-unseeded s-vllm64; do [ -f "$OUT/$f.json" ] && present+=("$OUT/$f.json"); done
python3 scripts/sampler_check.py --compare "${present[@]}" | tee "$OUT/sampler.md"
for f in sampler-builtin sampler-vllm sampler-vllm64; do tail -3 "$OUT/$f.log"; done
echo "device_vllm_sampler: exit $rc after $((SECONDS - T0)) s"
exit $rc
