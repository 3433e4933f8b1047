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

The same config key (``grpo.loss_agg``) also selects two losses with their own
objective and a fixed reduction (``POLICY_LOSSES``):

* ``"gspo"`` (:func:`gspo_loss`, GSPO, Qwen 2025): one importance ratio per
  completion, the geometric mean of its token ratios, clipped per
  completion; mean over completions (``num_sequences``).
* ``"cispo"`` (:func:`cispo_loss`, CISPO, MiniMax-M1 2025): a clipped,
  stop-gradient importance weight on every token's log-prob (no token loses
  its gradient); sum over tokens / ``num_tokens``.

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
POLICY_LOSSES = ("gspo", "cispo")
LOSS_VARIANTS = LOSS_AGGREGATIONS + POLICY_LOSSES
"""Every value of ``grpo.loss_agg``: the clipped-surrogate aggregations, then GSPO and CISPO."""
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
        hint = f" ({loss_agg!r} is its own function: {loss_agg}_loss)" if loss_agg in POLICY_LOSSES else ""
        raise ValueError(f"loss_agg={loss_agg!r}; expected one of {LOSS_AGGREGATIONS}{hint}")
    if loss_agg == "seq_mean_token_sum_norm" and not max_completion_len:
        raise ValueError("loss_agg='seq_mean_token_sum_norm' needs max_completion_len > 0")
    _check_common(logprobs, advantages, kl_estimator)

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

    kl = _kl_tokens(logprobs, ref_logprobs, mask, kl_coef, kl_estimator)
    total_token_loss = token_loss if kl is None else token_loss + kl_coef * kl

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
            **_ratio_metrics(ratio, mask, clipped, low, high, n),
        }
        if kl is not None:
            metrics["kl"] = (kl * mask).sum() / n
    return loss, metrics


def _check_common(logprobs, advantages, kl_estimator):
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator={kl_estimator!r}; expected one of {KL_ESTIMATORS}")
    if advantages.dim() != 1 or advantages.shape[0] != logprobs.shape[0]:
        raise ValueError(
            f"advantages must be [B]={logprobs.shape[0]}, got {tuple(advantages.shape)}"
        )


def _kl_tokens(logprobs, ref_logprobs, mask, kl_coef, kl_estimator):
    """Per-token KL estimate to the reference (0 outside the mask), or None when off."""
    if ref_logprobs is None or kl_coef == 0.0:
        return None
    delta = torch.where(mask > 0, ref_logprobs.detach() - logprobs, 0.0)
    return -delta if kl_estimator == "k1" else torch.exp(delta) - delta - 1.0


def _ratio_metrics(ratio, counted, clipped, low, high, n):
    """Clip fractions and ratio statistics over the ``counted`` units (tokens or sequences)."""
    return {
        "clip_fraction": (clipped * counted).sum() / n,
        "clip_low_fraction": (low * counted).sum() / n,
        "clip_high_fraction": (high * counted).sum() / n,
        "ratio_mean": (ratio * counted).sum() / n,
        "ratio_max": torch.where(counted > 0, ratio, 0.0).max()
        if counted.numel()
        else n.new_zeros(()),
    }


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    num_sequences: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: a clipped surrogate on one importance ratio per completion (to minimise).

    For completion ``i`` with loss tokens ``t`` (``mask``), ``|y_i|`` of them,
    and advantage ``A_i``::

        s_i    = exp( sum_t (logprobs_t - old_t) / |y_i| )     (geometric mean of the token ratios)
        loss_i = max(-A_i * s_i, -A_i * clip(s_i, 1 - clip_low, 1 + clip_high))
        loss_i = loss_i * W_i                                   (if is_weights is given)
        loss_i = loss_i + kl_coef * sum_t kl_t / |y_i|          (if kl_coef > 0)
        loss   = sum_i loss_i / num_sequences

    Completions without a loss token contribute nothing. The objective is
    written with the per-token log-probs, so autograd gives GSPO's gradient:
    where the unclipped branch is taken, ``d loss_i / d logprobs_t = -A_i * s_i
    / |y_i|``, i.e. ``s_i`` (a value, not differentiated on its own) times the
    mean of the token score functions; a clipped completion gets no gradient
    through its ratio. GSPO's clip range is narrow because ``s_i`` is a
    length-normalised mean (the paper uses about 3e-4 / 4e-4).

    Rollout IS correction (``is_weights``, detached, from :func:`is_weights`):
    the ratio is sequence-level, so the correction is too: a ``[B]`` weight
    (or a ``[B, T]`` one that is constant along each row, what
    ``mode="sequence"`` gives) is used as the completion's ``W_i``; a per-token
    ``[B, T]`` weight (``mode="token"``) is reduced to its geometric mean over
    the completion's loss tokens, ``W_i = exp(sum_t log w_t / |y_i|)``, the
    same length normalisation as ``s_i``. When ``old_logprobs`` are the
    rollout log-probs (``grpo.is_correction = "none"``), ``s_i`` is itself the
    ratio against the behaviour policy and no weight is needed.

    Args:
        logprobs: ``[B, T]`` current-policy log-probs (with gradient).
        old_logprobs: ``[B, T]`` log-probs of the trust region's centre (no gradient).
        advantages: ``[B]`` one advantage per completion.
        mask: ``[B, T]`` 1 on the loss tokens (0 on prompt, padding, untrained tokens).
        num_sequences: the global normaliser (module doc); defaults to the
            local number of completions with a loss token.
        ref_logprobs / kl_coef / kl_estimator: the KL penalty as in :func:`grpo_loss`,
            averaged over each completion's tokens like ``s_i``'s log-ratio.
        is_weights: ``[B]`` or ``[B, T]`` detached IS weights (above).

    Returns:
        ``(loss, metrics)``, metrics detached 0-dim tensors over the local
        completions with a loss token: ``pg_loss``, ``clip_fraction``
        (completions whose clipped branch was taken), ``clip_low_fraction``,
        ``clip_high_fraction``, ``ratio_mean`` / ``ratio_max`` (of ``s_i``),
        ``clip_units`` (that number of completions) and, with a KL term,
        ``kl`` (mean over tokens).
    """
    _check_common(logprobs, advantages, kl_estimator)
    mask = mask.to(logprobs.dtype)
    lengths = mask.sum(-1)  # [B]
    has_tokens = lengths > 0
    per_len = lengths.clamp(min=1.0)
    adv = advantages.to(logprobs.dtype)
    # Padding may hold anything (even -inf): zero it before the sum.
    log_ratio = torch.where(mask > 0, logprobs - old_logprobs.detach(), 0.0)
    seq_ratio = torch.exp(log_ratio.sum(-1) / per_len)  # [B]
    clipped_ratio = torch.clamp(seq_ratio, 1.0 - clip_low, 1.0 + clip_high)
    unclipped_loss = -adv * seq_ratio
    clipped_loss = -adv * clipped_ratio
    seq_loss = torch.maximum(unclipped_loss, clipped_loss)
    if is_weights is not None:
        w = is_weights.detach().to(logprobs.dtype)
        if w.dim() == 2:  # geometric mean over the loss tokens (a constant row keeps its value)
            log_w = torch.where(mask > 0, torch.log(w.clamp(min=torch.finfo(w.dtype).tiny)), 0.0)
            w = torch.exp(log_w.sum(-1) / per_len)
        seq_loss = seq_loss * w

    kl = _kl_tokens(logprobs, ref_logprobs, mask, kl_coef, kl_estimator)
    total = seq_loss if kl is None else seq_loss + kl_coef * (kl * mask).sum(-1) / per_len
    if num_sequences is None:
        num_sequences = has_tokens.sum().clamp(min=1).to(logprobs.dtype)
    # where, not a product: a row without tokens may carry any advantage (even NaN).
    loss = torch.where(has_tokens, total, 0.0).sum() / num_sequences

    with torch.no_grad():
        counted = has_tokens.to(mask.dtype)
        n_seq = counted.sum().clamp(min=1.0)
        clipped = (clipped_loss > unclipped_loss).to(mask.dtype)
        low = clipped * (seq_ratio < 1.0 - clip_low).to(mask.dtype)
        high = clipped * (seq_ratio > 1.0 + clip_high).to(mask.dtype)
        metrics = {
            "pg_loss": torch.where(has_tokens, seq_loss.detach(), 0.0).sum() / num_sequences,
            **_ratio_metrics(seq_ratio.detach(), counted, clipped, low, high, n_seq),
            "clip_units": counted.sum(),
        }
        if kl is not None:
            metrics["kl"] = (kl * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, metrics


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 1.0,
    clip_high: float = 0.28,
    num_tokens: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: clipped, stop-gradient importance weights on every token (to minimise).

    Per loss token, with ``A_i`` the completion's advantage::

        r_t    = exp(logprobs_t - old_t)
        rhat_t = clip(r_t, 1 - clip_low, 1 + clip_high)        (detached: a weight, no gradient)
        loss_t = -rhat_t * A_i * logprobs_t
        loss_t = loss_t * w_t                                    (if is_weights is given)
        loss_t = loss_t + kl_coef * kl_t                         (if kl_coef > 0)
        loss   = sum_t loss_t / num_tokens

    so ``d loss / d logprobs_t = -rhat_t * A_i / num_tokens`` on *every* loss
    token: unlike the PPO clip, a token outside the range keeps its gradient,
    with a bounded weight. The value is a weighted log-likelihood, not a
    surrogate near ``-A``: it is not comparable with :func:`grpo_loss`'s.

    Defaults: ``clip_low = 1.0`` puts the lower bound at 0, i.e. no lower
    clip (MiniMax-M1 sets the lower epsilon large and tunes only the upper
    one): a token whose probability fell is weighted by its own small ratio.
    ``clip_high = 0.28`` caps a weight at 1.28, the upper edge DAPO's
    clip-higher range gives the PPO losses here, so switching from DAPO to
    CISPO keeps the same upper bound while clipped tokens keep a gradient.

    Rollout IS correction: ``r_t`` against the rollout log-probs
    (``grpo.is_correction = "none"``) is already the truncated importance
    weight ``pi / pi_rollout`` against the behaviour policy, so nothing else
    is needed. With ``"token"`` / ``"sequence"`` the trainer centres ``old``
    on its own log-probs (``r_t = 1``) and the gap to the rollout policy is
    the detached ``is_weights`` (``[B, T]`` or ``[B]``), multiplied in as
    ``w_t``: the product ``rhat_t * w_t`` splits ``pi / pi_rollout`` into
    two truncated factors and never counts one twice.

    Args:
        logprobs / old_logprobs / advantages / mask: as in :func:`grpo_loss`.
        num_tokens: the global normaliser (module doc); defaults to the
            local number of loss tokens.
        ref_logprobs / kl_coef / kl_estimator: the KL penalty as in :func:`grpo_loss`.
        is_weights: ``[B, T]`` or ``[B]`` detached IS weights.

    Returns:
        ``(loss, metrics)``, metrics detached 0-dim tensors over the local
        loss tokens: ``pg_loss``, ``clip_fraction`` (tokens whose weight was
        clipped; they still get a gradient), ``clip_low_fraction``,
        ``clip_high_fraction``, ``ratio_mean``, ``ratio_max``, ``clip_units``
        (the number of loss tokens) and, with a KL term, ``kl``.
    """
    _check_common(logprobs, advantages, kl_estimator)
    mask = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)  # [B, 1]
    with torch.no_grad():
        ratio = torch.exp(torch.where(mask > 0, logprobs - old_logprobs, 0.0))
        weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    # -inf log-probs on padding: where keeps them (and their gradient) out.
    token_loss = -weight * adv * torch.where(mask > 0, logprobs, 0.0)
    if is_weights is not None:
        w = is_weights.detach().to(logprobs.dtype)
        token_loss = token_loss * (w.unsqueeze(-1) if w.dim() == 1 else w)
    kl = _kl_tokens(logprobs, ref_logprobs, mask, kl_coef, kl_estimator)
    total = token_loss if kl is None else token_loss + kl_coef * kl
    denom = mask.sum().clamp(min=1.0) if num_tokens is None else num_tokens
    # where: a row without tokens may carry any advantage (even NaN).
    loss = torch.where(mask > 0, total, 0.0).sum() / denom

    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        low = (ratio < 1.0 - clip_low).to(mask.dtype)
        high = (ratio > 1.0 + clip_high).to(mask.dtype)
        metrics = {
            "pg_loss": torch.where(mask > 0, token_loss.detach(), 0.0).sum() / denom,
            **_ratio_metrics(ratio, mask, low + high, low, high, n),
            "clip_units": mask.sum(),
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
    "LOSS_VARIANTS",
    "POLICY_LOSSES",
    "cispo_loss",
    "entropy_from_logits",
    "grpo_loss",
    "gspo_loss",
    "is_weights",
    "token_logprobs",
]
