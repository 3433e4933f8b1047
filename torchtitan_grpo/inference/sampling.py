"""Picking the next token of every row of a batch: pure functions on logits.

Kept apart from the engine so that they touch no engine state (no lock, no
batch): the engine passes its device, generator and EOS ids in, gets tokens
and logprobs back, and records them itself. What the reported logprob is
(and why) is documented in ``engine.py``'s module docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from torchtitan_grpo.inference.requests import _GREEDY_EPS, _Sequence


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


def sample_tokens(
    logits: torch.Tensor,
    seqs: Sequence[_Sequence],
    device: torch.device,
    rng: torch.Generator,
    eos_ids: Sequence[int],
) -> Sampled:
    """Pick one token per row of ``logits`` ([len(seqs), vocab]) for ``seqs``.

    Greedy rows take the argmax of the processed logits; the others draw
    from the temperature-scaled, truncated distribution with their own
    generator if seeded, else ``rng`` (unseeded rows draw their noise in one
    call, so their stream depends on the batch; seeded ones do not).
    """
    logits = logits.float()
    n, vocab = logits.shape
    temps = torch.tensor([s.params.temperature for s in seqs], device=device)
    greedy = temps < _GREEDY_EPS
    scale = torch.where(greedy, torch.ones_like(temps), temps)
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)

    proc = process_logits(logits, seqs, device, eos_ids)
    tokens = torch.empty(n, dtype=torch.long, device=device)
    if bool(greedy.any()):
        tokens[greedy] = proc[greedy].argmax(dim=-1)
    sampled = ~greedy
    if bool(sampled.any()):
        rows = sampled.nonzero().flatten().tolist()
        x = proc[sampled] / scale[sampled, None]
        x = _truncate(
            x,
            torch.tensor([_top_k(seqs[i].params.top_k, vocab) for i in rows], device=device),
            torch.tensor([seqs[i].params.top_p for i in rows], device=device),
            torch.tensor([seqs[i].params.min_p for i in rows], device=device),
        )
        probs = torch.softmax(x, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [k for k, i in enumerate(rows) if seqs[i].generator is None]
        if unseeded:
            noise[unseeded] = torch.empty((len(unseeded), vocab), device=device).exponential_(generator=rng)
        for k, i in enumerate(rows):
            if seqs[i].generator is not None:
                noise[k].exponential_(generator=seqs[i].generator)
        # argmax(p / E), E ~ Exp(1), draws from p (the exponential race)
        tokens[sampled] = (probs / noise).argmax(dim=-1)

    chosen = logp.gather(1, tokens[:, None]).squeeze(1).tolist()
    tok_list = tokens.tolist()
    tops = {}
    want_top = [i for i, s in enumerate(seqs) if s.req.top_logprobs_num > 0]
    for i in want_top:
        k = min(seqs[i].req.top_logprobs_num, vocab)
        v, ix = logp[i].topk(k)
        tops[i] = list(zip(v.tolist(), ix.tolist()))
    return Sampled(tokens, tok_list, chosen, tops)


def process_logits(
    logits: torch.Tensor, seqs: Sequence[_Sequence], device: torch.device, eos_ids: Sequence[int]
) -> torch.Tensor:
    """Penalties, logit bias and min_new_tokens, applied to a copy (``logits``
    itself is left alone: the reported logprobs come from it)."""
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
            proc, copied = logits.clone(), True
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


def _truncate(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k, then top-p (renormalised), then min-p exclude."""
    vocab = x.shape[-1]
    if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
        sorted_x, order = x.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=x.device)
        sorted_x = sorted_x.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
        probs = torch.softmax(sorted_x, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
        drop = before > top_p[:, None]
        drop[:, 0] = False  # the most likely token always survives
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(1, order, sorted_x)
    if bool((min_p > 0).any()):
        probs = torch.softmax(x, dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        x = x.masked_fill(probs < floor, float("-inf"))
    return x
