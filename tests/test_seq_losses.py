"""GSPO and CISPO (grpo.loss_agg = "gspo" / "cispo") against their formulas
written out here element by element: values and gradients on small batches
with masks, padding and empty rows; the KL term, the IS weights, micro-batches
with the step's normalisers, the trainer's loss path and its clip fraction;
and the start-up refusal of bad values naming the key."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

from torchtitan_grpo.train.loss import LOSS_VARIANTS, cispo_loss, grpo_loss, gspo_loss

LN = math.log


# --------------------------------------------------------------------------
# the formulas, in Python floats
# --------------------------------------------------------------------------


def _kl(lp: float, ref: float, estimator: str) -> tuple[float, float]:
    """(kl_t, d kl_t / d lp) for one token."""
    d = ref - lp
    if estimator == "k1":
        return -d, 1.0
    return math.exp(d) - d - 1.0, 1.0 - math.exp(d)


def gspo_reference(lp, old, adv, mask, lo, hi, n_seq=None, w=None, ref=None, kl_coef=0.0, est="k3"):
    """(loss, d loss / d lp as nested lists, per-row clipped flags) of GSPO.

    s_i = exp(mean_t(lp - old)); loss_i = max(-A s_i, -A clip(s_i)) * W_i
    + kl_coef * mean_t kl_t; loss = sum_i loss_i / n_seq. The gradient of the
    unclipped branch is -A_i W_i s_i / |y_i| on each of the row's tokens."""
    B, T = len(lp), len(lp[0])
    rows = [[t for t in range(T) if mask[i][t]] for i in range(B)]
    if n_seq is None:
        n_seq = sum(1 for r in rows if r)
    loss, grad, flags = 0.0, [[0.0] * T for _ in range(B)], []
    for i, toks in enumerate(rows):
        if not toks:
            flags.append(None)
            continue
        n = len(toks)
        s = math.exp(sum(lp[i][t] - old[i][t] for t in toks) / n)
        a = adv[i]
        unclipped, clipped = -a * s, -a * min(max(s, 1 - lo), 1 + hi)
        if w is None:
            W = 1.0
        elif isinstance(w[i], list):  # token weights: geometric mean over the loss tokens
            W = math.exp(sum(math.log(w[i][t]) for t in toks) / n)
        else:
            W = w[i]
        term = max(unclipped, clipped) * W
        flags.append(clipped > unclipped)
        takes_gradient = unclipped >= clipped  # inside the range both branches are the same function
        for t in toks:
            if takes_gradient:
                grad[i][t] += -a * s * W / n / n_seq
        if ref is not None and kl_coef:
            kls = [_kl(lp[i][t], ref[i][t], est) for t in toks]
            term += kl_coef * sum(k for k, _ in kls) / n
            for t, (_, dk) in zip(toks, kls):
                grad[i][t] += kl_coef * dk / n / n_seq
        loss += term / n_seq
    return loss, grad, flags


def cispo_reference(lp, old, adv, mask, lo, hi, n_tok=None, w=None, ref=None, kl_coef=0.0, est="k3"):
    """(loss, d loss / d lp, per-token clipped flags) of CISPO.

    rhat_t = clip(exp(lp - old), 1 - lo, 1 + hi), a constant;
    loss = sum_t (-rhat_t A_i w_t lp_t + kl_coef kl_t) / n_tok, so the gradient
    is (-rhat_t A_i w_t + kl_coef dkl_t) / n_tok on every loss token."""
    B, T = len(lp), len(lp[0])
    if n_tok is None:
        n_tok = sum(1 for i in range(B) for t in range(T) if mask[i][t])
    loss, grad, flags = 0.0, [[0.0] * T for _ in range(B)], {}
    for i in range(B):
        for t in range(T):
            if not mask[i][t]:
                continue
            r = math.exp(lp[i][t] - old[i][t])
            rhat = min(max(r, 1 - lo), 1 + hi)
            flags[i, t] = rhat != r
            wt = 1.0 if w is None else (w[i][t] if isinstance(w[i], list) else w[i])
            loss += -rhat * adv[i] * wt * lp[i][t] / n_tok
            grad[i][t] += -rhat * adv[i] * wt / n_tok
            if ref is not None and kl_coef:
                k, dk = _kl(lp[i][t], ref[i][t], est)
                loss += kl_coef * k / n_tok
                grad[i][t] += kl_coef * dk / n_tok
    return loss, grad, flags


# --------------------------------------------------------------------------
# hand-checked batches
# --------------------------------------------------------------------------


def test_gspo_hand_checked():
    # clip 0.1 / 0.1: clip(s) in [0.9, 1.1].
    #   row 0, A=+1, token ratios 1.5, 0.5: s = sqrt(0.75) = 0.866: max(-0.866, -0.9) = -0.866 (unclipped)
    #   row 1, A=-1, same ratios + padding:  max(0.866, 0.9)  =  0.9   (clipped, low side: no gradient)
    #   row 2, A=+1, one token, ratio 1.21:  max(-1.21, -1.1) = -1.1   (clipped, high side: no gradient)
    old = torch.tensor([[0.3, -1.0, 0.0], [0.3, -1.0, 5.0], [-0.2, 0.0, 0.0]], dtype=torch.float64)
    log_ratio = torch.tensor([[LN(1.5), LN(0.5), 0.0], [LN(1.5), LN(0.5), 0.0], [LN(1.21), 0.0, 0.0]],
                             dtype=torch.float64)
    lp = old + log_ratio
    lp[1, 2] = lp[2, 1] = lp[2, 2] = float("-inf")  # padding may hold anything
    lp.requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0]])
    mask[0, 2] = 0
    loss, m = gspo_loss(lp, old, adv, mask, clip_low=0.1, clip_high=0.1)
    s = math.sqrt(0.75)
    assert loss.item() == pytest.approx((-s + 0.9 - 1.1) / 3, rel=1e-12)
    assert m["pg_loss"].item() == pytest.approx(loss.item(), rel=1e-12)
    assert m["clip_fraction"].item() == pytest.approx(2 / 3)
    assert m["clip_low_fraction"].item() == pytest.approx(1 / 3)
    assert m["clip_high_fraction"].item() == pytest.approx(1 / 3)
    assert m["ratio_mean"].item() == pytest.approx((2 * s + 1.21) / 3)
    assert m["ratio_max"].item() == pytest.approx(1.21)
    assert m["clip_units"].item() == 3
    loss.backward()
    # row 0: d/d lp_t = -A s / (|y| N) on both tokens; rows 1 and 2 clipped
    expected = torch.tensor([[-s / 2 / 3, -s / 2 / 3, 0.0], [0.0] * 3, [0.0] * 3], dtype=torch.float64)
    torch.testing.assert_close(lp.grad, expected)


def test_cispo_hand_checked_keeps_the_gradient_of_clipped_tokens():
    # Row 0 (A=+1): ratios 1.5 and 0.5; row 1 (A=-2): ratio 1.1; clip 0.2 / 0.2:
    # rhat = 1.2 (clipped high), 0.8 (clipped low), 1.1.
    old = torch.tensor([[0.3, -1.0, 5.0], [-0.2, 0.0, 0.0]])
    lp = old + torch.tensor([[LN(1.5), LN(0.5), 0.0], [LN(1.1), 0.0, 0.0]])
    lp[1, 2] = float("-inf")
    lp.requires_grad_(True)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, m = cispo_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    x = lp.detach()
    expected = -(1.2 * 1 * x[0, 0] + 0.8 * 1 * x[0, 1] + 1.1 * -2 * x[1, 0]) / 3
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert m["clip_fraction"].item() == pytest.approx(2 / 3)
    assert m["clip_low_fraction"].item() == pytest.approx(1 / 3)
    assert m["clip_high_fraction"].item() == pytest.approx(1 / 3)
    assert m["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.1) / 3)
    assert m["clip_units"].item() == 3
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.2 / 3, -0.8 / 3, 0.0], [2.2 / 3, 0.0, 0.0]]))
    # the PPO clip on the same batch drops the clipped high token's gradient
    lp2 = lp.detach().clone().requires_grad_(True)
    grpo_loss(lp2, old, adv, mask, loss_agg="token_mean")[0].backward()
    assert lp2.grad[0, 0] == 0 and lp.grad[0, 0] != 0
    # default clip_low = 1.0: no lower bound, the low token keeps its ratio 0.5 as its weight
    lp3 = lp.detach().clone().requires_grad_(True)
    loss3, m3 = cispo_loss(lp3, old, adv, mask, clip_high=0.2)
    loss3.backward()
    assert lp3.grad[0, 1].item() == pytest.approx(-0.5 / 3)
    assert m3["clip_low_fraction"].item() == 0.0


def test_on_policy_both_reduce_to_the_policy_gradient():
    # ratio 1 everywhere: GSPO's gradient is -A / (|y| N) per token (GRPO's),
    # CISPO's -A / n_tokens (DAPO's token mean).
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    adv = torch.tensor([0.5, -1.5])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    for fn, agg in ((gspo_loss, "seq_mean_token_mean"), (cispo_loss, "token_mean")):
        (g,) = torch.autograd.grad(fn(lp, lp.detach(), adv, mask)[0], lp)
        (g_ref,) = torch.autograd.grad(grpo_loss(lp, lp.detach(), adv, mask, loss_agg=agg)[0], lp)
        torch.testing.assert_close(g, g_ref)


# --------------------------------------------------------------------------
# random batches against the written-out formulas
# --------------------------------------------------------------------------


def _random_batch(seed: int, spread: float):
    """float64 [6, 7] batch: ragged lengths, one empty row, -inf / NaN padding."""
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 7
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # per-row offsets spread the sequence ratios over both sides of the clip range
    lp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * spread \
        + torch.linspace(-2 * spread, 2 * spread, B, dtype=torch.float64)[:, None]
    ref = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.tensor([7, 3, 0, 5, 1, 4])
    mask = (torch.arange(T)[None] < lengths[:, None]).to(torch.float64)
    mask[3, 1] = 0.0  # a loss_mask hole inside a completion
    lp = torch.where(mask > 0, lp, float("-inf"))
    old = torch.where(mask > 0, old, float("nan"))
    adv[2] = 7.0  # the empty row's advantage must not matter
    w = torch.exp(torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3)  # token IS weights
    return lp, old, ref, adv, mask, w


def _lists(*xs):
    return [x.tolist() for x in xs]


def _weights(kind: str, w: torch.Tensor) -> tuple[torch.Tensor | None, list | None]:
    """The IS weights a test passes (``kind``: none, token, sequence) and the same as lists for the reference."""
    if kind == "token":
        return w, w.tolist()
    if kind == "sequence":
        return w[:, 0].clone(), w[:, 0].tolist()
    return None, None


@pytest.mark.parametrize("weights", ["none", "token", "sequence"])
@pytest.mark.parametrize("kl", [None, "k1", "k3"])
def test_gspo_matches_the_formula(weights, kl):
    lp, old, ref, adv, mask, w = _random_batch(1, spread=0.02)
    lo, hi = 0.01, 0.015
    is_w, w_ref = _weights(weights, w)
    kw = dict(ref=ref.tolist(), kl_coef=0.05, est=kl) if kl else {}
    exp_loss, exp_grad, flags = gspo_reference(*_lists(lp, old, adv, mask), lo, hi, w=w_ref, **kw)
    clipped = [f for f in flags if f is not None]
    assert any(clipped) and not all(clipped)  # the batch exercises both branches

    x = lp.clone().requires_grad_(True)
    loss, m = gspo_loss(x, old, adv, mask, clip_low=lo, clip_high=hi, is_weights=is_w,
                        ref_logprobs=ref if kl else None, kl_coef=0.05 if kl else 0.0, kl_estimator=kl or "k3")
    assert loss.item() == pytest.approx(exp_loss, rel=1e-12, abs=1e-14)
    loss.backward()
    torch.testing.assert_close(x.grad, torch.tensor(exp_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert m["clip_fraction"].item() == pytest.approx(sum(clipped) / len(clipped))
    assert m["clip_units"].item() == len(clipped)
    assert ("kl" in m) == bool(kl)
    # a [B, T] weight constant along its row is that row's weight
    if weights == "sequence":
        wide = is_w[:, None].expand_as(mask)
        assert gspo_loss(lp, old, adv, mask, clip_low=lo, clip_high=hi, is_weights=wide, ref_logprobs=ref if kl else None,
                         kl_coef=0.05 if kl else 0.0, kl_estimator=kl or "k3")[0].item() == pytest.approx(loss.item())


@pytest.mark.parametrize("weights", ["none", "token", "sequence"])
@pytest.mark.parametrize("kl", [None, "k1", "k3"])
def test_cispo_matches_the_formula(weights, kl):
    lp, old, ref, adv, mask, w = _random_batch(2, spread=0.3)
    lo, hi = 0.2, 0.28
    is_w, w_ref = _weights(weights, w)
    kw = dict(ref=ref.tolist(), kl_coef=0.05, est=kl) if kl else {}
    exp_loss, exp_grad, flags = cispo_reference(*_lists(lp, old, adv, mask), lo, hi, w=w_ref, **kw)
    assert any(flags.values()) and not all(flags.values())

    x = lp.clone().requires_grad_(True)
    loss, m = cispo_loss(x, old, adv, mask, clip_low=lo, clip_high=hi, is_weights=is_w,
                         ref_logprobs=ref if kl else None, kl_coef=0.05 if kl else 0.0, kl_estimator=kl or "k3")
    assert loss.item() == pytest.approx(exp_loss, rel=1e-12, abs=1e-14)
    loss.backward()
    torch.testing.assert_close(x.grad, torch.tensor(exp_grad, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    # every loss token has a gradient, clipped or not (advantages are non-zero here)
    assert (x.grad[mask > 0] != 0).all() and (x.grad[mask == 0] == 0).all()
    assert m["clip_fraction"].item() == pytest.approx(sum(flags.values()) / len(flags))
    assert m["clip_units"].item() == len(flags)


@pytest.mark.parametrize("fn", [gspo_loss, cispo_loss])
def test_padding_and_empty_rows_are_ignored(fn):
    lp, old, ref, adv, mask, _ = _random_batch(3, spread=0.1)
    x = lp.clone().requires_grad_(True)
    loss, m = fn(x, old, adv, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    assert (x.grad[mask == 0] == 0).all() and all(torch.isfinite(v) for v in m.values())
    # the empty row's advantage (even NaN) changes nothing
    adv_nan = adv.clone()
    adv_nan[2] = float("nan")
    assert fn(lp, old, adv_nan, mask)[0].item() == pytest.approx(loss.item(), rel=1e-12)
    # nothing to train on at all: loss 0, gradient 0, finite metrics
    z = torch.zeros(2, 3, requires_grad=True)
    loss0, m0 = fn(z, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3))
    loss0.backward()
    assert loss0.item() == 0.0 and (z.grad == 0).all() and all(torch.isfinite(v) for v in m0.values())


@pytest.mark.parametrize("fn", [gspo_loss, cispo_loss])
def test_bool_mask_and_float32(fn):
    lp, old, ref, adv, mask, _ = (t.float() if t.is_floating_point() else t for t in _random_batch(4, spread=0.1))
    a, _ = fn(lp, old, adv, mask)
    b, _ = fn(lp, old, adv, mask.bool())
    assert a.dtype == torch.float32 and a.item() == b.item()


# --------------------------------------------------------------------------
# micro-batches and the trainer's loss path
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_micro_batches_with_the_steps_normalisers_match_one_batch(name):
    lp, old, ref, adv, mask, w = _random_batch(5, spread=0.02 if name == "gspo" else 0.3)
    fn = gspo_loss if name == "gspo" else cispo_loss
    clip = dict(clip_low=0.01, clip_high=0.015) if name == "gspo" else dict(clip_low=0.2, clip_high=0.28)
    x = lp.clone().requires_grad_(True)
    kw = dict(kl_coef=0.1, **clip)
    full, _ = fn(x, old, adv, mask, ref_logprobs=ref, is_weights=w, **kw)
    (g_full,) = torch.autograd.grad(full, x)
    norm = dict(num_sequences=int((mask.sum(-1) > 0).sum())) if name == "gspo" else dict(num_tokens=int(mask.sum()))
    parts = (slice(0, 2), slice(2, 3), slice(3, 6))
    total = sum(fn(x[r], old[r], adv[r], mask[r], ref_logprobs=ref[r], is_weights=w[r], **norm, **kw)[0]
                for r in parts)
    (g_micro,) = torch.autograd.grad(total, x)
    assert total.item() == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(g_micro, g_full)
    local = sum(fn(x[r], old[r], adv[r], mask[r], ref_logprobs=ref[r], is_weights=w[r], **kw)[0] for r in parts)
    assert abs(local.item() - full.item()) > 1e-6  # the local means do not add up: the test can tell


def _ctx(loss_agg, is_correction, num_samples, num_tokens, kl_coef=0.0):
    from torchtitan_grpo.train.trainer import _LossContext

    g = SimpleNamespace(loss_agg=loss_agg, is_correction=is_correction, is_cap=2.0, clip_low=0.2, clip_high=0.2,
                        gspo_clip_low=0.01, gspo_clip_high=0.015, cispo_clip_low=0.2, cispo_clip_high=0.28,
                        kl_coef=kl_coef, kl_estimator="k3")
    return _LossContext(g, 1.0, 8, num_samples, num_tokens)


@pytest.mark.parametrize("name", ["gspo", "cispo"])
@pytest.mark.parametrize("is_correction", ["none", "token", "sequence"])
def test_trainer_loss_path(name, is_correction):
    """_logprob_loss picks the loss from grpo.loss_agg, passes the step's
    normalisers, and its records add up to the one-batch loss and clip
    fraction (of completions for GSPO, of tokens for CISPO)."""
    from torchtitan_grpo.train.importance import OffPolicyStats
    from torchtitan_grpo.train.trainer import _add_record, _logprob_loss

    lp, rollout, ref, adv, mask, _ = _random_batch(8, spread=0.02 if name == "gspo" else 0.3)
    n_seq, n_tok = int((mask.sum(-1) > 0).sum()), int(mask.sum())
    ctx = _ctx(name, is_correction, n_seq, n_tok, kl_coef=0.1)
    x = lp.clone().requires_grad_(True)
    full, rec_full = _logprob_loss(x, 0.0, mask, rollout, adv, ctx, ref)
    (g_full,) = torch.autograd.grad(full, x)

    # the same loss called directly, with the trainer's choice of "old" and weights
    fn = gspo_loss if name == "gspo" else cispo_loss
    clip = dict(clip_low=0.01, clip_high=0.015) if name == "gspo" else dict(clip_low=0.2, clip_high=0.28)
    if is_correction == "none":  # the ratio against the behaviour policy, no weights
        old, w = rollout, None
    else:  # the ratio centred on the trainer's own log-probs (s = r = 1), truncated IS weights
        from torchtitan_grpo.train.loss import is_weights

        old, w = lp, is_weights(lp, rollout, mask, mode=is_correction, cap=2.0)[0]
    direct, m = fn(lp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1, is_weights=w, **clip)
    assert full.item() == pytest.approx(direct.item(), rel=1e-12)
    assert rec_full["clip_units"] == (n_seq if name == "gspo" else n_tok)
    if is_correction != "none":
        assert m["clip_fraction"].item() == 0.0  # one optimizer step per batch: nothing to clip

    sums = {k: 0.0 for k in ("loss", "clip_fraction", "clip_units", "lp_diff_max", "entropy", "tokens",
                             "lp_diff_sum", "k3_sum")}
    stats = OffPolicyStats(is_correction, True)
    total = 0.0
    for r in (slice(0, 2), slice(2, 3), slice(3, 6)):
        part, record = _logprob_loss(x[r], 0.0, mask[r], rollout[r], adv[r], ctx, ref[r])
        total = total + part
        _add_record(sums, stats, record)
    (g_micro,) = torch.autograd.grad(total, x)
    torch.testing.assert_close(g_micro, g_full)
    assert sums["loss"] == pytest.approx(full.item(), rel=1e-12)
    assert sums["clip_fraction"] / sums["clip_units"] == pytest.approx(float(m["clip_fraction"]))
    if is_correction == "none":
        assert 0 < sums["clip_fraction"] < sums["clip_units"]


def test_gspo_token_is_weights_become_one_per_completion():
    """With grpo.is_correction = "token" the trainer's GSPO gradient is
    -A_i W_i / (|y_i| N) per token, W_i the geometric mean of the row's
    truncated token weights min(pi_train / pi_rollout, cap)."""
    from torchtitan_grpo.train.trainer import _logprob_loss

    lp, rollout, _, adv, mask, _ = _random_batch(7, spread=0.5)
    n_seq = int((mask.sum(-1) > 0).sum())
    x = lp.clone().requires_grad_(True)
    loss, _ = _logprob_loss(x, 0.0, mask, rollout, adv, _ctx("gspo", "token", n_seq, int(mask.sum())))
    loss.backward()
    for i in range(mask.shape[0]):
        toks = [t for t in range(mask.shape[1]) if mask[i, t]]
        if not toks:
            continue
        W = math.exp(sum(math.log(min(math.exp(float(lp[i, t] - rollout[i, t])), 2.0)) for t in toks) / len(toks))
        for t in toks:
            assert float(x.grad[i, t]) == pytest.approx(-float(adv[i]) * W / len(toks) / n_seq, rel=1e-12)


# --------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------


def test_grpo_loss_points_at_the_own_functions():
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="gspo_loss"):
        grpo_loss(lp, lp, torch.ones(1), torch.ones(1, 2), loss_agg="gspo")
    for fn in (gspo_loss, cispo_loss):
        with pytest.raises(ValueError, match="kl_estimator"):
            fn(lp, lp, torch.ones(1), torch.ones(1, 2), kl_estimator="k2")
        with pytest.raises(ValueError, match="advantages"):
            fn(lp, lp, torch.ones(1, 1), torch.ones(1, 2))


_DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train_configs", "demo_cpu.toml")


def test_config_selects_the_losses_and_refuses_bad_values():
    import re

    from torchtitan_grpo.config.checks import ConfigError
    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.config.checks import validate

    cfg = parse_config(["--job.config_file", _DEMO, "--grpo.loss_agg", "cispo"])
    g = cfg.grpo
    assert (g.loss_agg, g.gspo_clip_low, g.gspo_clip_high, g.cispo_clip_low, g.cispo_clip_high) == \
        ("cispo", 3e-4, 4e-4, 1.0, 0.28)
    assert parse_config(["--job.config_file", _DEMO, "--grpo.loss_agg", "gspo"]).grpo.loss_agg == "gspo"
    for key, value, message in [
        ("grpo.loss_agg", "gpso", "must be one of"),
        ("grpo.gspo_clip_low", "1.0", r"must be in \[0, 1\)"),
        ("grpo.gspo_clip_low", "-0.1", r"must be in \[0, 1\)"),
        ("grpo.gspo_clip_high", "-1e-4", "must be >= 0"),
        ("grpo.cispo_clip_low", "1.5", r"must be in \[0, 1\]"),
        ("grpo.cispo_clip_high", "-0.1", "must be >= 0"),
    ]:
        with pytest.raises(ConfigError, match=rf"config key {re.escape(key)} = .*{message}"):
            parse_config(["--job.config_file", _DEMO, f"--{key}", value])
    # a value set in code (past the CLI's type check) is refused at start-up, naming the key
    cfg.grpo.loss_agg = "sequence_mean"
    with pytest.raises(ConfigError, match=r"config key grpo\.loss_agg = 'sequence_mean': must be one of .*gspo"):
        validate(cfg)
    assert set(LOSS_VARIANTS) >= {"gspo", "cispo"}


def test_train_step_on_the_tiny_model(tiny_model_dir):
    """Real optimizer steps (in-process, tiny model, two micro-batches, the
    ratio against the rollout log-probs), GSPO then CISPO: each step's loss
    is the sum of its micro-batch losses, and its clip fraction counts
    completions under GSPO, tokens under CISPO."""
    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.train.loss import token_logprobs
    from torchtitan_grpo.train.sample import Sample
    from torchtitan_grpo.train.trainer import _pack, build_policy, init_distributed, train_step

    # GSPO's default range (3e-4 / 4e-4) would clip every completion of this batch
    # (its rollout log-probs are far from the model's): a wider one clips some
    cfg = parse_config(["--job.config_file", _DEMO, "--model.hf_assets_path", tiny_model_dir, "--grpo.loss_agg", "gspo",
                        "--grpo.is_correction", "none", "--grpo.micro_batch_size", "2",
                        "--grpo.gspo_clip_low", "0.2", "--grpo.gspo_clip_high", "0.2"])
    d = init_distributed()
    torch.manual_seed(0)
    policy = build_policy(cfg, tiny_model_dir, d)
    g = torch.Generator().manual_seed(3)
    batch = []
    for i in range(4):
        n = 2 + i
        ids = torch.randint(2, 97, (3 + n,), generator=g).tolist()
        rollout = (-math.log(128) + 0.5 * torch.randn(n, generator=g)).tolist()  # far from the model's
        batch.append(Sample(ids[:3], ids[3:], rollout, (-1.0) ** i, 0.0, "stop", ["0"]))
    ntok = sum(len(s.completion_ids) for s in batch)
    tokens, mask, rollout, adv = _pack(batch, 0, d.device)
    for name, fn, clip, units in (("gspo", gspo_loss, dict(clip_low=0.2, clip_high=0.2), len(batch)),
                                  ("cispo", cispo_loss, dict(clip_low=1.0, clip_high=0.28), ntok)):
        cfg.grpo.loss_agg = name
        with torch.no_grad():  # the expected figures, from the weights before the step
            lp = token_logprobs(policy.model(tokens)[:, :-1].float(), tokens[:, 1:])
        expected_loss, m = fn(lp, rollout, adv, mask, **clip)
        metrics = train_step(policy, batch, cfg.grpo, 1.0, 8, len(batch), ntok, 0, d)
        assert metrics["loss"] == pytest.approx(float(expected_loss), rel=1e-4, abs=1e-6), name
        assert metrics["clip_fraction"] == pytest.approx(float(m["clip_fraction"]), abs=1e-6), name
        clipped = metrics["clip_fraction"] * units  # a whole number of completions / tokens
        assert clipped == pytest.approx(round(clipped), abs=1e-6) and 0 < clipped < units, name
        assert metrics["grad_norm"] > 0, name
