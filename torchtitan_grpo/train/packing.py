"""Packed micro-batches (``grpo.micro_batch_tokens``): samples concatenated
into rows of at most that many tokens, each attending only within itself.

A padded micro-batch is ``[samples, longest]``: with a long tail of lengths
(a few 16k completions among many short ones) most of it is padding. Here a
micro-batch is one row ``[1, L]`` holding several whole samples back to back;
no sample is split, and a sample longer than the budget gets a row of its own.

Three pieces:

* :func:`plan` -- which samples share a row (first-fit decreasing);
* :func:`pack_row` -- the row's model inputs: tokens, per-token positions
  (restarting at 0 per sample: RoPE through the ``positions`` argument that
  TorchTitan's qwen3 and llama3 forwards take), document ids, next-token
  targets, and the index that brings per-token outputs back to the loss's
  ``[samples, T - 1]`` layout;
* :func:`use_document_attention` -- switches a built model's attention to
  TorchTitan's ``attn_type = "flex"`` branch with this module's inner
  attention, which takes the row's :class:`BlockMask` (causal and same
  document): compiled ``flex_attention`` on CUDA (whole blocks of other
  samples are skipped), SDPA with the mask made dense elsewhere (flex
  attention has no backward on CPU).

The loss is not touched: a row's per-token log-probs (and entropy) are
gathered back to the padded sample layout that ``trainer._pack`` builds for
the same samples (mask, rollout log-probs, advantages), and the loss runs on
that as it does for a padded micro-batch. Every aggregation, IS mode and
normaliser is then the padded path's by construction; the gather costs one
float per token, not per vocabulary entry.

Why not TorchTitan's own routes: its ``get_attention_masks`` finds document
boundaries from EOS tokens (a completion may end without one, and a prompt
may contain one), and its ``"varlen"`` wrapper calls ``varlen_attn`` without
``enable_gqa`` (Qwen3 and Llama 3 use GQA), needs CUDA, and compiles with
max-autotune for every new row length; its flex wrapper also autotunes per
shape. The block tables here are built from the document ids directly
(``O((L / 128)^2)`` small ops, nothing ``L x L``), so no mask is compiled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from torchtitan_grpo.train import loss as grpo_losses
from torchtitan_grpo.train import token_logprobs

__all__ = ["PackedRow", "check_layout", "forward_terms", "pack_row", "plan", "reference_logprobs",
           "use_document_attention"]

BLOCK = 128
"""flex attention's tile (its default sparse block size): the unit of the block tables."""

CUDA_ROW_MULTIPLE = BLOCK
"""Rows on CUDA are padded to a multiple of this many tokens (a padding
document of its own): few distinct shapes for the compiled attention, at
most 127 extra tokens a row."""


# ----------------------------------------------------------------- the plan

def plan(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Sample indices per row: every row's lengths sum to at most ``budget``,
    except a row holding one sample longer than it.

    First-fit decreasing: longest first, each into the first row with room,
    else a new row. It uses at most 11/9 of the fewest rows possible (+1),
    and the long samples, which set the step's cost, are placed first, so
    short ones fill the gaps they leave. Deterministic (ties by index), and
    O(samples x rows) list work, nothing on the device. Within a row,
    samples keep the order they were placed in (longest first).
    """
    if budget <= 0:
        raise ValueError(f"grpo.micro_batch_tokens must be > 0 to pack, got {budget}")
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(budget - n)  # negative for an oversized sample: nothing else fits
    return rows


# ---------------------------------------------------------------- one row

@dataclass
class PackedRow:
    """One packed micro-batch, ``[1, L]`` tensors on the device."""

    tokens: torch.Tensor
    """``[1, L]`` token ids, samples back to back, then padding (its own document)."""
    positions: torch.Tensor
    """``[1, L]`` position of each token within its sample (RoPE)."""
    document_ids: torch.Tensor
    """``[L]`` which sample each token belongs to (``len(offsets)`` for the padding)."""
    targets: torch.Tensor
    """``[1, L]`` the next token of the same sample (0 at a sample's last token and on padding)."""
    index: torch.Tensor
    """``[n, T - 1]``: the row position whose output scores sample ``i``'s token
    ``t + 1`` (``trainer._pack``'s layout, ``T`` its longest sample); positions
    past a sample's end point at its first token (finite values, zero mask)."""
    offsets: list[int]
    """Where each sample starts in the row."""
    lengths: list[int]
    """Each sample's tokens (prompt + completion)."""
    block_mask: BlockMask
    """Causal attention within each document, for the model's ``attention_masks``."""

    def to_samples(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, L, ...]`` per-token values -> ``[n, T - 1, ...]`` in the loss's
        sample layout (differentiable: a gather)."""
        flat = self.index.reshape(-1)
        return x[0].index_select(0, flat).view(*self.index.shape, *x.shape[2:])

    def per_token(self, values: Sequence[torch.Tensor], fill: float | int) -> torch.Tensor:
        """``[1, L, ...]``: sample ``i``'s per-position ``values[i]`` (``[m_i, ...]``,
        ``m_i <= lengths[i]``, from the sample's first token on) laid out like
        ``tokens``, ``fill`` elsewhere. The layout a per-token model input
        takes (e.g. MoE router replay's routes, ``[len - 1, layers, top_k]``)."""
        first = values[0]
        out = torch.full((self.tokens.shape[1], *first.shape[1:]), fill, dtype=first.dtype,
                         device=self.tokens.device)
        for off, n, v in zip(self.offsets, self.lengths, values):
            if v.shape[0] > n:
                raise ValueError(f"per_token: {v.shape[0]} values for a sample of {n} tokens")
            out[off : off + v.shape[0]] = v.to(out.device)
        return out.unsqueeze(0)

    def model_kwargs(self) -> dict[str, object]:
        """What the model's forward takes besides the tokens."""
        return {"attention_masks": self.block_mask, "positions": self.positions}


def pack_row(sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device | str,
             multiple: int = 1) -> PackedRow:
    """The packed inputs of one row of ``sequences`` (each a sample's prompt +
    completion ids), padded to a multiple of ``multiple`` tokens."""
    lengths = [len(s) for s in sequences]
    if min(lengths, default=0) < 2:
        raise ValueError("pack_row: every sample needs at least 2 tokens (a prompt token and a completion token)")
    used = sum(lengths)
    total = -(-used // multiple) * multiple
    n = len(sequences)
    tokens, positions, docs, targets, offsets = [], [], [], [], []
    for i, seq in enumerate(sequences):
        offsets.append(len(tokens))
        tokens += seq
        positions += range(len(seq))
        docs += [i] * len(seq)
        targets += [*seq[1:], 0]
    pad = total - used
    tokens += [pad_id] * pad
    positions += [0] * pad  # within the RoPE table whatever training.seq_len is
    docs += [n] * pad
    targets += [0] * pad
    width = max(max(lengths), 2) - 1  # trainer._pack's T - 1
    t = torch.arange(width)
    off, ln = torch.tensor(offsets), torch.tensor(lengths)
    index = torch.where(t[None, :] < (ln - 1)[:, None], off[:, None] + t[None, :], off[:, None])
    doc = torch.tensor(docs, dtype=torch.int32, device=device)
    return PackedRow(
        tokens=torch.tensor(tokens, dtype=torch.long).view(1, -1).to(device),
        positions=torch.tensor(positions, dtype=torch.long).view(1, -1).to(device),
        document_ids=doc,
        targets=torch.tensor(targets, dtype=torch.long).view(1, -1).to(device),
        index=index.to(device),
        offsets=offsets,
        lengths=lengths,
        block_mask=document_block_mask(doc),
    )


def document_block_mask(doc: torch.Tensor, block: int = BLOCK) -> BlockMask:
    """Causal, same-document attention over a row whose document ids ``doc``
    (``[L]``) are contiguous runs 0, 1, 2, ... .

    A (query block, key block) tile is skipped when their documents do not
    meet, computed without its mask (full) when both blocks lie in one and
    the same document and the key block is earlier, and masked token by token
    otherwise.
    """
    length = doc.numel()
    nb = -(-length // block)
    # a tail past L gets a document of its own; the mask indexes this padded copy
    padded = torch.cat([doc, (doc[-1:] + 1).expand(nb * block - length)])  # no host sync
    blocks = padded.view(nb, block)
    lo, hi = blocks[:, 0], blocks[:, -1]
    q = torch.arange(nb, device=doc.device)[:, None]
    k = torch.arange(nb, device=doc.device)[None, :]
    meets = (k <= q) & (lo[None, :] <= hi[:, None]) & (hi[None, :] >= lo[:, None])
    single = lo == hi
    full = (k < q) & single[:, None] & single[None, :] & (lo[:, None] == lo[None, :])
    partial = meets & ~full

    def tables(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the tile columns in use first (ascending), then the rest
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True)
        return m.sum(-1).to(torch.int32)[None, None], order.to(torch.int32)[None, None]

    def same_document(b, h, q_idx, kv_idx):
        return (padded[q_idx] == padded[kv_idx]) & (q_idx >= kv_idx)

    return BlockMask.from_kv_blocks(*tables(partial), *tables(full), BLOCK_SIZE=block, mask_mod=same_document,
                                    seq_lengths=(length, length))


# ------------------------------------------------------------- attention

_compiled_flex = None


def _flex():
    """``flex_attention`` compiled once per process (fused, tile-skipping kernels)."""
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


class DocumentAttention(nn.Module):
    """The inner attention of TorchTitan's ``attn_type = "flex"`` branch: ``q, k,
    v`` ``[B, heads, L, head_dim]`` and the row's :class:`BlockMask`."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_mask: BlockMask,
                scale: float | None = None, enable_gqa: bool = False, **_: object) -> torch.Tensor:
        if q.is_cuda and q.shape[-1] >= 16:  # the flex kernels' smallest head
            return _flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
        # no flex backward on CPU: the mask made dense (fine at CPU and toy sizes)
        idx = torch.arange(q.shape[-2], device=q.device)
        dense = block_mask.mask_mod(0, 0, idx[:, None], idx[None, :])
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale,
                                                          enable_gqa=enable_gqa)


def use_document_attention(model: nn.Module) -> int:
    """Make every attention layer of ``model`` (TorchTitan qwen3 / llama3, FSDP-,
    DDP- or AC-wrapped) take packed rows: its forward then needs
    ``attention_masks`` (a row's block mask) and ``positions``. Returns the
    number of layers switched; a model without TorchTitan's ``attn_type``
    switch is refused."""
    layers = [m for m in model.modules() if hasattr(m, "attn_type") and hasattr(m, "inner_attention")]
    if not layers:
        raise ValueError(f"grpo.micro_batch_tokens: {type(model).__name__} has no TorchTitan attention layers "
                         "(attn_type / inner_attention) to pack; set grpo.micro_batch_tokens = 0")
    for m in layers:
        m.attn_type = "flex"
        m.inner_attention = DocumentAttention()
    return len(layers)


def check_layout(job_config) -> None:
    """Refuse, in one line naming the key, the layouts packing cannot run in."""
    budget = job_config.grpo.micro_batch_tokens
    p = job_config.parallelism
    why = None
    if budget < 0:
        why = f"must be >= 0, got {budget}"
    elif p.pipeline_parallel_degree > 1:
        why = "packed rows do not go through the pipeline schedule (pipeline_parallel_degree > 1)"
    elif p.tensor_parallel_degree > 1:
        why = "the document-masked attention has no tensor-parallel sharding (tensor_parallel_degree > 1)"
    elif getattr(p, "context_parallel_degree", 1) > 1:
        why = "not with context parallelism (context_parallel_degree > 1)"
    if why and budget:
        raise ValueError(f"grpo.micro_batch_tokens = {budget}: {why}; set it to 0 for padded micro-batches")


# --------------------------------------------------------- forward terms

def forward_terms(model: nn.Module, row: PackedRow, mask: torch.Tensor, temperature: float, chunk_tokens: int,
                  amp: contextlib.AbstractContextManager) -> tuple[torch.Tensor, torch.Tensor | float]:
    """``(log-probs, masked mean entropy)`` of a packed row, the log-probs in
    the loss's ``[n, T - 1]`` sample layout (``mask`` is in that layout too);
    the trainer's ``_forward_terms`` for a row."""
    if chunk_tokens:
        with amp, token_logprobs.logprob_head(model.output, row.targets, temperature, chunk_tokens,
                                              with_entropy=True) as head:
            logprobs = model(row.tokens, **row.model_kwargs())
        per_token_entropy = head.entropy
    else:
        with amp:
            logits = model(row.tokens, **row.model_kwargs()).float()
        logprobs = grpo_losses.token_logprobs(logits, row.targets, temperature)
        with torch.no_grad():
            per_token_entropy = _entropy(logits, temperature)
        del logits
    entropy = (row.to_samples(per_token_entropy) * mask).sum() / mask.sum().clamp(min=1.0)
    return row.to_samples(logprobs), entropy


def _entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[1, L]`` entropy of each position's sampling distribution, a few
    thousand positions at a time (float32 temporaries of that x vocabulary)."""
    out = []
    for z in logits[0].split(max(1, (1 << 25) // logits.shape[-1])):
        if temperature > 0 and temperature != 1.0:
            z = z / temperature
        logp = torch.log_softmax(z, dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out).unsqueeze(0)


@torch.no_grad()
def reference_logprobs(reference: nn.Module, row: PackedRow, temperature: float, chunk_tokens: int,
                       amp: contextlib.AbstractContextManager) -> torch.Tensor:
    """``[n, T - 1]`` log-probs of the row's samples under the frozen reference (KL penalty)."""
    with amp:
        if chunk_tokens:
            with token_logprobs.logprob_head(reference.output, row.targets, temperature, chunk_tokens):
                lp = reference(row.tokens, **row.model_kwargs())
        else:
            lp = grpo_losses.token_logprobs(reference(row.tokens, **row.model_kwargs()).float(), row.targets,
                                            temperature)
    return row.to_samples(lp)
