"""The IS-weighted GRPO loss keeps its inputs' precision: with float64
log-probs, ``is_weights`` and ``grpo_loss`` match the formula written out in
float64 here to rounding (1e-12), not to float32's 1e-8."""

from __future__ import annotations

import pytest
import torch

from torchtitan_grpo.train.loss import grpo_loss, is_weights


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 9
    rollout = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = rollout + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    new = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.2
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) > 0.25).to(torch.float64)
    mask[:, 0] = 1.0
    return new, old, rollout, adv, mask


def _reference(new, old, rollout, adv, mask, mode: str, cap: float, clip: float) -> float:
    """The IS-weighted seq_mean_token_mean loss, element by element in Python floats (float64)."""
    import math

    rows = []
    for i in range(new.shape[0]):
        m = mask[i].tolist()
        log_w = [o - r for o, r, k in zip(old[i].tolist(), rollout[i].tolist(), m) if k]
        if mode == "sequence":
            w_seq = min(math.exp(sum(log_w)), cap)
        terms = []
        j = 0
        for n, o, k in zip(new[i].tolist(), old[i].tolist(), m):
            if not k:
                continue
            w = w_seq if mode == "sequence" else min(math.exp(log_w[j]), cap)
            j += 1
            ratio = math.exp(n - o)
            a = float(adv[i])
            terms.append(max(-a * ratio, -a * min(max(ratio, 1 - clip), 1 + clip)) * w)
        rows.append(sum(terms) / len(terms))
    return sum(rows) / len(rows)


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_is_weighted_loss_keeps_float64(mode):
    new, old, rollout, adv, mask = _inputs()
    w, metrics = is_weights(old, rollout, mask, mode=mode, cap=2.0)
    assert w.dtype == torch.float64 and metrics["is_weight_mean"].dtype == torch.float64
    expected_w = torch.exp(old - rollout).clamp(max=2.0) if mode == "token" else \
        torch.exp(((old - rollout) * mask).sum(-1, keepdim=True)).clamp(max=2.0).expand_as(mask)
    torch.testing.assert_close(w, torch.where(mask > 0, expected_w, 1.0), rtol=1e-13, atol=1e-15)
    loss, _ = grpo_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.2, is_weights=w)
    assert loss.dtype == torch.float64
    assert abs(float(loss) - _reference(new, old, rollout, adv, mask, mode, 2.0, 0.2)) < 1e-12


def test_float32_inputs_stay_float32():
    new, old, rollout, adv, mask = (x.float() for x in _inputs(1))
    w, _ = is_weights(old, rollout, mask)
    assert w.dtype == torch.float32
    loss, _ = grpo_loss(new, old, adv, mask, is_weights=w)
    assert loss.dtype == torch.float32
