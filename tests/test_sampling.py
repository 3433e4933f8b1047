"""server/engine/sampling.py: the fast inverse-CDF path (nothing edits or truncates the
distribution) picks what the general path picks from the same uniform."""

from __future__ import annotations

import random

import pytest
import torch

from torchtitan_grpo.server.engine.requests import SamplingParams, _Request, _sample_generator, _Sequence
from torchtitan_grpo.server.engine.sampling import sample_tokens


def _seqs(params: list[SamplingParams]) -> list[_Sequence]:
    out = []
    for i, p in enumerate(params):
        req = _Request(f"r{i}", [1, 2, 3], p, 0, None)
        out.append(_Sequence(req, 0, _sample_generator(p.seed, 0)))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fast_path_equals_the_general_path(dtype, temperature):
    torch.manual_seed(0)
    rows, vocab = 16, 500
    logits = (torch.randn(rows, vocab) * 3).to(dtype)
    # min_p = 1e-30 truncates nothing but sends the rows down the general path.
    fast = [SamplingParams(temperature=temperature, seed=100 + i) for i in range(rows)]
    slow = [SamplingParams(temperature=temperature, seed=100 + i, min_p=1e-30) for i in range(rows)]
    a = sample_tokens(logits, _seqs(fast), torch.device("cpu"), random.Random(0), ())
    b = sample_tokens(logits, _seqs(slow), torch.device("cpu"), random.Random(0), ())
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs
    # The logprob is of the temperature-scaled model distribution, in fp32.
    ref = torch.log_softmax(logits.float() / temperature, -1)
    assert a.logprobs == pytest.approx([ref[i, t].item() for i, t in enumerate(a.token_ids)], abs=1e-6)


def test_mixed_temperatures_and_greedy_rows():
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, seed=3), SamplingParams(seed=4)]
    got = sample_tokens(logits, _seqs(params), torch.device("cpu"), random.Random(0), ())
    assert got.token_ids[0] == int(logits[0].argmax())
    assert got.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[got.token_ids[0]].item(), abs=1e-6)
    assert got.logprobs[1] == pytest.approx(torch.log_softmax(logits[1] / 0.5, -1)[got.token_ids[1]].item(), abs=1e-6)
    # Row 2 (seed 4, temperature 1) drew by inverse CDF from its own generator.
    u = random.Random(4).random()
    cdf = torch.softmax(logits[2], -1).cumsum(-1)
    assert got.token_ids[2] == int(torch.searchsorted(cdf, u * cdf[-1], right=True))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_draws_follow_the_distribution_the_logprobs_report(temperature):
    """Sampled tokens are distributed as softmax(logits / T), the distribution
    whose log-probs the server reports and the trainer's importance weights
    compare against (a sharper or flatter sampler would bias every loss while
    the reported log-probs still agreed with the trainer's). Seeded requests,
    as the rollouts send them: 8192 draws, chi-square against the exact
    probabilities (fixed seeds: a test that passes or fails the same way)."""
    torch.manual_seed(0)
    vocab, rows, rounds = 40, 512, 16
    logits = (torch.randn(1, vocab) * 2).to(torch.bfloat16).expand(rows, vocab).contiguous()
    p = torch.softmax(logits[0].float() / temperature, dim=-1)
    counts = torch.zeros(vocab)
    for r in range(rounds):
        seqs = _seqs([SamplingParams(temperature=temperature, seed=r * rows + i) for i in range(rows)])
        out = sample_tokens(logits, seqs, torch.device("cpu"), random.Random(r), [])
        counts += torch.bincount(torch.tensor(out.token_ids), minlength=vocab).float()
    expected = p * rows * rounds
    cells = expected > 5
    chi2 = float((((counts - expected) ** 2) / expected)[cells].sum())
    # 99.9th percentile of chi-square with up to 39 degrees of freedom is ~73
    assert chi2 < 73.0, (chi2, int(cells.sum()))
    # and a sampler at another temperature fails the same check
    q = torch.softmax(logits[0].float() / (temperature * 1.3), dim=-1) * rows * rounds
    assert float((((counts - q) ** 2) / q)[cells].sum()) > 73.0
