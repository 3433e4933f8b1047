"""server/engine/sampling.py: the fast inverse-CDF path (nothing edits or truncates the
distribution) picks what the general path picks from the same uniform, and the two-level
inverse CDF (``_inverse_cdf``) picks what one cumsum over the whole vocabulary picks."""

from __future__ import annotations

import random

import pytest
import torch

from torchtitan_grpo.server.engine.requests import SamplingParams, _Request, _sample_generator, _Sequence
from torchtitan_grpo.server.engine.sampling import _U_MAX, _inverse_cdf, _truncate, sample_tokens


def _seqs(params: list[SamplingParams]) -> list[_Sequence]:
    out = []
    for i, p in enumerate(params):
        req = _Request(f"r{i}", [1, 2, 3], p, 0, None)
        out.append(_Sequence(req, 0, _sample_generator(p.seed, 0)))
    return out


def _full_cdf_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The one-level draw the sampler made before: one cumsum over the vocabulary."""
    cdf = probs.cumsum(dim=-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


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


def test_truncated_rows_draw_what_the_full_cumsum_draws_among_kept_tokens():
    """The truncated (softmax) branch at a vocabulary of several blocks: each
    row's token is the one-level draw from the same uniform (the row's own
    generator), always one that top-k / top-p / min-p kept."""
    torch.manual_seed(5)
    rows, vocab = 24, 1500
    logits = torch.randn(rows, vocab) * 2
    params = [
        SamplingParams(temperature=0.8, seed=i, top_k=[20, 0, 300][i % 3], top_p=[1.0, 0.5, 0.9][i % 3], min_p=0.02 * (i % 2))
        for i in range(rows)
    ]
    got = sample_tokens(logits, _seqs(params), torch.device("cpu"), random.Random(0), ())
    x = _truncate(logits / 0.8, [p.top_k or vocab for p in params], [p.top_p for p in params], [p.min_p for p in params])
    u = torch.tensor([random.Random(i).random() for i in range(rows)])
    want = _full_cdf_draw(torch.softmax(x, -1), u)
    assert got.token_ids == want.tolist()
    assert all(x[i, t] > float("-inf") for i, t in enumerate(got.token_ids))


def _dyadic_rows(rows: int, vocab: int, zero_frac: float, g: torch.Generator) -> torch.Tensor:
    """Probabilities that are multiples of 2**-20 summing to exactly 1: every
    partial sum is exact in fp32 in any order, so both draws see the same
    boundaries and must agree token for token."""
    w = torch.rand(rows, vocab, generator=g) ** 4  # uneven, some near-zero
    w[torch.rand(rows, vocab, generator=g) < zero_frac] = 0
    w[:, 0] += 1e-3  # no empty row
    counts = (w / w.sum(-1, keepdim=True) * 2**20).floor()
    top = counts.argmax(-1, keepdim=True)
    counts.scatter_add_(1, top, 2**20 - counts.sum(-1, keepdim=True))
    return counts / 2**20


@pytest.mark.parametrize(
    "vocab,block",
    [(4096, 512), (1537, 512), (37, 512), (37, 8), (1000, 64), (5000, 1000)],
    ids=["multiple", "partial-last-block", "vocab-under-one-block", "tiny-blocks", "block-64", "block-1000"],
)
@pytest.mark.parametrize("zero_frac", [0.0, 0.9])
def test_two_level_draw_is_the_full_cumsum_draw_on_exact_masses(vocab, block, zero_frac):
    """Exact masses: the same token for the same uniform, for random uniforms
    and for uniforms exactly on token and block boundaries (where the token
    after the boundary wins: the first whose cumulative mass exceeds u)."""
    g = torch.Generator().manual_seed(vocab + block)
    rows = 256
    probs = _dyadic_rows(rows, vocab, zero_frac, g)
    u = torch.rand(rows, generator=g)
    assert torch.equal(_inverse_cdf(probs, u, block), _full_cdf_draw(probs, u))
    # Boundaries: u = the cumulative mass at a random token, at a block's end,
    # and 0 (the first token of mass wins, not a leading zero-mass one).
    cdf = probs.cumsum(-1)
    at_token = cdf.gather(1, torch.randint(0, vocab - 1, (rows, 1), generator=g)).squeeze(1)
    ends = torch.arange(min(block, vocab) - 1, vocab - 1, min(block, vocab))
    if len(ends):
        at_block = cdf.gather(1, ends[torch.randint(0, len(ends), (rows, 1), generator=g)]).squeeze(1)
    else:
        at_block = at_token
    for u in (at_token, at_block, torch.zeros(rows)):
        u = u.clamp(max=_U_MAX)
        got = _inverse_cdf(probs, u, block)
        assert torch.equal(got, _full_cdf_draw(probs, u))
        assert bool((probs.gather(1, got[:, None]) > 0).all())


@pytest.mark.parametrize(
    "vocab,scale,top_k",
    [(151_936, 1.0, None), (151_936, 3.0, None), (1500, 3.0, None), (37, 1.0, None), (1500, 20.0, None), (3000, 2.0, 50)],
    ids=["qwen-vocab", "qwen-vocab-sharper", "partial-last-block", "tiny-vocab", "peaked", "top-k"],
)
def test_two_level_draw_matches_the_full_cumsum_up_to_rounding(vocab, scale, top_k):
    """Softmax rows (fp32 sums round): the draws agree except where the target
    lies within rounding of a boundary, and there both tokens are valid draws
    for a target moved by that much (only tokens between them of no more than
    that much mass); such rows are rare, and neither picks a zero-mass token."""
    g = torch.Generator().manual_seed(vocab)
    rows = 512
    logits = torch.randn(rows, vocab, generator=g) * scale
    if top_k is not None:
        logits = _truncate(logits, [top_k] * rows, [0.9] * rows, [0.0] * rows)
    probs = torch.softmax(logits, -1)
    u = torch.rand(rows, generator=g)
    new, old = _inverse_cdf(probs, u), _full_cdf_draw(probs, u)
    exact = probs.double().cumsum(-1)
    target = u.double() * exact[:, -1]
    eps = 1e-6
    for tok in (new, old):
        assert bool((probs.gather(1, tok[:, None]) > 0).all())
        hi = exact.gather(1, tok[:, None]).squeeze(1)
        lo = hi - probs.double().gather(1, tok[:, None]).squeeze(1)
        assert bool(((lo - eps <= target) & (target < hi + eps)).all())
    differ = (new != old).nonzero().flatten().tolist()
    assert len(differ) <= rows // 50, differ
    for r in differ:
        a, b = sorted((int(new[r]), int(old[r])))
        assert float(probs[r, a + 1 : b].double().sum()) <= eps


def test_two_level_draw_follows_the_probabilities():
    """Chi-square of 200k draws (fixed seed) on a vocabulary of 37 cut into
    blocks of 8 (a partial last block, two zero-mass tokens, one zero-mass
    block): the frequencies are the probabilities, zero-mass tokens never drawn."""
    g = torch.Generator().manual_seed(0)
    vocab, draws = 37, 200_000
    p = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    p[[3, 36]] = 0.0
    p[8:16] = 0.0
    p /= p.sum()
    tokens = _inverse_cdf(p.expand(draws, vocab), torch.rand(draws, generator=g), block=8)
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert float(counts[p == 0].sum()) == 0.0
    expected = p.double() * draws
    cells = expected > 0
    chi2 = float((((counts - expected) ** 2) / expected)[cells].sum())
    # 99.9th percentile of chi-square with 26 degrees of freedom is ~54
    assert chi2 < 54.0, chi2


def test_two_level_draw_never_picks_zero_mass():
    """Rows of odd totals whose mass sits in few tokens, drawn with uniforms at
    the edges (0, the largest fp32 below 1, 1 itself): never a zero-mass token,
    never an index past the vocabulary."""
    g = torch.Generator().manual_seed(1)
    vocab, rows = 1537, 64
    probs = torch.zeros(rows, vocab)
    for r in range(rows):
        live = torch.randperm(vocab, generator=g)[: 1 + r % 5]
        probs[r, live] = torch.rand(len(live), generator=g) * (10.0 ** (r % 7 - 3))
    probs[0, -1] = 1e-3  # the very last token, in the partial block
    for edge in (0.0, 1.0 - 2**-24, _U_MAX, 1.0):
        for u in (torch.full((rows,), edge), torch.rand(rows, generator=g)):
            for block in (512, 8):
                got = _inverse_cdf(probs, u, block)
                assert bool((got < vocab).all())
                assert bool((probs.gather(1, got[:, None]) > 0).all())


def test_a_nan_row_gets_a_token_in_range():
    """A broken model's NaN row must not index past the vocabulary (on a GPU
    that is a device-side assert, the engine's end), nor change other rows."""
    g = torch.Generator().manual_seed(3)
    for vocab in (1537, 1024):
        probs = torch.softmax(torch.randn(4, vocab, generator=g), -1)
        u = torch.rand(4, generator=g)
        want = _inverse_cdf(probs, u)
        probs[1] = float("nan")
        got = _inverse_cdf(probs, u)
        assert 0 <= int(got[1]) < vocab
        assert got[[0, 2, 3]].tolist() == want[[0, 2, 3]].tolist()


def test_a_rows_draw_does_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(16, 2000, generator=g) * 2, -1)
    u = torch.rand(16, generator=g)
    batch = _inverse_cdf(probs, u)
    for r in (0, 7, 15):
        assert int(_inverse_cdf(probs[r : r + 1], u[r : r + 1])) == int(batch[r])
    assert torch.equal(_inverse_cdf(probs[3:9], u[3:9]), batch[3:9])
