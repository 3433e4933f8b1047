"""The GRPO step's forward under context parallelism (CP): each rank scores
its share of the sequence (full logits or the chunked head of
train/token_logprobs.py) and the local log-probs are gathered back into whole
sequences for the loss; also the pipeline's first and last stage under CP.
The set-up (sharding the inputs, ring attention on CPU, the gather) is
distributed/context_parallel.py, whose module docstring explains the design.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_grpo.distributed.context_parallel import gather_sequence, shard_batch
from torchtitan_grpo.train import token_logprobs
from torchtitan_grpo.train.loss import token_logprobs as logits_logprobs

__all__ = ["forward_terms", "forwards", "pipeline_terms", "pipeline_tokens", "reference_logprobs"]
def _local_logprobs(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor,
                    temperature: float, chunk_tokens: int, with_entropy: bool):
    """``[B, T / cp]`` log-probs of the local targets, and per-token entropy (or None)."""
    if not chunk_tokens:
        logits = model(tokens, positions=positions).float()
        lp = logits_logprobs(logits, targets, temperature)
        return lp, _token_entropy(logits, temperature) if with_entropy else None
    with token_logprobs.logprob_head(model.output, targets, temperature, chunk_tokens,
                                     with_entropy=with_entropy) as head:
        lp = model(tokens, positions=positions)
    return lp, head.entropy


@torch.no_grad()
def _token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-token entropy of ``[B, T, V]`` float logits (a metric: no gradient)."""
    x = logits / temperature if temperature > 0 and temperature != 1.0 else logits
    logp = torch.log_softmax(x, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _masked_mean_entropy(parallel_dims, ent: torch.Tensor, local_mask: torch.Tensor) -> torch.Tensor:
    """The masked mean of per-token entropy over the whole sequences (every CP rank's share)."""
    with torch.no_grad():
        total = torch.stack([(ent.float() * local_mask).sum(), local_mask.sum()])
        dist.all_reduce(total, group=parallel_dims.get_mesh("cp").get_group())
        return total[0] / total[1].clamp(min=1.0)


def pipeline_tokens(parallel_dims, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CP x PP: this CP rank's ``[B, T / cp]`` share of a pipelined batch and
    its positions (every row's are the same: one row is returned, which the
    stages' RoPE and the last stage's loss expand to their micro-batch)."""
    tok, _, positions, _ = shard_batch(parallel_dims, tokens)
    return tok, positions[:1]


def pipeline_terms(parallel_dims, logits: torch.Tensor, next_tokens: torch.Tensor, mask: torch.Tensor,
                   positions: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CP x PP, in the last stage's loss: ``([B, T - 1]`` log-probs of whole
    sequences, masked mean entropy``)`` from this rank's ``[B, T / cp, V]``
    float logits at ``positions`` (:func:`pipeline_tokens`' row) and the
    micro-batch's whole ``[B, T - 1]`` next tokens and mask (the schedule
    hands every CP rank the same target rows)."""
    pos = positions.expand(logits.shape[0], -1).long()
    targets = nn.functional.pad(next_tokens, (0, 1)).gather(1, pos)
    local_mask = nn.functional.pad(mask, (0, 1)).gather(1, pos)
    lp = logits_logprobs(logits, targets, temperature)
    logprobs = gather_sequence(parallel_dims, lp.float(), pos)[:, :-1]
    return logprobs, _masked_mean_entropy(parallel_dims, _token_entropy(logits, temperature), local_mask)


def forward_terms(parallel_dims, model: nn.Module, tokens: torch.Tensor, mask: torch.Tensor, temperature: float,
                  chunk_tokens: int, amp: contextlib.AbstractContextManager):
    """The trainer's ``_forward_terms`` under CP: ``([B, T - 1] log-probs of
    tokens[:, 1:]`` (whole sequences, with gradient), masked mean entropy)``."""
    tok, targets, positions, local_mask = shard_batch(parallel_dims, tokens, mask)
    with amp:
        lp, ent = _local_logprobs(model, tok, targets, positions, temperature, chunk_tokens, True)
    logprobs = gather_sequence(parallel_dims, lp.float(), positions)[:, :-1]
    return logprobs, _masked_mean_entropy(parallel_dims, ent, local_mask)


def forwards(parallel_dims, forward: Callable, reference: Callable) -> tuple[Callable, Callable]:
    """The trainer's ``(forward terms, reference log-probs)``: its own
    (``forward``, ``reference``) without CP, this module's under CP."""
    if not getattr(parallel_dims, "cp_enabled", False):
        return forward, reference
    return functools.partial(forward_terms, parallel_dims), functools.partial(reference_logprobs, parallel_dims)


@torch.no_grad()
def reference_logprobs(parallel_dims, reference: nn.Module, tokens: torch.Tensor, temperature: float,
                       chunk_tokens: int, amp: contextlib.AbstractContextManager) -> torch.Tensor:
    """``[B, T - 1]`` log-probs of ``tokens[:, 1:]`` under the frozen reference
    (laid out with CP like the policy, see ``offpolicy.build_reference``)."""
    tok, targets, positions, _ = shard_batch(parallel_dims, tokens)
    with amp:
        lp, _ = _local_logprobs(reference, tok, targets, positions, temperature, chunk_tokens, False)
    return gather_sequence(parallel_dims, lp.float(), positions)[:, :-1]

