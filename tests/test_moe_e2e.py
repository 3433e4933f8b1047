"""The MoE demo end to end (train_configs/demo_moe_cpu.toml): a tiny Qwen3-MoE
written at the demo's own path, served by the built-in server with its routed
experts, trained with ``grpo.router_replay = "rollout"``; and the same with
expert parallelism over 2 ranks. Plus the replay count the step reports
(``moe_step.step_metrics``) on its own, without a launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.test_e2e import _env, _metrics, _servers_alive

DEMO_MOE = os.path.join(ROOT, "train_configs", "demo_moe_cpu.toml")
PROMPT_LEN = 2  # the digits task's prompts: one digit and ">"


def _torchrun(nproc: int, cwd: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "grpo_train.py"), "--job.config_file", DEMO_MOE, *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=_env(), timeout=timeout)


def _check_every_step_replayed(rows: list[dict], samples_per_step: int) -> None:
    """fp32 on both sides, sync pushes: the trainer's log-probs are the
    server's; and every position of every sample (prompt + completion - 1:
    the engine's routes) went to the rollout's experts in the trainer."""
    for m in rows:
        assert m["trainer_vs_rollout_logprob_max_abs_diff"] <= 1e-4, m
        assert m["weight_version"] == m["step"], m
        assert "moe/replayed_tokens" in m, ("the step reports no moe/replayed_tokens: trainer.train_step must "
                                            "merge moe_step.step_metrics(...) into its metrics")
        want = samples_per_step * (PROMPT_LEN - 1) + m["rollout/tokens"]
        assert m["moe/replayed_tokens"] == want, (m["moe/replayed_tokens"], want)


@pytest.mark.slow
def test_moe_demo_learns_with_router_replay(tmp_path):
    """The MoE demo's command, unchanged, from a fresh working directory: it
    writes the tiny Qwen3-MoE at its own ./outputs/tiny-qwen3-moe, and the
    model learns the digits task by RL alone (near chance -> >= 0.8), every
    step on-policy with the rollout's routes replayed."""
    dump = str(tmp_path / "run")
    r = _torchrun(1, str(tmp_path), "--job.dump_folder", dump)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    model = tmp_path / "outputs" / "tiny-qwen3-moe"
    assert "writing a tiny random Qwen3-MoE model and tokenizer to ./outputs/tiny-qwen3-moe" in r.stdout
    config = json.loads((model / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_local_experts"] == 8, config
    rows = _metrics(dump)
    assert [m["step"] for m in rows] == list(range(1, 101))
    first = sum(m["reward/mean"] for m in rows[:10]) / 10
    last = sum(m["reward/mean"] for m in rows[-10:]) / 10
    assert first < 0.15 and last >= 0.8, (first, last)
    _check_every_step_replayed(rows, 16 * 16)
    assert _servers_alive(str(model)) == []


@pytest.mark.slow
def test_moe_demo_expert_parallel_two_ranks(tmp_path):
    """EP 2 over dp_shard 2 (experts 4 + 4 per rank, dense weights FSDP, gloo):
    the routes of each rank's own samples are replayed, the expert shards are
    gathered for the push, and the servers sample with the trainer's exact
    weights (the trainer's log-probs equal theirs)."""
    dump = str(tmp_path / "run")
    r = _torchrun(2, str(tmp_path), "--job.dump_folder", dump, "--parallelism.expert_parallel_degree", "2",
                  "--training.steps", "3", "--grpo.prompts_per_step", "4", "--grpo.group_size", "4",
                  "--lr_scheduler.warmup_steps", "0",
                  # distinct samples score differently: the steps change the weights whatever the seeds
                  "--rollout.reward_fn", "tests.reward_fixtures:varies_with_text")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = _metrics(dump)
    assert [m["step"] for m in rows] == [1, 2, 3]
    assert any(m["grad_norm"] > 0 for m in rows[:-1]), rows  # the weights did move before later rollouts
    _check_every_step_replayed(rows, 4 * 4)
    assert _servers_alive(str(tmp_path / "outputs" / "tiny-qwen3-moe")) == []


# ------------------------------------------------------------ no launch


def test_the_moe_demo_path_is_written_as_a_moe(tmp_path, monkeypatch):
    """The MoE demo's own path may be missing at start-up, and what the
    start-up writes there (asking for the dense demo's shape with the run's
    seed) is the tiny Qwen3-MoE; the dense demo's path stays dense."""
    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.models.demo_assets import TinyQwen3, ensure_tiny_qwen3

    monkeypatch.chdir(tmp_path)
    cfg = parse_config(["--job.config_file", DEMO_MOE])
    assert cfg.model.hf_assets_path == "./outputs/tiny-qwen3-moe" and cfg.grpo.router_replay == "rollout"
    assert not (tmp_path / "outputs").exists()  # validation writes nothing
    ensure_tiny_qwen3(cfg.model.hf_assets_path, TinyQwen3(seed=4))
    config = json.loads((tmp_path / "outputs" / "tiny-qwen3-moe" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_experts_per_tok"] == 2, config
    ensure_tiny_qwen3("outputs/tiny-qwen3", TinyQwen3(seed=4))
    assert json.loads((tmp_path / "outputs" / "tiny-qwen3" / "config.json").read_text())["model_type"] == "qwen3"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from torchtitan_grpo.models.demo_assets import TinyQwen3Moe, write_tiny_qwen3

    return write_tiny_qwen3(str(tmp_path_factory.mktemp("models") / "moe"), TinyQwen3Moe(seed=3))


@pytest.mark.parametrize("replay", ["rollout", "off"])
def test_step_metrics_count_the_replayed_positions(moe_dir, replay):
    """Positions with routes count, positions without (-1: routed normally,
    a sample without routes) do not; the count restarts after each report;
    replay off reports nothing."""
    import torchtitan_grpo  # noqa: F401  (before torchtitan)
    from torchtitan_grpo.train import moe_step
    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.train.trainer import Sample, build_policy, init_distributed

    cfg = parse_config(["--job.config_file", DEMO_MOE, "--model.hf_assets_path", moe_dir,
                        "--grpo.router_replay", replay])
    policy = build_policy(cfg, moe_dir, init_distributed())
    device = next(policy.model.parameters()).device
    routes = np.zeros((5, 2, 2), dtype=np.int16)
    routes[:, :, 1] = 1
    routes[0] = -1  # the engine gave no route for the first prompt token
    samples = [Sample([5, 9, 14], [22, 7, 1], [-4.0] * 3, 1.0, 1.0, "stop", ["0"], routed_experts=routes),
               Sample([8, 3], [11, 1], [-4.0] * 2, 1.0, 1.0, "stop", ["0"])]  # no routes: routes normally
    for _ in range(2):  # two micro-batches in one step
        with moe_step.replayed(policy.model, cfg.grpo, samples, length=8):
            pass
    got = moe_step.step_metrics(policy.model, cfg.grpo, None, device)
    assert got == ({"moe/replayed_tokens": 2 * 4.0} if replay == "rollout" else {}), got
    again = moe_step.step_metrics(policy.model, cfg.grpo, None, device)
    assert again == ({"moe/replayed_tokens": 0.0} if replay == "rollout" else {}), again
