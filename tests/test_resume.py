"""Checkpoint and resume (torchtitan_grpo.train.checkpoint): a run stopped after
step k and restarted continues from k with the same prompts, sampling seeds
and weights as a run that was never stopped; the HF export loads in
transformers.

What differs between the two runs: nothing in the data or the sampled
tokens. The weights agree to float rounding (~1e-7), not bit for bit: the
built-in server batches whichever requests are in flight together, so the
rollout logprobs (which enter the IS weights and the ratio) can differ in
their last bits between *any* two runs, interrupted or not.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tests.conftest import ROOT
from torchtitan_grpo.config.checks import ConfigError

DEMO = os.path.join(ROOT, "train_configs", "demo_cpu.toml")


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")


def _metrics(dump: str) -> list[dict]:
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture()
def own_process_group():
    """The Checkpointer starts a one-rank gloo group when none exists; tear it
    down so later tests in this process start clean."""
    had = dist.is_initialized()
    yield
    if not had and dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------ config


def test_checkpoint_section_has_our_keys_and_checks(tmp_path):
    from torchtitan_grpo.config.checks import ConfigError
    from torchtitan_grpo.config.parse import parse_config

    toml = tmp_path / "c.toml"
    toml.write_text(open(DEMO).read() + '\n[checkpoint]\nenable = true\ninterval = 5\nhf_export = true\n')
    cfg = parse_config(["--job.config_file", str(toml)])
    assert (cfg.checkpoint.enable, cfg.checkpoint.interval, cfg.checkpoint.hf_export) == (True, 5, True)
    assert cfg.checkpoint.hf_export_folder == "hf" and cfg.checkpoint.folder == "checkpoint"
    with pytest.raises(ConfigError, match=r"checkpoint\.keep_latest_k"):
        parse_config(["--job.config_file", str(toml), "--checkpoint.keep_latest_k", "1"])
    with pytest.raises(ConfigError, match=r"checkpoint\.interval"):
        parse_config(["--job.config_file", str(toml), "--checkpoint.interval", "0"])


# ------------------------------------------------------------ prompt sources


def test_digits_prompts_resume_exactly():
    from torchtitan_grpo.rollout.tasks import DigitsPrompts, digits_task_rows

    rows = digits_task_rows(5)
    src = DigitsPrompts(3, seed=5)
    first = [src.next_batch() for _ in range(4)]
    assert [r for b in first for r in b] == [next(rows) for _ in range(12)]  # the rows of digits_task_rows
    state = src.state_dict()
    assert state == {"rows_drawn": 12, "seed": 5}
    after = [src.next_batch() for _ in range(3)]

    resumed = DigitsPrompts(3, seed=5)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # what the checkpoint stores
    assert [resumed.next_batch() for _ in range(3)] == after
    with pytest.raises(ValueError, match="seed"):
        DigitsPrompts(3, seed=6).load_state_dict(state)


def test_metrics_of_a_resumed_run_continue_the_file(tmp_path):
    from torchtitan_grpo.metrics import MetricLogger

    path = tmp_path / "metrics.jsonl"
    # a run stopped during step 6, last checkpoint at 3: rows 4-5 and half of 6
    path.write_text("".join(json.dumps({"step": i}) + "\n" for i in range(1, 6)) + '{"step": 6, "lo')
    log = MetricLogger(str(tmp_path), enable_tensorboard=False, resume_step=3)
    log.log(4, {"loss": 0.5})
    log.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]


# ----------------------------------------------------- in-process round trip


def _batch():
    from torchtitan_grpo.train.trainer import Sample

    return [Sample([19, 31], [20, 21, 1], [-4.0, -4.2, -4.5], 1.0, 1.0, "stop", ["0"]),
            Sample([20, 31], [22, 1], [-4.1, -4.4], -1.0, 0.0, "stop", ["0"])]


def _adam_state(policy) -> dict:
    """AdamW's tensors (step, exp_avg, exp_avg_sq) by parameter name."""
    state = policy.optimizers.optimizers[0].state
    return {name: {k: t.clone() for k, t in state[p].items() if torch.is_tensor(t)}
            for name, p in policy.model.named_parameters() if p in state}


def test_checkpointer_restores_every_state(tmp_path, tiny_model_dir, own_process_group):
    """Model, AdamW moments, LR schedule, step, weight version, prompt position
    and RNG come back exactly; a later model-only (last-step) checkpoint is
    refused with a message instead of a DCP key error."""
    import random

    from torchtitan_grpo.train.checkpoint import Checkpointer
    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.rollout.tasks import DigitsPrompts
    from torchtitan_grpo.train.trainer import build_policy, init_distributed, train_step

    args = ["--job.config_file", DEMO, "--model.hf_assets_path", tiny_model_dir, "--job.dump_folder",
            str(tmp_path), "--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "3"]
    cfg = parse_config(args)
    d = init_distributed()
    policy = build_policy(cfg, tiny_model_dir, d)
    ckpt = Checkpointer(cfg, policy, d)
    assert ckpt.load() is None  # nothing saved yet: a fresh start
    prompts = DigitsPrompts(4, seed=0)
    for step in (1, 2):
        prompts.next_batch()
        train_step(policy, _batch(), cfg.grpo, 1.0, 8, 2, 5, 0, d)
        ckpt.save(step, weight_version=step, prompts=prompts)
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-2"]  # interval 2
    saved = {k: v.clone() for k, v in policy.model.state_dict().items()}
    moments = _adam_state(policy)
    assert moments and all("exp_avg" in s for s in moments.values())
    lr = policy.lr_schedulers.schedulers[0].get_last_lr()
    expected_batch = prompts.next_batch()
    expected_rand = (torch.rand(3), random.random())

    train_step(policy, _batch(), cfg.grpo, 1.0, 8, 2, 5, 0, d)  # step 3 moves everything on
    ckpt.save(3, weight_version=3, prompts=prompts, last_step=True)  # model-only export
    ckpt.close()

    # a fresh process would build everything anew and load step 2
    torch.manual_seed(123)
    fresh = build_policy(parse_config(args + ["--checkpoint.load_step", "2"]), tiny_model_dir, d)
    ckpt2 = Checkpointer(parse_config(args + ["--checkpoint.load_step", "2"]), fresh, d)
    resumed = ckpt2.load()
    got_rand = (torch.rand(3), random.random())
    assert torch.equal(got_rand[0], expected_rand[0]) and got_rand[1] == expected_rand[1]
    assert (resumed.step, resumed.weight_version) == (2, 2)
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    restored = _adam_state(fresh)
    assert restored.keys() == moments.keys()
    for name, state in moments.items():
        for key, t in state.items():
            assert torch.equal(restored[name][key], t), (name, key)
    assert fresh.lr_schedulers.schedulers[0].get_last_lr() == lr
    src = DigitsPrompts(4, seed=0)
    src.load_state_dict(resumed.prompts)
    assert src.next_batch() == expected_batch
    ckpt2.close()

    # The newest checkpoint (step 3, the last) holds only the model: rerunning the finished run, or
    # extending it (--training.steps 6), is one line (exit 2 in grpo_train.py) saying what to do.
    step3 = os.path.join(tmp_path, "checkpoint", "step-3")
    for steps in ("3", "6"):
        longer = parse_config(args + ["--training.steps", steps])
        ckpt3 = Checkpointer(longer, build_policy(longer, tiny_model_dir, d), d)
        with pytest.raises(ConfigError) as e:
            ckpt3.load()
        ckpt3.close()
        assert str(e.value) == (
            f"checkpoint {step3} holds only the model (the last step is saved model-only: "
            "checkpoint.last_save_model_only = true): the run finished there and cannot resume from it. To train "
            "on: checkpoint.load_step 2 resumes from the newest full checkpoint and trains the steps after it again; "
            f"or a new job.dump_folder with checkpoint.initial_load_path {step3} starts from its weights (fresh "
            "optimizer, step 0); and set checkpoint.last_save_model_only = false in a run you mean to extend")

    # what it says works: from step 2 the run trains step 3 again, and its full save replaces the model-only one
    again = parse_config(args + ["--training.steps", "6", "--checkpoint.load_step", "2"])
    ckpt4 = Checkpointer(again, build_policy(again, tiny_model_dir, d), d)
    assert ckpt4.load().step == 2
    assert ckpt4.save(3, weight_version=3, force=True)
    ckpt4.close()
    ckpt5 = Checkpointer(parse_config(args + ["--training.steps", "6"]), build_policy(cfg, tiny_model_dir, d), d)
    assert ckpt5.load().step == 3
    ckpt5.close()


# ------------------------------------------------------------ real processes


def _torchrun(dump: str, model_dir: str, steps: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(ROOT, "grpo_train.py"), "--job.config_file", DEMO, "--job.dump_folder", dump,
           "--model.hf_assets_path", model_dir, "--training.steps", str(steps),
           "--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0",
           "--checkpoint.hf_export", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=300)


@pytest.mark.slow
def test_stopped_run_resumes_like_an_uninterrupted_one(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    steps, k = 8, 3
    whole, stopped = str(tmp_path / "whole"), str(tmp_path / "stopped")

    # 1. An uninterrupted run of 8 steps (checkpoints at 3 and 6, model-only at 8).
    r = _torchrun(whole, tiny_model_dir, steps)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ref = _metrics(whole)
    assert [m["step"] for m in ref] == list(range(1, steps + 1))

    # 2. What a run killed during step 6 leaves behind: the step-3 checkpoint,
    #    a step-6 folder without DCP's .metadata (never finished), and metrics
    #    up to step 5. (Identical bytes to a real stop: checkpoints of one
    #    config are deterministic up to the float noise described above.)
    os.makedirs(os.path.join(stopped, "checkpoint", "step-6"))
    shutil.copytree(os.path.join(whole, "checkpoint", f"step-{k}"), os.path.join(stopped, "checkpoint", f"step-{k}"))
    shutil.copy(os.path.join(whole, "checkpoint", f"step-{k}", "__0_0.distcp"),
                os.path.join(stopped, "checkpoint", "step-6"))
    with open(os.path.join(stopped, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in ref[:5])

    # 3. The same command again: it resumes from step 3.
    r = _torchrun(stopped, tiny_model_dir, steps)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"resumed from {stopped}/checkpoint at step {k} (weight version {k})" in r.stdout
    assert "step    1 |" not in r.stdout and f"step    {k + 1} |" in r.stdout
    got = _metrics(stopped)
    assert [m["step"] for m in got] == list(range(1, steps + 1))  # rows 4-5 of the stopped run replaced
    for a, b in zip(ref[k:], got[k:]):
        # same prompts and sampling seeds, same weights on the servers -> the same completions
        for key in ("reward/mean", "reward/std", "rollout/tokens", "rollout/truncated_frac"):
            assert a[key] == b[key], (a["step"], key)
        assert b["weight_version"] == a["weight_version"] == a["step"]
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["lr"] == a["lr"]
    # The servers got the restored weights before generating: on-policy (sync
    # push, fp32) and no sample from the on-disk weights (version -1 would be stale).
    first = got[k]
    assert first["trainer_vs_rollout_logprob_max_abs_diff"] <= 1e-4
    assert first["offpolicy/staleness_max"] == 0.0 and first["offpolicy/stale_dropped"] == 0.0

    # 4. The final weights agree, and the HF export loads in transformers.
    w_ref = load_file(os.path.join(whole, "hf", "model.safetensors"))
    w_got = load_file(os.path.join(stopped, "hf", "model.safetensors"))
    w_init = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert w_ref.keys() == w_got.keys()
    assert max((w_ref[n] - w_got[n]).abs().max().item() for n in w_ref) < 1e-5
    assert max((w_ref[n] - w_init[n]).abs().max().item() for n in w_ref) > 1e-3  # it did train
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(stopped, "hf"), dtype=torch.float32)
    for name, t in hf.state_dict().items():
        if name in w_got:
            assert torch.equal(t, w_got[name]), name
    ids = torch.tensor([[19, 31]])
    with torch.no_grad():
        assert torch.isfinite(hf(ids).logits).all()


# -------------------------------------------------------------- HF export


def test_hf_export_loads_in_transformers(tmp_path, tiny_model_dir):
    """Sharded or not, in the export dtype: transformers loads the export and
    computes the TorchTitan policy's logits."""
    from transformers import AutoModelForCausalLM

    from torchtitan_grpo.train.checkpoint import export_hf
    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.train.trainer import build_policy, init_distributed, train_step

    cfg = parse_config(["--job.config_file", DEMO, "--model.hf_assets_path", tiny_model_dir])
    d = init_distributed()
    policy = build_policy(cfg, tiny_model_dir, d)
    train_step(policy, _batch(), cfg.grpo, 1.0, 8, 2, 5, 0, d)  # differ from the files on disk
    ids = torch.tensor([[19, 31, 20, 21, 1]])
    with torch.no_grad():
        expected = policy.model(ids)

    out = export_hf(policy, tiny_model_dir, str(tmp_path / "one"), d)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors",
                                       "tokenizer.json", "tokenizer_config.json"]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, expected, atol=1e-5, rtol=1e-5)

    out = export_hf(policy, tiny_model_dir, str(tmp_path / "shards"), d, dtype="bfloat16", max_shard_bytes=100_000)
    files = os.listdir(out)
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["dtype"] == "bfloat16"
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits.float(), expected, atol=0.1, rtol=0.05)
