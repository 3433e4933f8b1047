"""The step's share of "extreme" tokens (issue 52: the router-replay paper's
measure): rollout tokens whose trainer-vs-rollout log-prob gap passes 0.5 or
1.0, counted per step beside the k3 KL."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ROOT

DEMO = f"{ROOT}/train_configs/demo_cpu.toml"


def test_train_step_reports_the_share_of_tokens_past_each_gap(tiny_model_dir):
    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.train.sample import Sample
    from torchtitan_grpo.train.trainer import build_policy, init_distributed, train_step

    cfg = parse_config(["--job.config_file", DEMO, "--model.hf_assets_path", tiny_model_dir])
    d = init_distributed()
    policy = build_policy(cfg, tiny_model_dir, d)
    # Rollout log-probs = the trainer's own minus a chosen gap per token: the step's
    # log(pi_train / pi_rollout) is then that gap (before the optimizer moves anything).
    gaps = {(5, 9, 14): [0.0, 0.7, -1.5, 0.2], (8, 3): [0.6, 0.0, 0.0, -0.3]}
    completions = {(5, 9, 14): [22, 7, 30, 2], (8, 3): [11, 40, 41, 12]}
    batch = []
    with torch.no_grad():
        for prompt, gap in gaps.items():
            seq = [*prompt, *completions[prompt]]
            logp = torch.log_softmax(policy.model(torch.tensor([seq]))[0].float(), -1)
            own = [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(completions[prompt])]
            batch.append(Sample(list(prompt), completions[prompt], [lp - g for lp, g in zip(own, gap)],
                                0.0, 0.0, "stop", ["0"]))
    m = train_step(policy, batch, cfg.grpo, 1.0, 8, len(batch), 8, 0, d)
    assert m["trainer_vs_rollout_extreme_frac_0.5"] == pytest.approx(3 / 8)  # 0.7, -1.5, 0.6
    assert m["trainer_vs_rollout_extreme_frac_1.0"] == pytest.approx(1 / 8)  # -1.5
    assert m["trainer_vs_rollout_logprob_max_abs_diff"] == pytest.approx(1.5, abs=1e-4)
