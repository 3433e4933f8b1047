"""Per-token log-probs and entropy from hidden states, a chunk of tokens at a time.

The GRPO loss needs, per token, ``log softmax(h @ W^T / temperature)[target]``
(and the entropy as a metric). Forming ``[rows, T, vocabulary]`` float32
logits for that costs ``4 * T * V`` bytes per row (16k tokens x 151,936
entries: ~10 GB), and as much again for their gradient. Here the tokens are
cut into chunks of ``chunk_tokens``: a chunk's logits are formed, upcast to
float32, reduced to a log-prob (and entropy) per token and freed; backward
forms each chunk's logits again instead of keeping them. Peak memory is
``O(chunk_tokens x V)``; what is saved for backward is the hidden states, the
weight and one float per token (its log-sum-exp).

Two entry points:

* :func:`chunked_logprobs` -- the computation, on plain tensors;
* :func:`logprob_head` -- makes a model's output projection (TorchTitan's
  ``model.output``) return log-probs instead of logits while active, so the
  model's own forward, and the hooks FSDP2 / DDP put on the module (all-gather
  before, reshard after, gradient reduce-scatter once backward is through),
  run exactly as they do around a plain ``nn.Linear`` call.

The head needs the whole ``[V, dim]`` weight on each rank: one device, FSDP2
(the module's unsharded weight inside its forward), HSDP, DDP. Under tensor
parallelism the weight is vocab-sharded (a DTensor) and is refused here; the
trainer keeps the full-logits path there, and under pipeline parallelism,
whose loss runs on the last stage's output inside the schedule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["HeadOutputs", "chunked_logprobs", "logprob_head"]


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits`` in at least float32, divided by the temperature (0 and 1:
    unscaled), in place where the cast already made a copy."""
    x = logits.to(_float(logits.dtype))
    if temperature > 0 and temperature != 1.0:
        x = x.div_(temperature) if x is not logits else x / temperature
    return x


def _float(dtype: torch.dtype) -> torch.dtype:
    """Where the softmax math runs: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` computes in where it is called:
    autocast's, when it is on for this device (one GPU, DDP), else the inputs'."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _ChunkedLogprobs(torch.autograd.Function):
    """``[N, dim]`` hidden, ``[V, dim]`` weight, ``[N]`` targets -> ``[N]`` float32
    (float64 for float64 inputs) log-probs (differentiable) and ``[N]`` entropy (or an empty tensor; never
    differentiable). Casts are explicit (autocast off inside) so that backward,
    which runs without autocast, recomputes exactly the forward's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, with_entropy):
        dtype = _compute_dtype(hidden, weight)
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=_float(dtype), device=hidden.device)
        lse = torch.empty_like(logprobs)
        entropy = torch.empty(n if with_entropy else 0, dtype=_float(dtype), device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                z = _scaled(nn.functional.linear(hidden[s:e].to(dtype), w), temperature)
                lse[s:e] = torch.logsumexp(z, dim=-1)
                logprobs[s:e] = z.gather(-1, targets[s:e, None]).squeeze(-1) - lse[s:e]
                if with_entropy:
                    logp = z.sub_(lse[s:e, None])  # z is ours: reuse it for log p
                    entropy[s:e] = -(logp.exp() * logp).sum(-1)
                del z
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.dtype, ctx.temperature, ctx.chunk = dtype, temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        dtype, temperature, chunk = ctx.dtype, ctx.temperature, ctx.chunk
        n = hidden.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None
        # accumulate in float32 (at least) whatever the compute dtype: one rounding at the end
        grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_w else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                h = hidden[s:e].to(dtype)
                g = grad_logprobs[s:e].to(lse.dtype)
                # d logprob / d z = onehot(target) - softmax(z), z = logits / temperature
                dz = _scaled(nn.functional.linear(h, w), temperature)
                dz.sub_(lse[s:e, None]).exp_().mul_(-g[:, None])
                dz.scatter_add_(-1, targets[s:e, None], g[:, None])
                if temperature > 0 and temperature != 1.0:
                    dz.div_(temperature)
                dz = dz.to(dtype)
                if need_h:
                    grad_h[s:e] = dz @ w
                if need_w:
                    if dtype == grad_w.dtype:
                        grad_w.addmm_(dz.t(), h)
                    else:
                        grad_w.add_(dz.t() @ h)
                del dz
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 2048,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each target under ``softmax(hidden @ weight^T / temperature)``,
    never holding more than ``chunk_tokens`` rows of logits.

    Args:
        hidden: ``[..., dim]`` final hidden states (after the final norm).
        weight: ``[V, dim]`` output projection (no bias), a plain tensor.
        targets: ``[...]`` token ids, aligned with ``hidden`` (the caller shifts).
        temperature: the rollout's sampling temperature; ``0`` and ``1`` leave
            the logits unscaled (as :func:`torchtitan_grpo.train.loss.token_logprobs`).
        chunk_tokens: tokens per chunk; the float32 temporaries are
            ``chunk_tokens x V``.
        with_entropy: also return each token's entropy (nats, no gradient).

    Returns:
        ``(logprobs, entropy)``: float32 tensors (float64 for float64 inputs)
        shaped like ``targets``;
        ``logprobs`` is differentiable w.r.t. ``hidden`` and ``weight``;
        ``entropy`` is None unless asked for. Matmuls run in the dtype
        ``F.linear`` would use there (autocast's, else the inputs').
    """
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor) or isinstance(hidden, DTensor):
        raise ValueError(
            "chunked log-probs need the whole output weight on each rank; a tensor-parallel "
            "(vocab-sharded) output projection takes grpo.logprob_chunk_tokens = 0"
        )
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} do not align")
    shape = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    logprobs, entropy = _ChunkedLogprobs.apply(
        flat_h, weight, targets.reshape(-1).long(), float(temperature), int(chunk_tokens), with_entropy
    )
    return logprobs.view(shape), entropy.view(shape) if with_entropy else None


@dataclass
class HeadOutputs:
    """What :func:`logprob_head` leaves besides the model's output."""

    entropy: torch.Tensor | None = None
    """``[B, T']`` per-token entropy of the last call (with ``with_entropy``)."""


@contextlib.contextmanager
def logprob_head(
    output: nn.Module,
    targets: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    with_entropy: bool = False,
) -> Iterator[HeadOutputs]:
    """While active, ``output(h)`` (``h``: ``[B, T, dim]``) returns the ``[B, T']``
    log-probs of ``targets`` (``[B, T']``, ``T' <= T``: position ``t`` scores
    ``targets[:, t]``) through :func:`chunked_logprobs`, instead of logits.

    ``output`` is the model's output projection (``nn.Linear`` without bias,
    FSDP2-wrapped or not); only its ``forward`` is replaced, so the hooks on
    the module and the model's own forward run unchanged. A model's forward
    that ends in ``self.output(h)`` (TorchTitan's llama3 and qwen3) then
    returns log-probs.
    """
    if getattr(output, "bias", None) is not None:
        raise ValueError("logprob_head: the output projection has a bias; chunked log-probs assume none")
    box = HeadOutputs()

    def forward(h: torch.Tensor) -> torch.Tensor:
        b, t = h.shape[0], h.shape[1]
        if targets.shape[0] != b or targets.shape[1] > t:
            raise ValueError(f"logprob_head: targets {tuple(targets.shape)} do not fit hidden {tuple(h.shape)}")
        # score all T positions (the extra ones against token 0, then dropped)
        # rather than slice h: a slice of [B, T, dim] would be copied to flatten
        full = nn.functional.pad(targets, (0, t - targets.shape[1]))
        lp, ent = chunked_logprobs(h, output.weight, full, temperature, chunk_tokens, with_entropy)
        box.entropy = None if ent is None else ent[:, : targets.shape[1]]
        return lp[:, : targets.shape[1]]

    had = output.__dict__.get("forward")
    output.forward = forward
    try:
        yield box
    finally:
        if had is None:
            del output.forward
        else:
            output.forward = had
