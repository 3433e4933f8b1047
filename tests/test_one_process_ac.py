"""[activation_checkpoint] on one process: TorchTitan applies it inside its
parallelize_fn, which a one-process trainer never reaches, so
parallel.parallelize wraps the blocks itself (run 103: without it a 4B
model's 8k-token samples do not fit one H200)."""

import torch

from tests.test_chunked_logprobs import DEMO, _batch


def _step(tiny_model_dir, mode: str):
    from torchtitan_grpo.models import hf_bridge as hf_model
    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.train.trainer import build_policy, init_distributed, train_step

    cfg = parse_config(["--job.config_file", DEMO, "--model.hf_assets_path", tiny_model_dir,
                        "--activation_checkpoint.mode", mode, "--grpo.micro_batch_size", "3"])
    d = init_distributed()
    policy = build_policy(cfg, tiny_model_dir, d)
    wrapped = [type(block).__name__ == "CheckpointWrapper" for block in policy.model.layers.values()]
    batch = _batch()
    metrics = train_step(policy, batch, cfg.grpo, 1.0, 8, len(batch), sum(len(s.completion_ids) for s in batch), 0, d)
    return wrapped, metrics, hf_model.hf_state_dict(policy.model, policy.adapter)


def test_full_activation_checkpointing_wraps_every_block_and_changes_no_number(tiny_model_dir):
    n_none, plain, plain_w = _step(tiny_model_dir, "none")
    n_full, ckpt, ckpt_w = _step(tiny_model_dir, "full")
    assert not any(n_none)
    assert n_full and all(n_full)  # every block recomputed in backward
    assert plain["grad_norm"] > 0
    for key in ("loss", "grad_norm", "entropy"):
        assert abs(ckpt[key] - plain[key]) <= 1e-6, key
    for name, value in plain_w.items():  # HF names: the wrappers change no exported name
        torch.testing.assert_close(ckpt_w[name], value, atol=1e-6, rtol=1e-5)
