"""GRPO policy loss, its aggregations, and importance-sampling correction.

Everything here is plain torch on ``[B, T]`` tensors: ``B`` completions (rows),
``T`` completion positions, and a ``mask`` (float or bool) that is 1 on the
completion tokens the loss should see and 0 on prompt/padding positions.

Aggregations (``loss_agg``):

* ``"seq_mean_token_mean"`` (GRPO): mean over the tokens of each completion,
  then mean over completions.
* ``"token_mean"`` (DAPO): one mean over every completion token of the batch,
  so long completions weigh more than short ones.
* ``"seq_mean_token_sum_norm"`` (Dr. GRPO): sum over the tokens of each
  completion divided by a constant ``max_completion_len``, then mean over
  completions; no length bias from the per-sequence mean.

Micro-batching and data parallelism
-----------------------------------
Every aggregation is written as ``sum(per-row or per-token terms) / N`` where
``N`` is a count: ``num_sequences`` (rows with at least one completion token)
or ``num_tokens`` (completion tokens). Both default to the local counts of the
tensors passed in. To make gradient accumulation over micro-batches and data
parallel ranks give the same gradient as one big batch, the trainer should:

1. count ``N`` over the *whole* optimizer step (all micro-batches of all DP
   ranks; one all-reduce of two integers before the first forward), and pass
   it as ``num_sequences`` / ``num_tokens`` to every micro-batch call;
2. call ``backward()`` on each micro-batch loss as is (no further division by
   the number of micro-batches): the sum of the micro-batch losses is then the
   full-batch loss;
3. make the data-parallel gradient reduction a *sum* (FSDP2:
   ``set_force_sum_reduction_for_comms(True)``), or, if it stays FSDP2's
   default *average*, multiply the loss by the DP degree before ``backward()``.
"""

from __future__ import annotations

import torch

LOSS_AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k3")
IS_MODES = ("token", "sequence")


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of each target token under ``softmax(logits / temperature)``.

    Args:
        logits: ``[B, T, V]`` (any float dtype; the math runs in float32).
        targets: ``[B, T]`` token ids, aligned with ``logits`` (the caller shifts).
        temperature: the sampling temperature the rollout used; ``0`` (greedy)
            and ``1`` leave the logits unscaled.

    Returns:
        ``[B, T]`` float32 log-probabilities, differentiable w.r.t. ``logits``.
    """
    x = logits.float()  # a no-op for float32 logits, one copy for bf16
    if temperature > 0 and temperature != 1.0:
        # Divide in place on the float copy when there is one, so bf16 logits
        # cost one [B, T, V] float tensor rather than two. The cast's backward
        # does not need its output, so the in-place op is autograd-safe.
        x = x.div_(temperature) if x is not logits else x / temperature
    # gather + logsumexp instead of log_softmax: log_softmax would materialise
    # a full [B, T, V] output only to read one entry per position.
    picked = x.gather(-1, targets.unsqueeze(-1).long()).squeeze(-1)
    return picked - torch.logsumexp(x, dim=-1)


_ENTROPY_CHUNK_ELEMENTS = 1 << 25
"""Logits entries per entropy chunk: 128 MiB per float32 temporary."""


@torch.no_grad()
def entropy_from_logits(
    logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Mean entropy (nats) of the sampling distribution over the masked tokens.

    A metric only (no gradient). Rows are processed a few at a time so the
    float32 temporaries stay near ``_ENTROPY_CHUNK_ELEMENTS`` (one ``[T, V]``
    row when a row alone is larger) rather than ``[B, T, V]``; a chunk is as
    many rows as fit, since a few ops per row cost more than the math on a
    small vocabulary. Returns a 0-dim float32 tensor; 0 when the mask is empty.
    """
    mask = mask.float()
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    rows = max(1, _ENTROPY_CHUNK_ELEMENTS // max(logits.shape[1] * logits.shape[2], 1))
    for chunk_logits, chunk_mask in zip(logits.split(rows), mask.split(rows)):
        x = chunk_logits.float()
        if temperature > 0 and temperature != 1.0:
            x = x / temperature
        logp = torch.log_softmax(x, dim=-1)
        ent = -(logp.exp() * logp).sum(-1)  # [rows, T]
        total += (ent * chunk_mask).sum()
    return total / mask.sum().clamp(min=1.0)


def _aggregate(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_agg: str,
    max_completion_len: int | None,
    num_sequences: float | None,
    num_tokens: float | None,
) -> torch.Tensor:
    """Reduce masked per-token losses ``[B, T]`` to a scalar (see module doc)."""
    masked = token_loss * mask
    if loss_agg == "token_mean":
        denom = mask.sum().clamp(min=1.0) if num_tokens is None else num_tokens
        return masked.sum() / denom

    lengths = mask.sum(-1)  # [B]
    if num_sequences is None:
        # Rows with no completion token (padding rows) are not sequences.
        num_sequences = (lengths > 0).sum().clamp(min=1).float()
    if loss_agg == "seq_mean_token_mean":
        # clamp: an empty row has a zero sum, and 0/1 keeps it NaN-free.
        per_seq = masked.sum(-1) / lengths.clamp(min=1.0)
    else:  # seq_mean_token_sum_norm
        per_seq = masked.sum(-1) / max_completion_len
    return per_seq.sum() / num_sequences


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    loss_agg: str = "seq_mean_token_mean",
    max_completion_len: int | None = None,
    num_sequences: float | None = None,
    num_tokens: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped-surrogate GRPO loss (to minimise) and its metrics.

    Per token, with ``r = exp(logprobs - old_logprobs)`` and ``A`` the
    completion's advantage::

        loss_t = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))
        loss_t = loss_t * is_weight_t            (if is_weights is given)
        loss_t = loss_t + kl_coef * kl_t         (if kl_coef > 0)

    then reduced by ``loss_agg`` (module doc). ``clip_high > clip_low`` is
    DAPO's "clip-higher".

    Args:
        logprobs: ``[B, T]`` current-policy log-probs (with gradient).
        old_logprobs: ``[B, T]`` log-probs of the policy that defines the trust
            region (the trainer's weights at rollout time); no gradient.
        advantages: ``[B]`` one advantage per completion.
        mask: ``[B, T]`` 1 on completion tokens.
        max_completion_len: required by ``seq_mean_token_sum_norm``.
        num_sequences / num_tokens: global normalisers (module doc); default
            to the local counts.
        ref_logprobs: ``[B, T]`` reference-policy log-probs for the KL penalty.
        kl_estimator: ``"k1"`` (``log p - log ref``) or ``"k3"``
            (``exp(ref - p) - (ref - p) - 1``, non-negative, unbiased).
        is_weights: ``[B, T]`` or ``[B]`` detached importance weights from
            :func:`is_weights`, multiplied into the policy-gradient term.

    Returns:
        ``(loss, metrics)``; metrics are detached 0-dim tensors (local means
        over masked tokens), ready to be all-reduced or logged:
        ``pg_loss``, ``clip_fraction`` (tokens whose clipped branch was taken),
        ``clip_low_fraction``, ``clip_high_fraction``, ``ratio_mean``,
        ``ratio_max`` and, with a KL term, ``kl``.
    """
    if loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_agg={loss_agg!r}; expected one of {LOSS_AGGREGATIONS}")
    if loss_agg == "seq_mean_token_sum_norm" and not max_completion_len:
        raise ValueError("loss_agg='seq_mean_token_sum_norm' needs max_completion_len > 0")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator={kl_estimator!r}; expected one of {KL_ESTIMATORS}")
    if advantages.dim() != 1 or advantages.shape[0] != logprobs.shape[0]:
        raise ValueError(
            f"advantages must be [B]={logprobs.shape[0]}, got {tuple(advantages.shape)}"
        )

    mask = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)  # [B, 1]
    # Padding positions may hold anything (even -inf); zero their log-ratio so
    # exp() stays finite and 0 * inf never reaches the sum.
    log_ratio = torch.where(mask > 0, logprobs - old_logprobs.detach(), 0.0)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * clipped_ratio
    token_loss = torch.maximum(unclipped_loss, clipped_loss)
    if is_weights is not None:
        w = is_weights.detach().to(logprobs.dtype)
        token_loss = token_loss * (w.unsqueeze(-1) if w.dim() == 1 else w)

    kl = None
    if ref_logprobs is not None and kl_coef != 0.0:
        delta = torch.where(mask > 0, ref_logprobs.detach() - logprobs, 0.0)
        kl = -delta if kl_estimator == "k1" else torch.exp(delta) - delta - 1.0
        total_token_loss = token_loss + kl_coef * kl
    else:
        total_token_loss = token_loss

    loss = _aggregate(
        total_token_loss, mask, loss_agg, max_completion_len, num_sequences, num_tokens
    )

    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        # The clipped branch is "active" where it is strictly the larger loss:
        # there the gradient through the ratio is zero.
        clipped = (clipped_loss > unclipped_loss).to(mask.dtype) * mask
        low = clipped * (ratio < 1.0 - clip_low).to(mask.dtype)
        high = clipped * (ratio > 1.0 + clip_high).to(mask.dtype)
        metrics = {
            "pg_loss": _aggregate(
                token_loss.detach(), mask, loss_agg, max_completion_len,
                num_sequences, num_tokens,
            ),
            "clip_fraction": clipped.sum() / n,
            "clip_low_fraction": low.sum() / n,
            "clip_high_fraction": high.sum() / n,
            "ratio_mean": (ratio * mask).sum() / n,
            "ratio_max": torch.where(mask > 0, ratio, 0.0).max()
            if mask.numel()
            else n.new_zeros(()),
        }
        if kl is not None:
            metrics["kl"] = (kl * mask).sum() / n
    return loss, metrics


def is_weights(
    train_old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token",
    cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights ``pi_train_old / pi_rollout`` (detached).

    Samples come from the inference engine's policy (stale version, different
    kernels), while the loss's trust region is centred on the trainer's
    ``old_logprobs``. Multiplying the loss by ``w = min(pi_old / pi_rollout, cap)``
    corrects for that mismatch; the cap bounds the variance.

    ``mode="token"``: one weight per token, ``exp(old_t - rollout_t)``.
    ``mode="sequence"``: one weight per completion,
    ``exp(sum_t mask_t * (old_t - rollout_t))``, broadcast over its tokens.

    Returns ``([B, T] weights, metrics)``. Weights are 1 outside the mask.
    Metrics (0-dim tensors, over masked tokens for ``token`` and non-empty rows
    for ``sequence``): ``is_weight_mean`` (after the cap), ``is_weight_max``
    (before the cap), ``is_capped_fraction``.
    """
    if mode not in IS_MODES:
        raise ValueError(f"is mode={mode!r}; expected one of {IS_MODES}")
    if cap <= 0:
        raise ValueError(f"is cap must be > 0, got {cap}")
    with torch.no_grad():
        # The inputs' precision (float32 at least): float64 log-probs keep float64 weights.
        dtype = torch.promote_types(
            torch.promote_types(train_old_logprobs.dtype, rollout_logprobs.dtype), torch.float32
        )
        mask = mask.to(dtype)
        log_w = torch.where(
            mask > 0, train_old_logprobs.to(dtype) - rollout_logprobs.to(dtype), 0.0
        )
        if mode == "sequence":
            log_w = log_w.sum(-1, keepdim=True)  # [B, 1]
            counted = (mask.sum(-1, keepdim=True) > 0).to(dtype)
        else:
            counted = mask
        # Clamp the exponent: a long sequence's log-ratio sum can overflow exp().
        raw = torch.exp(log_w.clamp(max=80.0))
        weights = raw.clamp(max=cap)
        n = counted.sum().clamp(min=1.0)
        metrics = {
            "is_weight_mean": (weights * counted).sum() / n,
            "is_weight_max": torch.where(counted > 0, raw, 0.0).max()
            if counted.numel()
            else n.new_zeros(()),
            "is_capped_fraction": ((raw > cap).to(dtype) * counted).sum() / n,
        }
        weights = torch.where(mask > 0, weights.expand_as(mask), 1.0)
    return weights, metrics


__all__ = [
    "LOSS_AGGREGATIONS",
    "entropy_from_logits",
    "grpo_loss",
    "is_weights",
    "token_logprobs",
]
