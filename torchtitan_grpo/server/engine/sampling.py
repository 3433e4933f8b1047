"""Picking the next token of every row of a batch: pure functions on logits.

Kept apart from the engine so that they touch no engine state (no lock, no
batch): the engine passes its device, generator and EOS ids in, gets tokens
and logprobs back, and records them itself. What the reported logprob is
(and why) is documented in ``server/engine/engine.py``'s module docstring.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch

from torchtitan_grpo.server.engine.batch import upload
from torchtitan_grpo.server.engine.requests import _GREEDY_EPS, _Sequence


@dataclass
class Sampled:
    """One token per row, in the rows' order, as host values plus the tensor
    (the batch feeds ``tokens`` to its next decode step)."""

    tokens: torch.Tensor
    """[rows] on the device."""
    token_ids: list[int]
    logprobs: list[float]
    """Per row, the logprob of its token (see the engine's docstring)."""
    top: dict[int, list[tuple[float, int]]]
    """Row -> its ``top_logprobs_num`` most likely (logprob, token id); only
    rows whose request asked for them."""


class Launched:
    """A step's sampling, queued on the device: ``tokens`` can feed the next
    decode step at once, and the host values arrive by :meth:`resolve` (a
    copy started now, so on a GPU the host can launch the next step before
    this one's values are read: the engine's overlapped schedule)."""

    def __init__(self, tokens: torch.Tensor, chosen: torch.Tensor, top: "TopRows | None" = None):
        self.tokens = tokens
        self._top = top
        self._event = None
        sent = [tokens, chosen] + ([top.values, top.ids] if top is not None else [])
        if tokens.device.type == "cuda":
            # Every host value of the step in one batch of non-blocking copies:
            # resolve() then waits for this step only, never for the step
            # launched after it (a .tolist() of a device tensor would).
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in sent]
            for h, t in zip(self._host, sent):
                h.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = sent

    def resolve(self) -> Sampled:
        """Wait for the values (if not yet there) and return them."""
        if self._event is not None:
            self._event.synchronize()
        tops: dict[int, list[tuple[float, int]]] = {}
        if self._top is not None:
            values, ids = self._host[2].tolist(), self._host[3].tolist()
            for j, (row, k) in enumerate(zip(self._top.rows, self._top.ks)):
                tops[row] = list(zip(values[j][:k], ids[j][:k]))
        return Sampled(self.tokens, self._host[0].tolist(), self._host[1].tolist(), tops)


@dataclass
class TopRows:
    """The top logprobs of the rows that asked for them, from one ``topk``
    over those rows at the largest k asked (per-row calls cost a kernel
    launch and a host copy per row per step); row ``rows[j]`` keeps its
    first ``ks[j]``."""

    rows: list[int]
    ks: list[int]
    values: torch.Tensor
    """[len(rows), max(ks)] logprobs, best first."""
    ids: torch.Tensor


def top_rows(logp: torch.Tensor, seqs: Sequence[_Sequence], device: torch.device) -> TopRows | None:
    """:class:`TopRows` of ``logp`` ([rows, vocab]) for the rows whose request set ``top_logprobs_num``."""
    rows = [i for i, s in enumerate(seqs) if s.req.top_logprobs_num > 0]
    if not rows:
        return None
    vocab = logp.shape[-1]
    ks = [min(seqs[i].req.top_logprobs_num, vocab) for i in rows]
    picked = logp if len(rows) == len(seqs) else logp.index_select(0, upload(rows, device))
    values, ids = picked.topk(max(ks), dim=-1)
    return TopRows(rows, ks, values, ids)


def sample_tokens(
    logits: torch.Tensor, seqs: Sequence[_Sequence], device: torch.device, rng: random.Random, eos_ids: Sequence[int]
) -> Sampled:
    """:func:`launch_sample`, then its values."""
    return launch_sample(logits, seqs, device, rng, eos_ids).resolve()


def launch_sample(
    logits: torch.Tensor,
    seqs: Sequence[_Sequence],
    device: torch.device,
    rng: random.Random,
    eos_ids: Sequence[int],
) -> Launched:
    """Pick one token per row of ``logits`` ([len(seqs), vocab]) for ``seqs``.

    Greedy rows take the argmax of the processed logits. The others draw from
    the temperature-scaled, truncated distribution by inverse CDF: one uniform
    per row, from the row's own generator if seeded (a seeded request is then
    reproducible whatever else is in the batch), else from ``rng``. The
    uniforms are drawn on the host, so a step costs the same few kernels for
    any number of seeded rows, and which rows need what (greedy, truncation)
    is decided from their parameters on the host: nothing waits for the
    device before the tokens themselves are read.
    """
    n, vocab = logits.shape
    params = [s.params for s in seqs]
    greedy = [p.temperature < _GREEDY_EPS for p in params]
    temps_l = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
    distinct = set(temps_l)
    temps = temps_l[0] if len(distinct) == 1 else upload(temps_l, device)[:, None]
    # The log-softmax reads the model's dtype and computes in fp32 (no fp32
    # copy of the logits unless a temperature divides them first).
    scaled = logits if distinct == {1.0} else logits.float() / temps
    logp = torch.log_softmax(scaled, dim=-1, dtype=torch.float32)
    proc = process_logits(logits, seqs, device, eos_ids)
    top_k = [_top_k(p.top_k, vocab) for p in params]
    if all(greedy):
        tokens = proc.argmax(dim=-1)
    else:
        if proc is logits and all(k == vocab for k in top_k) and all(p.top_p >= 1.0 and p.min_p <= 0 for p in params):
            # Nothing edits or truncates the distribution: it is exp(logp),
            # which saves the second softmax's passes over [rows, vocab].
            probs = logp.exp()
        else:
            x = _truncate(proc.float() / temps, top_k, [p.top_p for p in params], [p.min_p for p in params])
            probs = torch.softmax(x, dim=-1)
        u = upload([(s.generator or rng).random() for s in seqs], device, probs.dtype)
        drawn = _inverse_cdf(probs, u)
        tokens = drawn if not any(greedy) else torch.where(
            upload(greedy, device), proc.argmax(dim=-1), drawn)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    return Launched(tokens, chosen, top_rows(logp, seqs, device))


_CDF_BLOCK = 512
"""Tokens per block of :func:`_inverse_cdf`. CUDA's cumsum walks a row in
serial chunks of at most 1,024 elements, one row per thread block at a large
vocabulary (~150 chunks for 152k tokens: the slowest sampling kernel of a
decode step). Two scans, one over the ``vocab / block`` block masses and one
over a block, cost least when both are short: a power of two near
sqrt(vocab) (~390 for 152k) puts each at a few chunks; the block masses are
one plain reduction over the probabilities, as fast at any block size."""

_U_MAX = 1.0 - 2.0**-23
"""x * _U_MAX < x for every positive normal fp32 x (x * 2**-23 is at least
an ulp of x): a uniform clamped to it lands strictly below the total mass, a
residual clamped to a block's total * _U_MAX strictly below that total."""


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor, block: int = _CDF_BLOCK) -> torch.Tensor:
    """Per row of ``probs`` ([rows, vocab], non-negative, any positive total),
    the first token whose cumulative mass exceeds ``u * total`` (``u``: [rows]
    in [0, 1)): token i wins with probability p_i, a token of zero mass never
    does, and a row's token depends on that row's values only.

    Two levels instead of one cumsum over the vocabulary (see
    :data:`_CDF_BLOCK`): the mass of each block of ``block`` tokens, the
    block where the cumulative mass passes the target, then the token inside
    that block. In exact arithmetic that is the one-level draw; in fp32 the
    two can differ only where the target is within rounding of a boundary."""
    n, vocab = probs.shape
    block = min(block, vocab)
    whole = vocab - vocab % block
    # cum[:, j]: the mass of the blocks before block j (an exclusive scan, so
    # a block's start is read, not recomputed with its own rounding); the
    # last, partial block (vocab not a multiple of block) is summed apart.
    parts = [probs.new_zeros(n, 1), probs[:, :whole].view(n, -1, block).sum(-1)]
    if whole < vocab:
        parts.append(probs[:, whole:].sum(-1, keepdim=True))
    cum = torch.cat(parts, dim=1).cumsum_(dim=-1)
    target = u.clamp(max=_U_MAX)[:, None] * cum[:, -1:]
    # cum[b] <= target < cum[b + 1]. Never below 0 (target >= 0 = cum[:, 0]);
    # past the last block only in a NaN row, whose columns the clamps below
    # keep in range (an index past the vocabulary would be a device-side
    # assert, the engine's end, not one bad token).
    b = torch.searchsorted(cum, target, right=True) - 1
    # Columns past the vocabulary (a partial last block) re-read its last
    # token: they lie past the block's real mass, so only a rounding overshoot
    # reaches them, and the final clamp maps that back to the last token.
    cols = torch.arange(block, device=probs.device).add(b, alpha=block).clamp_(max=vocab - 1)
    within = probs.gather(1, cols).cumsum_(dim=-1)
    # The target past the block's start, kept below the block's own total
    # (its scan and the block-mass reduction round differently): the token
    # found then has mass (within[t] > rest >= within[t - 1]).
    rest = torch.minimum(target - cum.gather(1, b), within[:, -1:] * _U_MAX)
    t = torch.searchsorted(within, rest, right=True)
    return t.add_(b, alpha=block).squeeze(1).clamp_(max=vocab - 1)


def process_logits(
    logits: torch.Tensor, seqs: Sequence[_Sequence], device: torch.device, eos_ids: Sequence[int]
) -> torch.Tensor:
    """Penalties, logit bias and min_new_tokens, applied to an fp32 copy
    (``logits`` itself is left alone: the reported logprobs come from it);
    ``logits`` itself when no row asks for any."""
    proc = logits
    copied = False
    for i, s in enumerate(seqs):
        p = s.params
        edits = (
            p.repetition_penalty != 1.0
            or p.frequency_penalty
            or p.presence_penalty
            or p.logit_bias
            or len(s.output_ids) < p.min_new_tokens
        )
        if not edits:
            continue
        if not copied:
            proc, copied = logits.to(torch.float32, copy=True), True
        row = proc[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(s.context())), device=device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and s.output_ids:
            counts = torch.bincount(torch.tensor(s.output_ids, device=device), minlength=row.numel())[: row.numel()]
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.logit_bias:
            for tok, bias in p.logit_bias.items():
                row[tok] += bias
        if len(s.output_ids) < p.min_new_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            if banned:
                row[torch.tensor(sorted(banned), device=device)] = float("-inf")
    return proc


def _top_k(k: int, vocab: int) -> int:
    return vocab if k is None or k <= 0 else min(k, vocab)


def _truncate(x: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) what top-k, then top-p (renormalised), then min-p exclude;
    the parameters are host lists, so the passes nobody asked for are skipped
    without a device sync."""
    vocab = x.shape[-1]
    dev = x.device
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_x, order = x.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=dev)
        sorted_x = sorted_x.masked_fill(ranks[None, :] >= upload(top_k, dev)[:, None], float("-inf"))
        probs = torch.softmax(sorted_x, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
        drop = before > upload(top_p, dev)[:, None]
        drop[:, 0] = False  # the most likely token always survives
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(1, order, sorted_x)
    if any(p > 0 for p in min_p):
        probs = torch.softmax(x, dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * upload(min_p, dev)[:, None]
        x = x.masked_fill(probs < floor, float("-inf"))
    return x
