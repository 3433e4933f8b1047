"""Off-policy handling (torchtitan_grpo.train.importance) and its wiring in
the GRPO step: the staleness bound, truncation masking, importance-sampling
correction against the rollout logprobs, the frozen KL reference, and the
chat template of dataset prompts."""

import math

import time

import pytest
import torch

from torchtitan_grpo.train import importance as offpolicy
from torchtitan_grpo.train.trainer import Sample

from tests.conftest import ROOT

DEMO = f"{ROOT}/train_configs/demo_cpu.toml"


def _sample(versions, finish="stop", n=2):
    return Sample([19, 31], list(range(20, 20 + n)), [-4.0] * n, 1.0, 1.0, finish, list(versions))


# ---------------------------------------------------------------- staleness


def test_parse_version():
    assert offpolicy.parse_version("7") == 7
    assert offpolicy.parse_version(3) == 3
    assert offpolicy.parse_version("default") is None
    assert offpolicy.oldest_version(["5", "3", "default"]) == 3
    assert offpolicy.oldest_version(["default"]) is None
    assert offpolicy.oldest_version([]) is None


def test_staleness_bound_drops_and_counts_by_oldest_version():
    # trainer at version 10, max_staleness 2: oldest version >= 8 is kept
    samples = [_sample(["10"]), _sample(["8"]), _sample(["7"]), _sample(["7", "9"]), _sample(["9", "10"]),
               _sample(["default"])]
    kept, m = offpolicy.select_samples(samples, current_version=10, max_staleness=2)
    assert kept == [samples[0], samples[1], samples[4], samples[5]]
    assert m["offpolicy/stale_dropped"] == 2.0
    assert m["offpolicy/unknown_version"] == 1.0  # kept as if current
    assert m["offpolicy/kept_samples"] == 4.0
    # staleness of every generated sample: 0, 2, 3, 3, 1, 0
    assert m["offpolicy/staleness_mean"] == pytest.approx(9 / 6)
    assert m["offpolicy/staleness_max"] == 3.0


def test_staleness_off_keeps_everything():
    samples = [_sample(["0"]), _sample(["100"])]
    kept, m = offpolicy.select_samples(samples, current_version=100, max_staleness=-1)
    assert kept == samples and m["offpolicy/stale_dropped"] == 0.0
    assert m["offpolicy/staleness_max"] == 100.0
    # max_staleness 0: only samples of the current version
    kept, m = offpolicy.select_samples(samples, current_version=100, max_staleness=0)
    assert kept == [samples[1]] and m["offpolicy/stale_dropped"] == 1.0


def test_mask_truncated_drops_length_finished_completions():
    samples = [_sample(["1"], "stop"), _sample(["1"], "length"), _sample(["1"], "abort")]
    kept, m = offpolicy.select_samples(samples, 1, 4, mask_truncated=False)
    assert kept == samples and m["offpolicy/truncated_dropped"] == 0.0
    kept, m = offpolicy.select_samples(samples, 1, 4, mask_truncated=True)
    assert kept == [samples[0], samples[2]] and m["offpolicy/truncated_dropped"] == 1.0
    # a stale truncated sample counts as stale (one reason per sample)
    kept, m = offpolicy.select_samples([_sample(["0"], "length")], 9, 4, mask_truncated=True)
    assert kept == [] and m["offpolicy/stale_dropped"] == 1.0 and m["offpolicy/truncated_dropped"] == 0.0


@pytest.mark.parametrize("arg,value,key", [
    ("--grpo.max_staleness", "-2", "grpo.max_staleness"),
    ("--grpo.is_cap", "0", "grpo.is_cap"),
])
def test_bad_offpolicy_values_name_the_key(arg, value, key):
    from torchtitan_grpo.config.checks import ConfigError
    from torchtitan_grpo.config.parse import parse_config

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config(["--job.config_file", DEMO, arg, value])


# -------------------------------------------------------------------- IS


def test_importance_weights_modes():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]], requires_grad=True)
    rollout = torch.tensor([[-1.5, -1.0, -3.0], [-2.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    old, w, m = offpolicy.importance_weights(lp, rollout, mask, "none", 2.0)
    assert old is rollout and w is None and m == {}

    old, w, m = offpolicy.importance_weights(lp, rollout, mask, "token", 2.0)
    assert not old.requires_grad and torch.equal(old, lp.detach())
    expected = torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0], [2.0, 1.0, 1.0]])  # exp(1) capped at 2
    torch.testing.assert_close(w, expected)
    assert m["is_capped_fraction"].item() == pytest.approx(0.25)

    old, w, m = offpolicy.importance_weights(lp, rollout, mask, "sequence", 10.0)
    # row 0: exp(0.5 - 1) ; row 1: exp(1 + 0); padding stays 1
    torch.testing.assert_close(w, torch.tensor([[math.exp(-0.5)] * 2 + [1.0], [math.e] * 2 + [1.0]]))
    with pytest.raises(ValueError, match="is_correction"):
        offpolicy.importance_weights(lp, rollout, mask, "bogus", 2.0)


# ------------------------------------------------- the GRPO step's wiring


@pytest.fixture()
def policy_for(tiny_model_dir):
    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.train.trainer import build_policy, init_distributed

    def make(*overrides):
        cfg = parse_config(["--job.config_file", DEMO, "--model.hf_assets_path", tiny_model_dir, *overrides])
        d = init_distributed()
        torch.manual_seed(0)
        return cfg, build_policy(cfg, tiny_model_dir, d), d

    return make


def _batch():
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(4):
        n = 2 + i
        ids = torch.randint(2, 97, (3 + n,), generator=g).tolist()
        old = (-math.log(128) + 0.5 * torch.randn(n, generator=g)).tolist()
        out.append(Sample(ids[:3], ids[3:], old, (-1.0) ** i, 0.0, "stop", ["0"]))
    return out


def _recording_loss(monkeypatch):
    from torchtitan_grpo.train import loss as grpo_losses

    calls = []
    real = grpo_losses.grpo_loss

    def record(logprobs, old, adv, mask, **kw):
        calls.append({"logprobs": logprobs.detach().clone(), "old": old.detach().clone(), "mask": mask.clone(), **kw})
        return real(logprobs, old, adv, mask, **kw)

    monkeypatch.setattr(grpo_losses, "grpo_loss", record)
    return calls


@pytest.mark.parametrize("mode", ["none", "token", "sequence"])
def test_train_step_applies_is_correction(policy_for, monkeypatch, mode):
    from torchtitan_grpo.train.trainer import _pack, train_step

    cfg, policy, d = policy_for("--grpo.is_correction", mode, "--grpo.is_cap", "1.5", "--grpo.micro_batch_size", "2")
    calls = _recording_loss(monkeypatch)
    batch = _batch()
    metrics = train_step(policy, batch, cfg.grpo, 1.0, 8, len(batch), sum(len(s.completion_ids) for s in batch), 0, d)
    assert len(calls) == 2  # two micro-batches
    weights, counted = [], []
    for k, c in enumerate(calls):
        _, mask, rollout, _ = _pack(batch[2 * k: 2 * k + 2], 0, d.device)
        if mode == "none":
            assert c["is_weights"] is None
            torch.testing.assert_close(c["old"], rollout)  # the ratio is against the rollout policy
            continue
        # the ratio is centred on the trainer's own logprobs before the step ...
        torch.testing.assert_close(c["old"], c["logprobs"])
        # ... and the weights are pi_train_old / pi_rollout, truncated at is_cap
        log_w = (c["logprobs"] - rollout) * mask
        if mode == "sequence":
            log_w = log_w.sum(-1, keepdim=True).expand_as(mask)
        expected = torch.where(mask > 0, log_w.exp().clamp(max=1.5), torch.ones_like(mask))
        torch.testing.assert_close(c["is_weights"], expected)
        if mode == "token":  # the metric averages over tokens ...
            weights.append((expected * mask).sum())
            counted.append(mask.sum())
        else:  # ... or over completions
            weights.append(((expected * mask).sum(-1) / mask.sum(-1)).sum())
            counted.append(torch.tensor(float(mask.shape[0])))
    if mode == "none":
        assert "offpolicy/is_weight_mean" not in metrics
    else:
        assert metrics["offpolicy/is_weight_mean"] == pytest.approx(float(sum(weights) / sum(counted)), rel=1e-5)
        assert 1.0 < metrics["offpolicy/is_weight_max"]  # rollout logprobs here are far from the model's
        assert 0.0 < metrics["offpolicy/is_capped_frac"] <= 1.0


def test_kl_reference_is_frozen_initial_policy(policy_for, monkeypatch):
    from torchtitan_grpo.models import hf_bridge as hf_model
    from torchtitan_grpo.train.trainer import train_step

    cfg, policy, d = policy_for("--grpo.kl_coef", "0.5", "--grpo.kl_estimator", "k3")
    ref = policy.reference
    assert ref is not None and not ref.training
    assert all(not p.requires_grad for p in ref.parameters())
    initial = {k: v.clone() for k, v in hf_model.hf_state_dict(policy.model, policy.adapter).items()}
    for k, v in hf_model.hf_state_dict(ref, policy.adapter).items():
        assert torch.equal(v, initial[k]), k

    calls = _recording_loss(monkeypatch)
    batch = _batch()
    ntok = sum(len(s.completion_ids) for s in batch)
    m1 = train_step(policy, batch, cfg.grpo, 1.0, 8, len(batch), ntok, 0, d)
    assert calls[0]["kl_coef"] == 0.5 and calls[0]["kl_estimator"] == "k3"
    torch.testing.assert_close(calls[0]["ref_logprobs"], calls[0]["logprobs"])  # policy == reference at first
    assert m1["kl"] == pytest.approx(0.0, abs=1e-7)
    m2 = train_step(policy, batch, cfg.grpo, 1.0, 8, len(batch), ntok, 0, d)
    assert m2["kl"] > 0.0  # the policy moved, the reference did not
    for k, v in hf_model.hf_state_dict(ref, policy.adapter).items():
        assert torch.equal(v, initial[k]), k
    assert any(not torch.equal(v, initial[k]) for k, v in hf_model.hf_state_dict(policy.model, policy.adapter).items())


def test_the_training_forward_runs_in_the_policys_autocast(policy_for):
    """One GPU or DDP: ``Policy.amp`` is autocast to training.mixed_precision_param
    (parallel.mixed_precision); the forward must run inside it. CPU autocast
    stands in for CUDA's here."""
    from torchtitan_grpo.train.trainer import train_step

    cfg, policy, d = policy_for()
    seen = []
    # A projection inside the model: with grpo.logprob_chunk_tokens the output
    # layer returns float32 log-probs whatever the autocast.
    policy.model.layers["0"].feed_forward.w2.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    batch = _batch()
    ntok = sum(len(s.completion_ids) for s in batch)
    train_step(policy, batch, cfg.grpo, 1.0, 8, len(batch), ntok, 0, d)
    assert set(seen) == {torch.float32}  # CPU: no autocast
    policy.amp = torch.autocast("cpu", dtype=torch.bfloat16)
    seen.clear()
    m = train_step(policy, batch, cfg.grpo, 1.0, 8, len(batch), ntok, 0, d)
    assert set(seen) == {torch.bfloat16} and math.isfinite(m["loss"])
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())  # master weights stay fp32


def test_train_step_reports_its_threads_cpu_and_the_rest_of_the_process(policy_for):
    """cpu/train_thread_s: the training thread's CPU over the step (never more
    than its wall time); cpu/other_threads_s: what the process's other
    threads used meanwhile (here a thread that spins until the step ends)."""
    import threading

    from torchtitan_grpo.train.trainer import train_step

    cfg, policy, d = policy_for()
    batch = _batch()
    ntok = sum(len(s.completion_ids) for s in batch)
    quiet = train_step(policy, batch, cfg.grpo, 1.0, 8, len(batch), ntok, 0, d)
    assert 0 < quiet["cpu/train_thread_s"] <= quiet["time/train_s"] + 0.01
    done, spun = threading.Event(), []

    def spin():
        t0 = time.thread_time()
        while not done.is_set():
            sum(range(1000))
        spun.append(time.thread_time() - t0)  # it did run

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        busy = train_step(policy, batch, cfg.grpo, 1.0, 8, len(batch), ntok, 0, d)
    finally:
        done.set()
        spinner.join()
    assert busy["cpu/other_threads_s"] > 0 and spun[0] > 0
    assert 0 < busy["cpu/train_thread_s"] <= busy["time/train_s"] + 0.01


def test_no_reference_without_kl(policy_for):
    _, policy, _ = policy_for()
    assert policy.reference is None


# ----------------------------------------------------------- chat template


def test_dataset_prompts_use_the_chat_template(tiny_model_dir):
    from transformers import AutoTokenizer

    from torchtitan_grpo.rollout.groups import GroupScorer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    def manager(use):
        return GroupScorer(tok, None, group_size=2, use_chat_template=use)

    assert not getattr(tok, "chat_template", None)
    assert manager(True).encode_prompt("3>") == tok.encode("3>", add_special_tokens=False)  # no template: raw
    tok.chat_template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}")
    assert manager(True).encode_prompt("3>") == tok.encode("[user]3>[assistant]", add_special_tokens=False)
    assert manager(False).encode_prompt("3>") == tok.encode("3>", add_special_tokens=False)


def _spanned(spans: list[tuple[str, int, int]], n: int = 6):
    s = _sample([v for v, _, _ in spans], n=n)
    s.version_spans = spans
    return s


def test_token_level_staleness_masks_only_the_stale_tokens():
    """A weight update landed mid-generation: tokens 0-3 under version 5, 4-5
    under version 8. Trainer at 8, bound 2: with token-level IS the 4 old
    tokens leave the loss and the 2 new ones stay; sample-level drops all."""
    s = _spanned([("5", 0, 4), ("8", 4, 6)])
    kept, m = offpolicy.select_samples([s], current_version=8, max_staleness=2, token_level=True)
    assert kept == [s] and s.loss_mask == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0] and s.num_loss_tokens == 2.0
    assert m["offpolicy/stale_tokens_masked"] == 4.0 and m["offpolicy/stale_dropped"] == 0.0
    assert m["offpolicy/staleness_0_frac"] == pytest.approx(2 / 6)
    assert m["offpolicy/staleness_3_frac"] == pytest.approx(4 / 6)  # 3 versions old
    s2 = _spanned([("5", 0, 4), ("8", 4, 6)])
    kept, m = offpolicy.select_samples([s2], current_version=8, max_staleness=2, token_level=False)
    assert kept == [] and m["offpolicy/stale_dropped"] == 1.0 and s2.loss_mask is None
    # every token too old: dropped even token-level; an existing mask (tool tokens) is kept where fresh
    s3 = _spanned([("1", 0, 3), ("2", 3, 6)])
    kept, _ = offpolicy.select_samples([s3], current_version=8, max_staleness=2, token_level=True)
    assert kept == []
    s4 = _spanned([("5", 0, 2), ("7", 2, 6)])
    s4.loss_mask = [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    kept, m = offpolicy.select_samples([s4], current_version=8, max_staleness=2, token_level=True)
    assert s4.loss_mask == [0.0, 0.0, 1.0, 0.0, 0.0, 1.0] and m["offpolicy/stale_tokens_masked"] == 2.0


def test_version_spans_reach_the_sample():
    """The pool's completions carry the engine's per-token spans into the trainer's samples."""
    from torchtitan_grpo.fleet import sglang

    body = {"output_ids": [4, 5, 6], "meta_info": {
        "output_token_logprobs": [[-1.0, 4, None], [-1.0, 5, None], [-1.0, 6, None]],
        "finish_reason": {"type": "length"}, "weight_version": "3",
        "weight_versions": [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 3}]}}
    (c,) = sglang.parse_generate(body, 1, "r")
    assert c.version_spans == [("2", 0, 1), ("3", 1, 3)] and c.weight_versions == ["2", "3"]
    (c,) = sglang.parse_generate({**body, "meta_info": {k: v for k, v in body["meta_info"].items()
                                                        if k != "weight_versions"}}, 1, "r")
    assert c.version_spans == [("3", 0, 3)] and c.weight_versions == ["3"]
