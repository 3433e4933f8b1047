"""Atropos groups as trainer samples, without processes: the conversion of
ScoredData groups (multi-turn masks, the group's own advantages, overrides,
mixed group sizes, malformed groups by kind) and multi-turn packing, where
environment tokens get no gradient. The source against the real API is
tests/test_atropos.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from torchtitan_grpo.rollout.advantages import group_advantages
from torchtitan_grpo.rollout.atropos_groups import Malformed, convert_group, convert_groups
from torchtitan_grpo.train.trainer import Sample, _LossContext, _micro_batch_loss, _pack


def multi_turn_group() -> dict:
    """Two trajectories: prompt [5, 6], model [7, 8], environment [9, 10], model [11, 12] (+ a masked tail)."""
    return {
        "tokens": [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 17, 18, 9, 10, 21, 22, 13]],
        "masks": [[-100, -100, 7, 8, -100, -100, 11, 12, -100], [-100, -100, 17, 18, -100, -100, 21, 22, -100]],
        "scores": [1.0, 0.0],
        "inference_logprobs": [[1.0, 1.0, -0.5, -0.25, 1.0, 1.0, -1.0, -2.0, 1.0],
                               [1.0, 1.0, -0.1, -0.2, 1.0, 1.0, -0.3, -0.4, 1.0]],
        "overrides": [{"finish_reason": "stop"}, {"finish_reason": "length", "weight_versions": ["3"]}],
    }


def own_advantage_group() -> dict:
    """Single-turn, the environment's own per-token advantages, and set_advantage_to_zero."""
    return {
        "tokens": [[1, 2, 3, 4], [1, 2, 5, 6]],
        "masks": [[-100, -100, 3, 4], [-100, -100, 5, 6]],
        "scores": [0.5, 0.5],
        "advantages": [[0.3, 0.3, 0.3, 0.3], [-0.3, -0.3, -0.3, -0.3]],
        "inference_logprobs": [[1.0, 1.0, -0.7, -0.8], [1.0, 1.0, -0.9, -1.1]],
        "overrides": [{"set_advantage_to_zero": True}, {}],
    }


# ------------------------------------------------------------------ conversion (no API)


def test_convert_multi_turn_group_exactly():
    c = convert_group(multi_turn_group(), scale_rewards=True, max_len=64, vocab_size=32)
    a, b = c.samples
    assert a.prompt_ids == [5, 6]
    assert a.completion_ids == [7, 8, 9, 10, 11, 12]  # the masked tail (13) is trimmed
    assert a.loss_mask == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert a.rollout_logprobs == [-0.5, -0.25, 0.0, 0.0, -1.0, -2.0]
    adv = group_advantages(torch.tensor([[1.0, 0.0]]), scale_by_std=True)[0]
    assert a.advantage == pytest.approx(float(adv[0])) and b.advantage == pytest.approx(float(adv[1]))
    assert (a.reward, b.reward) == (1.0, 0.0)
    assert (a.finish_reason, b.finish_reason) == ("stop", "length")
    assert (a.weight_versions, b.weight_versions) == ([], ["3"])
    assert a.num_loss_tokens == 4.0 and c.trained_tokens == 8 and c.truncated == 1
    # Dr. GRPO centring
    c2 = convert_group(multi_turn_group(), scale_rewards=False)
    assert [s.advantage for s in c2.samples] == [0.5, -0.5]


def test_convert_own_advantages_and_overrides():
    c = convert_group(own_advantage_group(), filter_constant_groups=True)
    a, b = c.samples  # constant scores, but the group's own advantages carry signal: kept
    assert a.advantage == 0.0 and b.advantage == pytest.approx(-0.3)
    assert a.loss_mask is None and a.prompt_ids == [1, 2] and a.completion_ids == [3, 4]
    assert a.rollout_logprobs == [-0.7, -0.8]
    g = own_advantage_group()
    g["advantages"] = []  # what BaseEnv sends when no item had advantages
    assert convert_group(g, filter_constant_groups=True).samples == []  # constant scores: filtered
    g["advantages"] = [[0.0, 0.0, 1.0, 3.0], [0.0, 0.0, -1.0, -1.0]]  # per token: a sequence takes its mean
    g["overrides"] = [{}, {}]
    c = convert_group(g)
    assert [s.advantage for s in c.samples] == [2.0, -1.0] and c.averaged_advantages == 1


def test_a_batch_of_mixed_group_sizes_keeps_each_group_apart():
    """Atropos may hand over groups of different sizes in one batch (an
    environment's off-size groups, several environments): each is converted
    with advantages relative to its own members only."""
    def group(scores):
        n = len(scores)
        return {"tokens": [[1, 2, 3 + i] for i in range(n)], "masks": [[-100, -100, 3 + i] for i in range(n)],
                "scores": scores, "inference_logprobs": [[1.0, 1.0, -0.5]] * n}

    sizes = ([1.0, 0.0, 0.0], [0.0, 1.0], [1.0, 1.0, 0.0, 0.0, 1.0])
    out = convert_groups([group(list(s)) for s in sizes], scale_rewards=True)
    assert [len(c.samples) for c in out] == [3, 2, 5]
    for c, scores in zip(out, sizes):
        want = group_advantages(torch.tensor([scores]), scale_by_std=True)[0]
        assert [s.advantage for s in c.samples] == pytest.approx(want.tolist())
        assert [s.reward for s in c.samples] == list(scores)


def test_first_token_is_never_trained():
    g = {"tokens": [[4, 5, 6]], "masks": [[4, -100, 6]], "scores": [1.0], "inference_logprobs": [[-0.1, 1.0, -0.2]]}
    (s,) = convert_group(g).samples
    assert s.prompt_ids == [4, 5] and s.completion_ids == [6] and s.rollout_logprobs == [-0.2]
    g["masks"] = [[4, -100, -100]]
    with pytest.raises(Malformed) as e:
        convert_group(g)
    assert e.value.kind == "all_masked"


@pytest.mark.parametrize("edit,kind", [
    (lambda g: g["masks"][0].pop(), "shape"),
    (lambda g: g["inference_logprobs"][1].pop(), "shape"),
    (lambda g: g["scores"].pop(), "shape"),
    (lambda g: g.update(tokens=[]), "shape"),
    (lambda g: g.update(masks=[[-100] * 9, [-100] * 9]), "all_masked"),
    (lambda g: g["tokens"][0].extend([1] * 60), "too_long"),
    (lambda g: g["tokens"][1].__setitem__(3, 99), "bad_value"),
    (lambda g: g["scores"].__setitem__(0, float("nan")), "bad_value"),
    (lambda g: g["inference_logprobs"][0].__setitem__(2, 0.5), "bad_value"),
    (lambda g: g["inference_logprobs"][0].__setitem__(2, 1.0), "no_logprobs"),
    (lambda g: g.pop("inference_logprobs"), "no_logprobs"),
])
def test_malformed_groups_name_their_kind(edit, kind):
    g = multi_turn_group()
    edit(g)
    if kind == "too_long":
        g["masks"][0].extend([-100] * 60)
        g["inference_logprobs"][0].extend([1.0] * 60)
    with pytest.raises(Malformed) as e:
        convert_group(g, max_len=64, vocab_size=32)
    assert e.value.kind == kind, str(e.value)


def test_missing_logprobs_allowed_become_nan():
    g = multi_turn_group()
    g.pop("inference_logprobs")
    c = convert_group(g, allow_missing_logprobs=True)
    lp = c.samples[0].rollout_logprobs
    assert [math.isnan(v) for v in lp] == [True, True, False, False, True, True]
    assert c.missing_logprob_tokens == 8


# ------------------------------------------------------------------ packing and the loss


def _loss_ctx(num_samples: int, num_tokens: float, loss_agg: str = "token_mean"):
    g = SimpleNamespace(is_correction="token", is_cap=2.0, clip_low=0.2, clip_high=0.2, loss_agg=loss_agg, kl_coef=0.0,
                        kl_estimator="k3")
    return _LossContext(g, 1.0, 8, num_samples, num_tokens)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_environment_tokens_get_no_gradient(loss_agg):
    """Through the trainer's loss path: the gradient wrt the logits is zero at
    every position that predicts an environment token (and the prompt and
    padding), non-zero at trained ones; the loss and every count equal those
    of the same sequences with only the trained tokens masked in by hand."""
    samples = convert_group(multi_turn_group()).samples
    samples.append(Sample([3], [4, 5], [-0.6, -0.7], 0.4, 1.0, "stop", []))  # a plain single-turn sample
    # placeholders on untrained positions must not reach the loss
    samples[0].rollout_logprobs[2] = 1.0
    tokens, mask, old, adv = _pack(samples, 0, torch.device("cpu"))
    expected = torch.zeros_like(mask)
    expected[0, 1:3] = expected[0, 5:7] = 1  # predict 7, 8 and 11, 12
    expected[1, 1:3] = expected[1, 5:7] = 1
    expected[2, 0:2] = 1
    assert torch.equal(mask, expected)
    assert float(old[0, 3]) == 0.0 and float(old[0, 5]) == -1.0
    n_tok = sum(s.num_loss_tokens for s in samples)
    assert n_tok == float(mask.sum()) == 10.0

    torch.manual_seed(0)
    logits = torch.randn(*tokens.shape, 32)[:, :-1].clone().requires_grad_(True)
    loss, record = _micro_batch_loss(logits, tokens[:, 1:], mask, old, adv, _loss_ctx(len(samples), n_tok, loss_agg))
    loss.backward()
    g = logits.grad.abs().sum(-1)
    assert torch.all(g[mask == 0] == 0), "an untrained position got gradient"
    assert torch.all(g[mask == 1] > 0)
    assert record["tokens"] == 10.0  # entropy and clip fraction are weighted by trained tokens only

    # whatever the logits at untrained positions, the loss and its metrics do not move
    noisy = logits.detach() + 50.0 * torch.randn_like(logits) * (mask == 0).unsqueeze(-1)
    loss2, record2 = _micro_batch_loss(noisy, tokens[:, 1:], mask, old, adv, _loss_ctx(len(samples), n_tok, loss_agg))
    assert float(loss2) == pytest.approx(float(loss.detach()), abs=1e-6)
    for key in ("entropy", "clip_fraction", "lp_diff_max", "tokens"):
        assert record2[key] == pytest.approx(record[key], abs=1e-5), key


def test_pack_places_tokens_masks_and_logprobs_and_pads_to_rows_and_length():
    samples = [Sample([1, 2], [3], [-0.5], 0.25, 1.0, "stop", []),
               Sample([4], [5, 6, 7], [-0.1, 2.0, -0.3], -1.0, 0.0, "stop", [], loss_mask=[1, 0, True])]
    tokens, mask, old, adv = _pack(samples, 9, torch.device("cpu"), rows=3, length=5)
    assert tokens.tolist() == [[1, 2, 3, 9, 9], [4, 5, 6, 7, 9], [9] * 5]
    assert mask.tolist() == [[0, 1, 0, 0], [1, 0, 1, 0], [0] * 4]
    assert torch.equal(old, torch.tensor([[0, -0.5, 0, 0], [-0.1, 0, -0.3, 0], [0] * 4]))
    assert (tokens.dtype, mask.dtype, old.dtype) == (torch.long, torch.float32, torch.float32)
    assert adv.tolist() == [0.25, -1.0, 0.0]


def test_pack_checks_mask_lengths():
    s = Sample([1], [2, 3], [-0.1, -0.2], 1.0, 1.0, "stop", [], loss_mask=[1.0])
    with pytest.raises(ValueError, match="loss_mask"):
        _pack([s], 0, torch.device("cpu"))
