#!/usr/bin/env bash
# Issue 52 (last part) on one GPU in one device call: GRPO on the small
# Qwen3-MoE that scripts/pretrain_moe.py pretrains on this machine's
# site-packages sources, with a verifiable code reward (complete a held-out
# function from its signature and docstring: train_configs/moe_code_grpo.toml,
# torchtitan_grpo/rollout/code_task.py), three ways from the same seed:
#
#   replay-off      grpo.router_replay = "off"      (the token-level GRPO loss)
#   replay-rollout  grpo.router_replay = "rollout"  (R3: the server's routes replayed)
#   gspo            grpo.loss_agg = "gspo", replay off
#
# Steps: pretraining (MOE_S seconds of training; skipped when $WORK/moe holds a
# finished checkpoint, i.e. its pretrain_stats.json), the dataset
# (scripts/make_code_dataset.py, the pretraining's held-out files), then the
# runs, STEPS steps each, each under an equal share of the time left (SIGTERM
# at its share: the trainer stops at a step boundary, its steps so far logged).
# From the repo root with .whl/ carried:
#
#   OUT=... BUDGET=570 bash scripts/device_moe_grpo.sh
#
# ARGS is appended to every run's command line (e.g. ARGS="--optimizer.lr 1e-4").
#
# Files in $OUT (the device returns 8 at most): env.log, pretrain_moe.log,
# pretrain_stats_moe.json, dataset.log, summary.md (scripts/run_summary.py's
# table, then per-step curves: reward, trainer-vs-rollout k3 and |dlogp|,
# importance weights, clip fraction, eval pass@1), runs.tgz (per run: its log,
# metrics.jsonl and the server log's tail). The tables also go to stdout.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/outputs/device_moe_grpo}
BUDGET=${BUDGET:-570}
MOE_S=${MOE_S:-200}
STEPS=${STEPS:-30}
RUNS=${RUNS:-"replay-off replay-rollout gspo"}
ARGS=${ARGS:-}
WORK=${WORK:-/tmp/pretrain_moe}
CONFIG=train_configs/moe_code_grpo.toml
mkdir -p "$OUT" "$WORK" "$OUT/runs"
source scripts/device_env.sh
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee -a "$OUT/env.log"
rc=0

# pretraining, unless a finished checkpoint is there (pretrain_stats.json is written last)
if [ -f "$WORK/moe/pretrain_stats.json" ]; then
  echo "pretrain: reusing $WORK/moe" | tee "$OUT/pretrain_moe.log"
else
  rm -rf "${WORK:?}/moe"
  budgeted pretrain_moe.log python3 scripts/pretrain_moe.py --out "$WORK/moe" --time-limit-s "$MOE_S" \
    --device cuda || rc=1
  grep -E "^(corpus|Qwen3|trained|transformers)" "$OUT/pretrain_moe.log"
  grep "^step " "$OUT/pretrain_moe.log" | tail -2
fi
cp "$WORK/moe/pretrain_stats.json" "$OUT/pretrain_stats_moe.json" 2>/dev/null
if [ ! -f "$WORK/moe/pretrain_stats.json" ]; then
  echo "device_moe_grpo: no pretrained checkpoint in $WORK/moe; exit 1 after $((SECONDS - T0)) s"; exit 1
fi

budgeted dataset.log python3 scripts/make_code_dataset.py --out-dir "$WORK/code" || rc=1
cat "$OUT/dataset.log"
[ -s "$WORK/code/train.jsonl" ] || { echo "device_moe_grpo: no dataset; exit 1"; exit 1; }

# run NAME SECONDS: one GRPO run of the config, the variant NAME, stopped at SECONDS
run() {
  local name=$1 secs=$2 args
  case $name in
    replay-off) args=(--grpo.router_replay off) ;;
    replay-rollout) args=(--grpo.router_replay rollout) ;;
    gspo) args=(--grpo.router_replay off --grpo.loss_agg gspo) ;;
    *) echo "device_moe_grpo: unknown run $name (replay-off, replay-rollout, gspo)"; rc=1; return ;;
  esac
  rm -rf "/tmp/runs/$name"
  timeout -k 20 "$secs" python3 -m torch.distributed.run --standalone --nproc_per_node=1 grpo_train.py \
    --job.config_file "$CONFIG" --model.hf_assets_path "$WORK/moe" --training.steps "$STEPS" \
    --rollout.dataset_path "$WORK/code/train.jsonl" --eval.dataset_path "$WORK/code/eval.jsonl" \
    --job.dump_folder "/tmp/runs/$name" "${args[@]}" $ARGS > "$OUT/runs/$name.log" 2>&1 || rc=1
  # torchrun's worker runs in a session of its own, so killing torchrun at the time limit left it
  # going (run 135: 46 s beside the next run). Whatever of this run is left gets 20 s, then SIGKILL.
  local pat="--job.dump_folder /tmp/runs/$name( |\$)" i
  pkill -TERM -f -- "$pat" 2>/dev/null
  for i in $(seq 20); do pgrep -f -- "$pat" > /dev/null || break; sleep 1; done
  pkill -KILL -f -- "$pat" 2>/dev/null
  cp "/tmp/runs/$name/metrics.jsonl" "$OUT/$name-metrics.jsonl" 2>/dev/null
  tail -c 100000 "/tmp/runs/$name/servers/server_0.log" > "$OUT/runs/$name-server.log" 2>/dev/null
  echo "== $name: $(grep -E 'rollouts:|mean reward|stopped|Error' "$OUT/runs/$name.log" | sed 's/^\[rank0\] //' \
    | head -4 | tr '\n' ' ')"
  grep -E "eval step|INFO step +(1|10|20|30|40|50|100) \|" "$OUT/runs/$name.log" | sed 's/^\[rank0\] //'
}

n=$(wc -w <<< "$RUNS")
for name in $RUNS; do
  share=$(( ($(left) - 15) / n )); n=$((n - 1))  # 15 s kept for the tables
  if (( share < 60 )); then
    echo "== $name: skipped, $(left) s left in BUDGET=$BUDGET"; rc=1; continue
  fi
  run "$name" "$share"
done

# the tables: run_summary.py's, then the per-step figures issue 52 asks for
python3 scripts/run_summary.py "$OUT" $RUNS > "$OUT/summary.md" 2>&1
python3 - "$OUT" $RUNS >> "$OUT/summary.md" 2>&1 <<'EOF'
import json, os, sys

out, runs = sys.argv[1], sys.argv[2:]
cols = [("reward/mean", "reward", ".3f"), ("trainer_vs_rollout_k3", "k3", ".2e"),
        ("trainer_vs_rollout_logprob_mean_abs_diff", "mean abs dlogp", ".2e"),
        ("trainer_vs_rollout_logprob_max_abs_diff", "max abs dlogp", ".2e"),
        ("trainer_vs_rollout_extreme_frac_0.5", "share > 0.5", ".2e"),
        ("trainer_vs_rollout_extreme_frac_1.0", "share > 1.0", ".2e"),
        ("offpolicy/is_weight_mean", "IS mean", ".4f"), ("offpolicy/is_weight_max", "IS max", ".3f"),
        ("offpolicy/is_capped_frac", "IS capped", ".4f"), ("clip_fraction", "clip", ".4f"),
        ("moe/replayed_tokens", "replayed", ".0f")]


def rows(run):
    path = os.path.join(out, f"{run}-metrics.jsonl")
    return [json.loads(line) for line in open(path) if line.strip()] if os.path.exists(path) else []


for run in runs:
    steps = [r for r in rows(run) if "loss" in r]
    evals = [r for r in rows(run) if "eval/pass@1" in r]
    print(f"\n### {run}: {len(steps)} steps; eval pass@1 " +
          ", ".join(f"step {e['step']} {e['eval/pass@1']:.3f}" for e in evals))
    print("| step | " + " | ".join(c[1] for c in cols) + " |")
    print("|---:|" + "---:|" * len(cols))
    for r in steps:
        print(f"| {r['step']} | " + " | ".join(format(r[k], f) if isinstance(r.get(k), (int, float)) else "-"
                                             for k, _, f in cols) + " |")
    for part in (steps[:10], steps[-10:]) if len(steps) > 10 else (steps,):
        if part:
            vals = {k: [r[k] for r in part if isinstance(r.get(k), (int, float))] for k, _, _ in cols}
            print(f"| mean {part[0]['step']}-{part[-1]['step']} | " +
                  " | ".join(format(sum(v) / len(v), f) if v else "-" for (k, _, f), v in zip(cols, vals.values()))
                  + " |")
EOF
# stdout: the comparison table and each run's means (every step is in summary.md)
grep -v -E "^\| [0-9]+ \|" "$OUT/summary.md"
# one archive of the rest: the device returns 8 files at most
(cd "$OUT" && shopt -s nullglob && m=(./*-metrics.jsonl) && tar czf runs.tgz runs "${m[@]}" && rm -rf runs "${m[@]}")
echo "device_moe_grpo: exit $rc after $((SECONDS - T0)) s"
exit $rc
