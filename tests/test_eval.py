"""[eval]: held-out evaluation during training (metrics, the evaluator on a
real event loop, config checks, and the CPU demo end to end, pipelined)."""

import json
import os
import subprocess
import sys
import threading

import pytest

from tests.conftest import ROOT
from torchtitan_grpo.aio import LoopThread
from torchtitan_grpo.config.checks import ConfigError
from torchtitan_grpo.config.parse import parse_config
from torchtitan_grpo.fleet.pool import NoHealthyReplica
from torchtitan_grpo.fleet.types import Completion, SamplingParams
from torchtitan_grpo.metrics import MetricLogger
from torchtitan_grpo.rollout.evaluation import Evaluator, eval_metrics, eval_rows, format_eval_line
from torchtitan_grpo.rollout.groups import GroupScorer, ScoredGroup
from torchtitan_grpo.session import RolloutSide

DEMO = os.path.join(ROOT, "train_configs", "demo_cpu.toml")


def _group(rewards, tokens=4, truncated=0, versions=("3",)):
    return ScoredGroup(0, [], list(rewards), tokens, truncated, False, versions=list(versions))


def test_metrics_pass_at_1_and_k_against_hand_counts():
    groups = [_group([1.0, 0.0, 0.0, 0.0]), _group([0.0, 0.0, 0.0, 0.0]), _group([1.0, 1.0, 0.5, 1.0], truncated=2)]
    m = eval_metrics(groups, threshold=1.0, versions=[3, 4], seconds=2.0)
    assert m["eval/pass@1"] == pytest.approx(4 / 12)  # 4 of 12 completions reach 1.0
    assert m["eval/pass@4"] == pytest.approx(2 / 3)  # prompts 1 and 3 have a correct one
    assert m["eval/mean_reward"] == pytest.approx(4.5 / 12)
    assert m["eval/truncated_frac"] == pytest.approx(2 / 12)
    assert m["eval/completion_len"] == pytest.approx(12 / 12)
    assert (m["eval/weight_version_min"], m["eval/weight_version_max"]) == (3.0, 4.0)
    assert eval_metrics(groups, threshold=0.5, versions=[], seconds=0)["eval/pass@1"] == pytest.approx(5 / 12)
    # one completion per prompt: no pass@k beside pass@1
    assert "eval/pass@1" in eval_metrics([_group([1.0])], 1.0, [], 0) and \
        not any(k.startswith("eval/pass@") and k != "eval/pass@1" for k in eval_metrics([_group([1.0])], 1.0, [], 0))
    line = format_eval_line(7, m)
    assert line.startswith("eval step    7 | pass@1 0.333 | pass@4 0.667 | reward 0.375 | 3 prompts")
    assert "version 3-4" in line


class _Tok:
    """Characters as token ids (the scorer only encodes and decodes)."""

    eos_token_id = None
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class _EchoPool:
    """Answers each prompt with its own text reversed, under a fixed version;
    records what it was asked."""

    def __init__(self, fail: bool = False):
        self.calls, self.fail, self.lock = [], fail, threading.Lock()

    async def generate(self, prompt_ids, n, params):
        with self.lock:
            self.calls.append((list(prompt_ids), n, params))
        if self.fail:
            raise NoHealthyReplica("every replica is down")
        out = list(reversed(prompt_ids))
        return [Completion(out, [-0.1] * len(out), "stop", "5", ["5"]) for _ in range(n)]


def _reversed_is_answer(prompt, completion, row):
    return 1.0 if completion == row["answer"] else 0.0


@pytest.fixture
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


def _evaluator(loop, pool, rows, n=1, waited=None):
    scorer = GroupScorer(_Tok(), _reversed_is_answer, group_size=n, scale_rewards=False)
    return Evaluator(loop, pool, scorer, rows, sampling=SamplingParams(max_new_tokens=8, temperature=0.0),
                     pass_threshold=1.0, max_concurrent=2,
                     wait_version=None if waited is None else waited.append)


def test_evaluator_scores_every_row_greedy_after_the_version_is_served(loop):
    rows = [{"prompt": "ab", "answer": "ba"}, {"prompt": "xy", "answer": "no"}, {"prompt": "q", "answer": "q"}]
    pool, waited = _EchoPool(), []
    ev = _evaluator(loop, pool, rows, waited=waited)
    ev.submit(4, version=4)
    ev.submit(4, version=4)  # a step is evaluated once
    (result,) = ev.wait()
    assert waited == [4]  # it waited for the servers to hold version 4 before asking
    assert result.step == 4 and result.metrics["eval/pass@1"] == pytest.approx(2 / 3)
    assert result.metrics["eval/weight_version_min"] == 5.0  # what the servers reported, not assumed
    assert sorted(c[0] for c in pool.calls) == sorted([[ord(c) for c in r["prompt"]] for r in rows])
    assert all(n == 1 and p.temperature == 0.0 for _, n, p in pool.calls)
    assert ev.poll() == []


def test_eval_prompts_fit_the_sequence_limit(loop):
    """Limit 8: "ab" is asked for 6 new tokens and "abcdef" for 2, not 8; the
    9-token prompt leaves no room: never sent, left out of the scores, counted."""
    rows = [{"prompt": "ab", "answer": "ba"}, {"prompt": "abcdef", "answer": "fe"},
            {"prompt": "x" * 9, "answer": "x"}]
    pool = _EchoPool()
    scorer = GroupScorer(_Tok(), _reversed_is_answer, group_size=1, scale_rewards=False)
    ev = Evaluator(loop, pool, scorer, rows, sampling=SamplingParams(max_new_tokens=8, temperature=0.0),
                   pass_threshold=1.0, max_concurrent=2, max_sequence_tokens=8)
    ev.submit(1, version=1)
    (result,) = ev.wait()
    asked = {"".join(map(chr, ids)): p.max_new_tokens for ids, _, p in pool.calls}
    assert asked == {"ab": 6, "abcdef": 2}
    assert result.metrics["eval/skipped_long_prompts"] == 1 and result.metrics["eval/prompts"] == 2
    assert result.metrics["eval/pass@1"] == pytest.approx(1 / 2)  # "ab" reversed is its answer, "fedcba" is not "fe"


def test_a_failed_evaluation_is_skipped_with_a_warning_not_raised(loop, caplog):
    ev = _evaluator(loop, _EchoPool(fail=True), [{"prompt": "ab", "answer": "ba"}])
    ev.submit(2, version=2)
    with caplog.at_level("WARNING", logger="torchtitan_grpo"):
        assert ev.wait() == []
    assert any("eval of step 2 skipped: NoHealthyReplica" in r.getMessage() for r in caplog.records)


def test_rollout_side_evaluates_when_due_and_logs_rows_outside_the_step_history(loop, tmp_path):
    cfg = parse_config(["--job.config_file", DEMO, "--eval.enable", "--eval.interval", "2", "--eval.no-at-start"])
    ev = _evaluator(loop, _EchoPool(), [{"prompt": "ab", "answer": "ba"}])
    log = MetricLogger(str(tmp_path), enable_tensorboard=False)
    side = RolloutSide(None, None, log, 0, evaluator=ev, eval_config=cfg.eval, eval_blocking=True)
    side.evaluate(0, 0, "start")  # at_start off
    for step in (1, 2, 3):
        side.evaluate(step, step)
    side.evaluate(3, 3, "end")
    log.close()
    assert [r.step for r in side.eval_results] == [2, 3]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(r["step"], r["eval/pass@1"]) for r in rows] == [(2, 1.0), (3, 1.0)]
    assert log.history == []


def test_eval_rows_take_the_first_max_samples_in_file_order(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(5)))
    cfg = parse_config(["--job.config_file", DEMO, "--rollout.task", "jsonl", "--rollout.dataset_path", str(path),
                        "--rollout.prompt_key", "question", "--rollout.reward_fn", "tests.reward_fixtures:varies_with_text",
                        "--eval.enable", "--eval.dataset_path", str(path), "--eval.max_samples", "3"])
    assert [r["prompt"] for r in eval_rows(cfg.eval, cfg.rollout)] == ["q0", "q1", "q2"]
    digits = parse_config(["--job.config_file", DEMO, "--eval.enable"])
    assert [r["prompt"] for r in eval_rows(digits.eval, digits.rollout)] == [f"{d}>" for d in range(10)]


@pytest.mark.parametrize("args, key", [
    (["--eval.samples_per_prompt", "4"], "eval.samples_per_prompt"),  # greedy k > 1
    (["--eval.interval", "-1"], "eval.interval"),
    (["--eval.temperature", "-0.5"], "eval.temperature"),
    (["--eval.dataset_path", "/nonexistent/eval.jsonl"], "eval.dataset_path"),
    (["--eval.max_concurrent", "0"], "eval.max_concurrent"),
])
def test_bad_eval_values_name_the_key(args, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config(["--job.config_file", DEMO, "--eval.enable", *args])


@pytest.mark.slow
def test_demo_pipelined_evaluates_at_start_interval_and_end(tmp_path, tiny_model_dir):
    """The CPU demo, pipelined (async push, the rollout client in its own
    process, the evaluation on rank 0's own pool): greedy evaluations of the
    ten digits prompts at step 0, every 2 steps and after the last, in
    metrics.jsonl, TensorBoard and one line each; the trainer's rows are
    unchanged."""
    dump = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(ROOT, "grpo_train.py"), "--job.config_file", DEMO, "--job.dump_folder", dump,
           "--model.hf_assets_path", tiny_model_dir, "--training.steps", "5", "--grpo.prompts_per_step", "4",
           "--weight_sync.mode", "async", "--eval.enable", "--eval.interval", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "pipelined (pipeline depth 1), client in its own process" in r.stdout
    rows = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
    evals = [m for m in rows if "eval/pass@1" in m]
    assert [m["step"] for m in rows if "eval/pass@1" not in m] == [1, 2, 3, 4, 5]
    assert [m["step"] for m in evals] == [0, 2, 4, 5]
    for m in evals:
        assert m["eval/prompts"] == 10 and 0 <= m["eval/pass@1"] <= 1
        # the async push had landed the step's version before the eval asked (it waits for it)
        assert m["eval/weight_version_min"] >= m["step"], m
    assert r.stdout.count("eval step") == 4 and "eval pass@1: step 0" in r.stdout
    assert os.listdir(os.path.join(dump, "tb"))


def test_the_slower_push_for_a_serial_loop_on_a_shared_gpu_is_warned_about(monkeypatch):
    """Serial (float32 trainer, auto depth) with the servers on the trainer's
    GPU: the async push is slower than the sync one there (issue 37)."""
    from torchtitan_grpo.session import push_mode_hint

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    base = ["--job.config_file", DEMO, "--inference.server_device", "cuda:0", "--weight_sync.transport", "ipc"]
    cfg = parse_config(base + ["--weight_sync.mode", "async"])  # the demo trains in float32: auto stays serial
    assert "weight_sync.mode \"sync\" is faster" in push_mode_hint(cfg)
    assert push_mode_hint(parse_config(base + ["--weight_sync.mode", "sync"])) is None
    assert push_mode_hint(parse_config(base + ["--weight_sync.mode", "async", "--training.mixed_precision_param",
                                               "bfloat16"])) is None  # pipelined: async is the right push
