"""GRPO loss, IS weights and group advantages against formulas written out here."""

import math

import pytest
import torch

from torchtitan_grpo.train.loss import entropy_from_logits, grpo_loss, is_weights, token_logprobs
from torchtitan_grpo.rollout.advantages import constant_group_mask, group_advantages

LN = math.log


# --------------------------------------------------------------------------
# token_logprobs / entropy
# --------------------------------------------------------------------------


def test_token_logprobs_matches_log_softmax_and_temperature():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7)
    targets = torch.randint(0, 7, (2, 3))
    for temperature, scale in [(1.0, 1.0), (0.0, 1.0), (0.5, 2.0), (2.0, 0.5)]:
        expected = torch.log_softmax(logits * scale, -1).gather(-1, targets[..., None])[..., 0]
        got = token_logprobs(logits, targets, temperature=temperature)
        torch.testing.assert_close(got, expected)
    # Hand check of one position: logits (0, ln 3) -> p = (1/4, 3/4).
    two = torch.tensor([[[0.0, LN(3.0)]]])
    assert token_logprobs(two, torch.tensor([[1]])).item() == pytest.approx(LN(0.75))
    # T = 0.5 doubles the logits: (0, 2 ln 3) -> p(1) = 9/10.
    assert token_logprobs(two, torch.tensor([[1]]), 0.5).item() == pytest.approx(LN(0.9))


def test_token_logprobs_gradient_and_bf16_input_untouched():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, dtype=torch.bfloat16, requires_grad=True)
    before = logits.detach().clone()
    targets = torch.randint(0, 5, (2, 3))
    lp = token_logprobs(logits, targets, temperature=0.7)
    assert lp.dtype == torch.float32
    lp.sum().backward()
    torch.testing.assert_close(logits.detach(), before)  # in-place division hit a copy
    # d/dz log softmax(z/T)_y = (onehot(y) - softmax(z/T)) / T
    p = torch.softmax(before.float() / 0.7, -1)
    expected = (torch.nn.functional.one_hot(targets, 5).float() - p) / 0.7
    torch.testing.assert_close(logits.grad.float(), expected, atol=2e-2, rtol=2e-2)


def test_entropy_from_logits_masked_mean():
    # Row 0 uniform over 4 -> ln 4; row 1 one-hot-ish (huge logit) -> ~0.
    logits = torch.zeros(2, 2, 4)
    logits[1, :, 0] = 100.0
    mask = torch.tensor([[1, 0], [1, 1]])
    # mean over the three masked tokens: (ln 4 + 0 + 0) / 3
    assert entropy_from_logits(logits, mask).item() == pytest.approx(LN(4) / 3, abs=1e-5)
    assert entropy_from_logits(logits, torch.zeros(2, 2)).item() == 0.0


@pytest.mark.parametrize("chunk_rows", [1, 2, 5])
def test_entropy_is_the_same_whatever_the_chunk(monkeypatch, chunk_rows):
    import torchtitan_grpo.train.loss as L

    torch.manual_seed(0)
    logits = torch.randn(5, 3, 7, dtype=torch.bfloat16)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 1]])
    logp = torch.log_softmax(logits.float() / 0.7, dim=-1)
    expected = (-(logp.exp() * logp).sum(-1) * mask).sum() / mask.sum()
    monkeypatch.setattr(L, "_ENTROPY_CHUNK_ELEMENTS", chunk_rows * 3 * 7)
    assert float(entropy_from_logits(logits, mask, temperature=0.7)) == pytest.approx(float(expected), abs=1e-5)


# --------------------------------------------------------------------------
# grpo_loss: the hand-checked batch
# --------------------------------------------------------------------------
# Row 0 (A = +1): ratios 1.5 and 0.5, then a padding slot.
# Row 1 (A = -2): ratio 1.1, then two padding slots.
# clip 0.2/0.2 -> clip(r) in [0.8, 1.2]; per-token loss = max(-A r, -A clip(r)):
#   row 0, r=1.5: max(-1.5, -1.2) = -1.2   (clipped branch, high side)
#   row 0, r=0.5: max(-0.5, -0.8) = -0.5   (unclipped)
#   row 1, r=1.1: max( 2.2,  2.2) =  2.2   (inside the range)


def _batch():
    old = torch.tensor([[0.3, -1.0, 5.0], [-0.2, 0.0, 0.0]])
    log_ratio = torch.tensor([[LN(1.5), LN(0.5), 0.0], [LN(1.1), 0.0, 0.0]])
    # Padding slot holds -inf (as a real log-softmax of a masked token may).
    logprobs = (old + log_ratio).clone()
    logprobs[1, 2] = float("-inf")
    logprobs.requires_grad_(True)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    return logprobs, old, adv, mask


@pytest.mark.parametrize(
    "loss_agg, expected",
    [
        # GRPO: mean_rows( mean_tokens ): ((-1.2 - 0.5)/2 + 2.2/1) / 2
        ("seq_mean_token_mean", ((-1.2 - 0.5) / 2 + 2.2) / 2),
        # DAPO: sum over all tokens / number of tokens
        ("token_mean", (-1.2 - 0.5 + 2.2) / 3),
        # Dr. GRPO, max_completion_len = 4: mean_rows( sum_tokens / 4 )
        ("seq_mean_token_sum_norm", ((-1.2 - 0.5) / 4 + 2.2 / 4) / 2),
    ],
)
def test_aggregations_value(loss_agg, expected):
    logprobs, old, adv, mask = _batch()
    loss, metrics = grpo_loss(logprobs, old, adv, mask, loss_agg=loss_agg, max_completion_len=4)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["pg_loss"].item() == pytest.approx(expected, rel=1e-6)
    assert metrics["clip_fraction"].item() == pytest.approx(1 / 3)
    assert metrics["clip_high_fraction"].item() == pytest.approx(1 / 3)
    assert metrics["clip_low_fraction"].item() == 0.0
    assert metrics["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.1) / 3)
    assert metrics["ratio_max"].item() == pytest.approx(1.5)


@pytest.mark.parametrize(
    "loss_agg, row0_weight, row1_weight",
    [
        # d loss / d token = (d token_loss / d logprob) * aggregation weight.
        # Unclipped: d(-A r)/d logprob = -A r; clipped branch: 0.
        ("seq_mean_token_mean", 1 / (2 * 2), 1 / (1 * 2)),  # 1/(len * n_rows)
        ("token_mean", 1 / 3, 1 / 3),  # 1/n_tokens
        ("seq_mean_token_sum_norm", 1 / (4 * 2), 1 / (4 * 2)),  # 1/(max_len * n_rows)
    ],
)
def test_aggregations_gradient(loss_agg, row0_weight, row1_weight):
    logprobs, old, adv, mask = _batch()
    loss, _ = grpo_loss(logprobs, old, adv, mask, loss_agg=loss_agg, max_completion_len=4)
    loss.backward()
    expected = torch.tensor(
        [
            [0.0, -1.0 * 0.5 * row0_weight, 0.0],  # clipped token: no gradient
            [-(-2.0) * 1.1 * row1_weight, 0.0, 0.0],
        ]
    )
    assert torch.isfinite(loss)
    torch.testing.assert_close(logprobs.grad, expected)


def test_clip_low_side_with_asymmetric_range():
    # clip_low=0.1, clip_high=0.3 -> clip(r) in [0.9, 1.3]. One row per token.
    #   A=-1, r=0.5: max(0.5, 0.9) = 0.9   clipped, low side
    #   A=-1, r=1.25: max(1.25, 1.25) = 1.25 (inside range)
    #   A=+1, r=1.25: max(-1.25, -1.25) = -1.25 (inside: the high bound is 1.3, not 1.2)
    #   A=+1, r=1.4: max(-1.4, -1.3) = -1.3 clipped, high side
    #   A=-1, r=1.4: max(1.4, 1.3) = 1.4   unclipped (pessimistic side)
    ratios = torch.tensor([0.5, 1.25, 1.25, 1.4, 1.4])
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0, -1.0])
    logprobs = torch.log(ratios)[:, None].clone().requires_grad_(True)
    old = torch.zeros(5, 1)
    mask = torch.ones(5, 1)
    loss, m = grpo_loss(logprobs, old, adv, mask, clip_low=0.1, clip_high=0.3)
    per_token = torch.tensor([0.9, 1.25, -1.25, -1.3, 1.4])
    assert loss.item() == pytest.approx(per_token.mean().item(), rel=1e-6)
    assert m["clip_fraction"].item() == pytest.approx(2 / 5)
    assert m["clip_low_fraction"].item() == pytest.approx(1 / 5)
    assert m["clip_high_fraction"].item() == pytest.approx(1 / 5)
    loss.backward()
    # gradient -A r / 5 where unclipped, 0 where clipped
    expected = torch.tensor([0.0, 1.25, -1.25, 0.0, 1.4]) / 5
    torch.testing.assert_close(logprobs.grad[:, 0], expected)


def test_on_policy_gradient_is_minus_advantage_times_score():
    # ratio == 1 (old == current): loss = mean_rows(mean_tokens(-A)),
    # d/d logprob = -A / (len * n_rows) on every masked token.
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    adv = torch.tensor([0.5, -1.5])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, m = grpo_loss(lp, lp.detach(), adv, mask)
    assert loss.item() == pytest.approx((-0.5 + 1.5) / 2)
    assert m["clip_fraction"].item() == 0.0
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5 / 4, -0.5 / 4], [1.5 / 2, 0.0]]))


def test_bool_mask_equals_float_mask():
    logprobs, old, adv, mask = _batch()
    a, _ = grpo_loss(logprobs, old, adv, mask)
    b, _ = grpo_loss(logprobs, old, adv, mask.bool())
    assert a.item() == b.item()


def test_errors_name_the_bad_argument():
    logprobs, old, adv, mask = _batch()
    with pytest.raises(ValueError, match="loss_agg"):
        grpo_loss(logprobs, old, adv, mask, loss_agg="mean")
    with pytest.raises(ValueError, match="max_completion_len"):
        grpo_loss(logprobs, old, adv, mask, loss_agg="seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="kl_estimator"):
        grpo_loss(logprobs, old, adv, mask, kl_estimator="k2")
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(logprobs, old, adv[:, None], mask)


# --------------------------------------------------------------------------
# empty completions and global normalisers
# --------------------------------------------------------------------------


@pytest.mark.parametrize("loss_agg", ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"])
def test_empty_completion_is_finite_and_ignored(loss_agg):
    logprobs, old, adv, mask = _batch()
    # Append an all-padding row full of garbage: it must change nothing.
    lp3 = torch.cat([logprobs.detach(), torch.full((1, 3), float("-inf"))]).requires_grad_(True)
    old3 = torch.cat([old, torch.full((1, 3), float("nan"))])
    adv3 = torch.cat([adv, torch.tensor([7.0])])
    mask3 = torch.cat([mask, torch.zeros(1, 3)])
    ref, _ = grpo_loss(logprobs, old, adv, mask, loss_agg=loss_agg, max_completion_len=4)
    loss, m = grpo_loss(lp3, old3, adv3, mask3, loss_agg=loss_agg, max_completion_len=4)
    loss.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.isfinite(lp3.grad).all() and (lp3.grad[2] == 0).all()
    assert all(torch.isfinite(v) for v in m.values())

    # A batch with no completion token at all: loss 0, gradient 0, no NaN.
    lp0 = torch.zeros(2, 3, requires_grad=True)
    loss0, m0 = grpo_loss(lp0, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3),
                          loss_agg=loss_agg, max_completion_len=4)
    loss0.backward()
    assert loss0.item() == 0.0 and (lp0.grad == 0).all()
    assert all(torch.isfinite(v) for v in m0.values())


@pytest.mark.parametrize("loss_agg", ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"])
def test_micro_batches_with_global_normaliser_match_one_batch(loss_agg):
    torch.manual_seed(0)
    B, T = 7, 6
    lp = (torch.randn(B, T) * 0.3 - 1.0).requires_grad_(True)
    old = lp.detach() + torch.randn(B, T) * 0.2  # off-policy: some tokens clip
    ref = lp.detach() + torch.randn(B, T) * 0.1
    adv = torch.randn(B)
    lengths = torch.tensor([6, 1, 0, 3, 5, 2, 4])  # one empty row
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    kw = dict(loss_agg=loss_agg, max_completion_len=T, ref_logprobs=ref, kl_coef=0.1)

    full, _ = grpo_loss(lp, old, adv, mask, **kw)
    (g_full,) = torch.autograd.grad(full, lp)

    # The trainer counts over the whole step and passes the counts down.
    num_sequences = int((lengths > 0).sum())
    num_tokens = int(mask.sum())
    total = 0.0
    for rows in (slice(0, 2), slice(2, 3), slice(3, 7)):
        part, _ = grpo_loss(
            lp[rows], old[rows], adv[rows], mask[rows], ref_logprobs=ref[rows],
            num_sequences=num_sequences, num_tokens=num_tokens,
            **{k: v for k, v in kw.items() if k != "ref_logprobs"},
        )
        total = total + part
    (g_micro,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(full.item(), rel=1e-5)
    torch.testing.assert_close(g_micro, g_full)

    # Without the global counts the micro-batch means do NOT add up (the test
    # can tell the difference).
    local = sum(
        grpo_loss(lp[r], old[r], adv[r], mask[r], ref_logprobs=ref[r],
                  **{k: v for k, v in kw.items() if k != "ref_logprobs"})[0]
        for r in (slice(0, 2), slice(2, 3), slice(3, 7))
    )
    assert abs(local.item() - full.item()) > 1e-3


# --------------------------------------------------------------------------
# KL penalty
# --------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_penalty(estimator):
    # On-policy (ratio 1) with A = 0: the loss is only kl_coef * mean(kl).
    lp = torch.tensor([[LN(0.5), LN(0.25)]], requires_grad=True)
    ref = torch.tensor([[LN(0.25), LN(0.25)]])
    mask = torch.ones(1, 2)
    loss, m = grpo_loss(lp, lp.detach(), torch.zeros(1), mask, ref_logprobs=ref,
                        kl_coef=0.1, kl_estimator=estimator)
    d = ref - lp.detach()  # log(ref / p) = (ln 0.5, 0)... per token: (-ln 2, 0)
    if estimator == "k1":
        kl = -d  # log p - log ref
        dkl = torch.ones_like(d)  # d/d lp
    else:
        kl = torch.exp(d) - d - 1  # k3: 0.5 + ln 2 - 1 = ln 2 - 0.5, and 0
        dkl = 1 - torch.exp(d)
    assert m["kl"].item() == pytest.approx(kl.mean().item(), rel=1e-6)
    assert loss.item() == pytest.approx(0.1 * kl.mean().item(), rel=1e-6)
    if estimator == "k3":
        assert m["kl"].item() == pytest.approx((LN(2) - 0.5) / 2, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, 0.1 * dkl / 2)


# --------------------------------------------------------------------------
# importance sampling weights
# --------------------------------------------------------------------------


def test_is_weights_token_mode_truncates_at_cap():
    # pi_old / pi_rollout per token: 0.5, 1.5, 3.0 (capped to 2), then padding.
    old = torch.tensor([[LN(0.5), LN(0.3), LN(0.9), 0.0]])
    roll = torch.tensor([[LN(1.0), LN(0.2), LN(0.3), 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    w, m = is_weights(old, roll, mask, mode="token", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.5, 2.0, 1.0]]))
    assert not w.requires_grad
    assert m["is_weight_mean"].item() == pytest.approx((0.5 + 1.5 + 2.0) / 3)
    assert m["is_weight_max"].item() == pytest.approx(3.0, rel=1e-5)
    assert m["is_capped_fraction"].item() == pytest.approx(1 / 3)


def test_is_weights_sequence_mode_uses_product_of_ratios():
    # Row 0: ratios 0.5 * 1.5 = 0.75. Row 1: 3 * 2 = 6 -> capped to 2.5.
    # Row 2: empty -> weight 1, not counted in the metrics.
    old = torch.tensor([[LN(0.5), LN(0.3)], [LN(0.9), LN(0.4)], [5.0, 5.0]])
    roll = torch.tensor([[LN(1.0), LN(0.2)], [LN(0.3), LN(0.2)], [0.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 1], [0, 0]])
    w, m = is_weights(old, roll, mask, mode="sequence", cap=2.5)
    torch.testing.assert_close(w, torch.tensor([[0.75, 0.75], [2.5, 2.5], [1.0, 1.0]]))
    assert m["is_weight_mean"].item() == pytest.approx((0.75 + 2.5) / 2)
    assert m["is_weight_max"].item() == pytest.approx(6.0, rel=1e-5)
    assert m["is_capped_fraction"].item() == pytest.approx(1 / 2)
    # A huge log-ratio sum must not overflow into inf/NaN.
    w_big, m_big = is_weights(torch.full((1, 500), 1.0), torch.zeros(1, 500),
                              torch.ones(1, 500), mode="sequence")
    assert w_big.max().item() == 2.0 and torch.isfinite(m_big["is_weight_max"])
    with pytest.raises(ValueError, match="mode"):
        is_weights(old, roll, mask, mode="tok")


def test_is_weights_multiply_the_policy_term():
    # On-policy, one row of 2 tokens, A = 1: token losses -1, -1.
    # With weights (0.5, 2): -(0.5 + 2) / 2; gradient -A * r * w / len.
    lp = torch.zeros(1, 2, requires_grad=True)
    w = torch.tensor([[0.5, 2.0]])
    loss, _ = grpo_loss(lp, lp.detach(), torch.ones(1), torch.ones(1, 2), is_weights=w)
    assert loss.item() == pytest.approx(-1.25)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.25, -1.0]]))
    # [B] sequence weights broadcast over the row.
    loss_seq, _ = grpo_loss(lp, lp.detach(), torch.ones(1), torch.ones(1, 2),
                            is_weights=torch.tensor([3.0]))
    assert loss_seq.item() == pytest.approx(-3.0)


# --------------------------------------------------------------------------
# group advantages
# --------------------------------------------------------------------------


def test_group_advantages_formula():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 2.0]])
    # Group 0: mean 0.5, sample std sqrt(4 * 0.25 / 3) = sqrt(1/3).
    s0 = math.sqrt(1 / 3)
    # Group 1: mean 0.5, deviations (-.5,-.5,-.5,1.5), sample std sqrt(3/3) = 1.
    expected = torch.tensor(
        [[0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0], [-0.5, -0.5, -0.5, 1.5]]
    )
    got = group_advantages(rewards, eps=0.0)
    torch.testing.assert_close(got, expected)
    # eps sits in the denominator: (r - mean) / (std + eps)
    torch.testing.assert_close(group_advantages(rewards, eps=1.0)[1], expected[1] / 2)
    # Dr. GRPO: centring only.
    torch.testing.assert_close(
        group_advantages(rewards, scale_by_std=False),
        torch.tensor([[0.5, -0.5, -0.5, 0.5], [-0.5, -0.5, -0.5, 1.5]]),
    )
    assert got.sum(-1).abs().max() < 1e-6  # zero-mean per group


def test_constant_groups_get_zero_advantage_and_are_flagged():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.3, 0.3, 0.3]])
    adv = group_advantages(rewards)
    assert torch.isfinite(adv).all()
    assert (adv[[0, 1, 3]] == 0).all() and (adv[2] != 0).all()
    assert constant_group_mask(rewards).tolist() == [True, True, False, True]
    assert constant_group_mask(torch.tensor([[0.0, 1e-3]]), atol=1e-2).tolist() == [True]
    # One completion per prompt: no spread, all zeros, no NaN.
    single = group_advantages(torch.tensor([[0.7], [0.1]]))
    assert (single == 0).all()
    with pytest.raises(ValueError, match=r"\[P, G\]"):
        group_advantages(torch.ones(4))
