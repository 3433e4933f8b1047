"""The trainer's step on a tiny Qwen3-MoE: router replay through train_step
(padded and packed micro-batches), the load-balancing loss, the start-up
checks, and the trainer-vs-rollout mismatch metrics."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import torchtitan_grpo  # noqa: F401  (before torchtitan)
from torchtitan_grpo.models import router_replay
from torchtitan_grpo.config.parse import parse_config
from torchtitan_grpo.models.demo_assets import TinyQwen3Moe, write_tiny_qwen3
from torchtitan_grpo.train.trainer import Sample, build_policy, init_distributed, train_step

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train_configs", "demo_cpu.toml")
LAYERS, TOP_K, EXPERTS = 2, 2, 8


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return write_tiny_qwen3(str(tmp_path_factory.mktemp("models") / "moe"), TinyQwen3Moe(seed=5))


def _policy(moe_dir, *args):
    cfg = parse_config(["--job.config_file", DEMO, "--model.hf_assets_path", moe_dir,
                        "--optimizer.lr", "0", "--grpo.logprob_chunk_tokens", "0", *args])
    return cfg, build_policy(cfg, moe_dir, init_distributed())


def _forward(policy, seq: list[int], packed: bool) -> torch.Tensor:
    """``[T, V]`` logits of one sequence, as the trainer's micro-batches run it."""
    from torchtitan_grpo.train import packing

    device = next(policy.model.parameters()).device
    with torch.no_grad(), policy.amp:  # the trainer's precision (bf16 autocast on a GPU)
        if not packed:
            return policy.model(torch.tensor([seq], device=device))[0]
        row = packing.pack_row([seq], 0, device)
        return policy.model(row.tokens, **row.model_kwargs())[0, : len(seq)]


def _own_routes(policy, seq: list[int], packed: bool) -> np.ndarray:
    """The routes the trainer's own routers pick over ``seq[:-1]``."""
    routers = router_replay.moe_routers(policy.model)
    for _, r in routers:
        r.keep_stats = True
    _forward(policy, seq, packed)
    out = np.stack([r.last_stats[1].cpu().numpy()[: len(seq)] for _, r in routers], axis=1)  # [T, layers, k]
    for _, r in routers:
        r.keep_stats, r.last_stats = False, None
    return out[:-1].astype(np.int16)


def _batch(policy, other: bool, packed: bool) -> list[Sample]:
    """Two samples whose rollout logprobs are the trainer's own (so the mismatch is
    0 routing as the trainer does) and whose routes are the trainer's own, or
    another expert set everywhere (``other``)."""
    out = []
    for prompt, completion in (([5, 9, 14], [22, 7, 30, 2]), ([8, 3], [11, 40, 41])):
        seq = prompt + completion
        routes = _own_routes(policy, seq, packed)
        if other:
            routes = ((routes.astype(np.int64) + TOP_K) % EXPERTS).astype(np.int16)  # disjoint sets
        logp = torch.log_softmax(_forward(policy, seq, packed).float(), -1)
        lps = [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(completion)]
        out.append(Sample(prompt, completion, lps, 1.0, 1.0, "stop", ["0"], routed_experts=routes))
    return out


@pytest.mark.parametrize("packed", [False, True])
def test_train_step_replays_the_rollouts_routes(moe_dir, packed):
    extra = ["--grpo.micro_batch_tokens", "64"] if packed else []
    cfg, policy = _policy(moe_dir, "--grpo.router_replay", "rollout", *extra)
    step = lambda batch: train_step(policy, batch, cfg.grpo, 1.0, 8, 2, 7, 0, init_distributed())  # noqa: E731
    # float32 on CPU; on a GPU the step's bf16 autocast over a two-row micro-batch vs one row here
    tol = 1e-5 if next(policy.model.parameters()).device.type == "cpu" else 3e-2
    same = step(_batch(policy, False, packed))  # replaying the trainer's own routes changes nothing
    assert same["trainer_vs_rollout_logprob_max_abs_diff"] < tol, same
    assert same["trainer_vs_rollout_k3"] < tol ** 2, same
    moved = step(_batch(policy, True, packed))  # other experts: other log-probs
    floor = max(1e-3, 3 * same["trainer_vs_rollout_logprob_mean_abs_diff"])
    assert moved["trainer_vs_rollout_logprob_mean_abs_diff"] > floor, moved
    cfg_off, policy_off = _policy(moe_dir, *extra)  # replay off ignores the routes
    off = train_step(policy_off, _batch(policy_off, True, packed), cfg_off.grpo, 1.0, 8, 2, 7, 0, init_distributed())
    assert off["trainer_vs_rollout_logprob_max_abs_diff"] < tol, off


def test_aux_loss_adds_gradient_to_the_routers_only_when_on(moe_dir):
    grads = {}
    for coef in ("0", "1.0"):
        cfg, policy = _policy(moe_dir, "--moe.aux_loss_coef", coef)
        batch = [Sample([5, 9], [22, 7], [-4.0, -4.0], 0.0, 0.0, "stop", ["0"])]  # advantage 0: no policy gradient
        policy.optimizers.zero_grad()
        from torchtitan_grpo.train import trainer

        trainer._forward_backward(policy, batch, trainer._LossContext(cfg.grpo, 1.0, 8, 1, 2), 0,
                                  init_distributed(), {k: 0.0 for k in ("loss", "clip_fraction", "lp_diff_max",
                                                                       "entropy", "tokens", "lp_diff_sum",
                                                                       "k3_sum")},
                                  __import__("torchtitan_grpo.train.importance", fromlist=["x"]).OffPolicyStats(
                                      cfg.grpo.is_correction, False))
        grads[coef] = {n: (p.grad.abs().sum().item() if p.grad is not None else 0.0)
                       for n, p in policy.model.named_parameters()}
    assert all(v == 0.0 for v in grads["0"].values())
    gate = [n for n in grads["1.0"] if "router.gate" in n]
    assert gate and all(grads["1.0"][n] > 0 for n in gate), grads["1.0"]


@pytest.mark.parametrize("args,key", [
    (["--grpo.router_replay", "rollout"], "grpo.router_replay"),
    (["--moe.aux_loss_coef", "0.01"], "moe.aux_loss_coef"),
])
def test_moe_options_on_a_dense_model_are_refused(tiny_model_dir, args, key):
    cfg = parse_config(["--job.config_file", DEMO, "--model.hf_assets_path", tiny_model_dir, *args])
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_policy(cfg, tiny_model_dir, init_distributed())
