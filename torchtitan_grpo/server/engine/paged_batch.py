"""A KV batch on a pool of fixed-size blocks, with CUDA-graph decode steps.

The static batch (``server/engine/static_batch.py``) gives every slot ``max_len`` positions
up front: 64 slots x 16k positions of a Qwen3-4B shape is 154 GB, so it
cannot serve long samples. This batch keeps everything else of it (the
model's own modules, fused projections, the graph-safe MoE MLP, routes, graph
capture and replay; it subclasses it) and changes where keys and values live:

- **Blocks.** Each layer's K and V are one pool ``[blocks, block_size,
  kv_heads, head_dim]`` sized by a memory budget (``server/engine/kv_pool.py``). A row owns
  a list of blocks (its block table, one row of the device tensor
  ``_table``) and takes one more when its next position starts a block.
- **Decode over the rows' blocks.** A step runs rows ``[0, B)`` (rows are kept
  dense: no slots, a leaving row's table row is overwritten) over ``nb``
  blocks each. On a GPU with triton, ``server/engine/paged_attention.py``'s kernel reads
  the blocks through the table where they lie; elsewhere (CPU, no triton)
  the table indexes the pool into a copy ``[B, nb * block_size, kv_heads,
  head_dim]`` that SDPA reads with a per-row length mask. Each ``(B, nb)``
  pair has fixed shapes, captured once as a CUDA graph. Padding rows and
  table entries past a row's blocks point at the null block, so their
  writes land in no live sequence.
- **Admission and retraction** are decided here and carried out by the
  engine: :meth:`admissible` says how many queued sequences fit the free
  blocks now, :meth:`rows_to_retract` how many of the newest rows must give
  their blocks back so the next step fits (the engine requeues them at the
  front; they are re-prefilled from prompt + output, SGLang's retract).
- :meth:`refusal` names a request that could never fit the whole pool (the
  engine answers it with a 400 instead of retracting it for ever).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from torchtitan_grpo.server.engine import kv_pool, moe_routes, paged_attention
from torchtitan_grpo.server.engine.kv_pool import BLOCK_SIZE, BlockPool, blocks_for
from torchtitan_grpo.server.engine.static_batch import _BATCH_BUCKETS, StaticBatch, _bucket
from torchtitan_grpo.server.engine.to_device import upload

logger = logging.getLogger(__name__)

MAX_PREFILL_TOKENS = 16384
"""Most padded tokens (unique contexts x the longest) one admission prefills
(a longer context is still admitted, alone): bounds a prefill's activations."""
HEADROOM_TOKENS = 256
"""Admission keeps this much of a new sequence's remaining output (at most)
free beyond its context, plus one block per running row, so that a batch
admitted at the edge does not retract at its first steps."""


def _len_bucket(n: int, cap: int) -> int:
    # Steps of 64 positions up to 1024, then 8 buckets per doubling (at most
    # 12.5% of a step's gathered positions are past the longest row): a
    # 40k context takes ~60 length buckets, not the 160 of fixed steps.
    step = 64 if n <= 1024 else 1 << ((n - 1).bit_length() - 4)
    return min(-(-n // step) * step, cap)


class PagedBatch(StaticBatch):
    """The :class:`~torchtitan_grpo.server.engine.batch.KVBatch` of a block pool;
    decode steps are CUDA graphs on a GPU (``graphs``)."""

    shares_prompts = False  # each sample's blocks hold its own copy of the prompt, read through its own table

    def __init__(self, model: Any, device: torch.device, slots: int, max_len: int, num_blocks: int,
                 block_size: int = BLOCK_SIZE, graphs: bool = True, routes: bool = False,
                 max_prefill_tokens: int = MAX_PREFILL_TOKENS):
        if block_size < 1 or 64 % block_size:
            raise ValueError(f"block_size must divide 64 (the length buckets' step), got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size)
        self.max_blocks = blocks_for(max_len, block_size)
        self.max_prefill_tokens = max_prefill_tokens
        self.headroom_tokens = HEADROOM_TOKENS
        super().__init__(model, device, slots, max_len, graphs=graphs, routes=routes)
        self._table = torch.zeros((slots, self.max_blocks), dtype=torch.long, device=device)
        self._blocks: list[list[int]] = []  # per row: its block ids, in position order
        self._len: list[int] = []  # per row: cached positions (host mirror of _pos)

    def _new_cache(self, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        shape = (self.pool.num_blocks, self.block_size, self.n_kv, self.head_dim)
        new = lambda: [torch.zeros(shape, dtype=dtype, device=self.device) for _ in self._layers]  # noqa: E731
        return new(), new()

    @property
    def capacity(self) -> int:
        """Positions the whole pool holds (what one sequence can ever reach)."""
        return self.pool.capacity * self.block_size

    # ---- admission ------------------------------------------------------- #

    def refusal(self, prompt_len: int, max_new_tokens: int) -> str | None:
        """Why a request can never fit the pool (None if it can)."""
        if blocks_for(prompt_len + 1, self.block_size) > self.pool.capacity:
            return (f"the prompt has {prompt_len} tokens; the server's KV cache holds {self.capacity} positions "
                    "in all (--kv-cache-memory-gb / --kv-cache-memory-fraction)")
        end = min(prompt_len + max_new_tokens, self.max_len)
        if blocks_for(end, self.block_size) > self.pool.capacity:
            return (f"max_new_tokens (max_tokens) = {max_new_tokens}: with the prompt's {prompt_len} tokens a sample "
                    f"needs {end} KV positions, more than the server's whole KV cache ({self.capacity} positions, "
                    "--kv-cache-memory-gb / --kv-cache-memory-fraction); ask for at most "
                    f"{self.capacity - prompt_len} new tokens")
        return None

    def admissible(self, queue: Sequence[Any]) -> int:
        """How many sequences at the head of ``queue`` to admit now.

        Each takes the blocks of its context plus the position it decodes
        next, and must leave ``headroom_tokens`` (:data:`HEADROOM_TOKENS`) of its remaining output
        and one block per row of the batch free. An empty batch takes its
        head regardless (it fits the pool: :meth:`refusal`). First come first
        served: admission stops at the first sequence that does not fit, so a
        long prompt is never overtaken for ever (retracted sequences were put
        back at the head). A prefill holds at most ``max_prefill_tokens``
        padded tokens unless it is one context alone."""
        free, rows, n, width = self.pool.num_free, len(self.rows), 0, 0
        contexts: set = set()
        for s in queue:
            if rows + n >= self.slots:
                break
            ctx = len(s.req.prompt_ids) + len(s.output_ids)
            need = blocks_for(ctx + 1, self.block_size)
            params = getattr(s, "params", None)
            left = params.max_new_tokens - len(s.output_ids) if params is not None else self.headroom_tokens
            reserve = blocks_for(min(max(left, 0), self.headroom_tokens), self.block_size) + rows + n
            key = (id(s.req),) if not s.output_ids else (id(s.req), s.index)
            uniq, wide = contexts | {key}, max(width, ctx)
            if n and len(uniq) * wide > self.max_prefill_tokens:
                break
            if need + (0 if rows + n == 0 else reserve) > free:
                break
            free, n, contexts, width = free - need, n + 1, uniq, wide
        return n

    def rows_to_retract(self) -> int:
        """How many of the last (newest) rows must leave, their blocks freed,
        so that every other row has a block for the position it writes next."""
        grows = [ln == len(b) * self.block_size for ln, b in zip(self._len, self._blocks)]
        short, n = sum(grows) - self.pool.num_free, 0
        while short > 0 and n < len(self.rows):
            i = len(self.rows) - 1 - n
            short -= len(self._blocks[i]) + grows[i]
            n += 1
        return n

    # ---- KVBatch --------------------------------------------------------- #

    def room(self) -> int:
        return self.slots - len(self.rows)

    def clear(self) -> None:
        self.rows, self._blocks, self._len = [], [], []
        self.pool.reset()
        self._table.zero_()
        self._pos.zero_()

    def keep(self, idx: list[int]) -> None:
        kept = set(idx)
        for i, blocks in enumerate(self._blocks):
            if i not in kept:
                self.pool.free(blocks)
        old, k = len(self.rows), len(idx)
        self.rows = [self.rows[i] for i in idx]
        self._blocks = [self._blocks[i] for i in idx]
        self._len = [self._len[i] for i in idx]
        if idx != list(range(k)):
            t = upload(idx, self.device)
            self._table[:k] = self._table[t]
            self._pos[:k] = self._pos[t]
        self._table[k:old] = kv_pool.NULL_BLOCK  # the rows past the end are decode padding now
        self._pos[k:old] = 0

    def prefill(self, seqs: list[Any]) -> torch.Tensor:
        """Prefill the new sequences (one row per distinct context: samples of
        one request with no output yet share it, and its KV is written into
        each one's blocks) and return their last-position logits in ``seqs`` order."""
        if len(seqs) > self.room():
            raise RuntimeError(f"paged KV batch: {len(seqs)} sequences for {self.room()} free rows")
        ctxs, row_of = self._contexts(seqs)
        need = sum(blocks_for(len(ctxs[r]), self.block_size) for r in row_of)
        if need > self.pool.num_free:
            raise RuntimeError(f"paged KV batch: {need} blocks to prefill, {self.pool.num_free} free")
        blocks = [self.pool.alloc(blocks_for(len(ctxs[r]), self.block_size)) for r in row_of]
        # Where each (context row, position) goes in the flat pool, for every sequence.
        src_r, src_p, dst = [], [], []
        for r, blks in zip(row_of, blocks):
            p = torch.arange(len(ctxs[r]))
            src_r.append(torch.full_like(p, r))
            src_p.append(p)
            dst.append(torch.tensor(blks)[p // self.block_size] * self.block_size + p % self.block_size)
        to_dev = lambda parts: torch.cat(parts).to(self.device)  # noqa: E731
        logits = self._prefill_with_routes(seqs, ctxs, row_of, (to_dev(src_r), to_dev(src_p), to_dev(dst)))
        base, wide = len(self.rows), max(len(b) for b in blocks)
        table = torch.zeros((len(seqs), wide), dtype=torch.long)
        for j, blks in enumerate(blocks):
            table[j, : len(blks)] = torch.tensor(blks)
        self._table[base : base + len(seqs), :wide] = table.to(self.device)
        lens = [len(ctxs[r]) for r in row_of]
        self._pos[base : base + len(seqs)] = upload(lens, self.device)
        self.rows.extend(seqs)
        self._blocks.extend(blocks)
        self._len.extend(lens)
        return logits[upload(row_of, self.device)]

    def decode(self, last: torch.Tensor) -> torch.Tensor:
        """Feed one token per row, return logits ``[len(rows), vocab]``."""
        n = len(self.rows)
        grow = [i for i in range(n) if self._len[i] == len(self._blocks[i]) * self.block_size]
        if grow:
            if len(grow) > self.pool.num_free:
                raise RuntimeError(f"paged KV batch: {len(grow)} rows need a block, {self.pool.num_free} free "
                                   "(the engine retracts rows before the step)")
            new = self.pool.alloc(len(grow))
            cols = [len(self._blocks[i]) for i in grow]
            for i, b in zip(grow, new):
                self._blocks[i].append(b)
            at = upload([grow, cols, new], self.device)
            self._table[at[0], at[1]] = at[2]
        self._tokens[:n] = last
        longest = max(self._len) + 1
        if longest > self.max_len:
            raise RuntimeError(f"paged KV batch: a row reached max_len {self.max_len}")
        b = _bucket(n, _BATCH_BUCKETS, self.slots)
        nb = _len_bucket(longest, self.max_blocks * self.block_size) // self.block_size
        out = self._replay(b, nb) if self.graphs else self._step(b, nb)
        if self._route_buf is not None:  # copied out: the next step overwrites the buffer
            moe_routes.extend(self.rows, self._route_buf[:n].clone())
        self._len = [x + 1 for x in self._len]
        self._pos[:n] += 1
        return out[:n]

    # ---- the forward ----------------------------------------------------- #

    def _store_prefill_kv(self, li: int, k: torch.Tensor, v: torch.Tensor,
                          where: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """K and V of position ``src_p`` of context ``src_r`` go to flat pool
        index ``dst`` (``where = (src_r, src_p, dst)``: every sequence's copy)."""
        src_r, src_p, dst = where
        self.k[li].view(-1, self.n_kv, self.head_dim)[dst] = k[src_r, src_p]
        self.v[li].view(-1, self.n_kv, self.head_dim)[dst] = v[src_r, src_p]

    def _decode_where(self, b: int, nb: int, pos: torch.Tensor) -> tuple[Any, int]:
        """A step over the rows' first ``nb`` blocks: each row's flat pool index
        for its new position (its block, its offset), its block table and the position."""
        bs = self.block_size
        table = self._table[:b, :nb]
        slot = table.gather(1, torch.div(pos, bs, rounding_mode="floor")[:, None])[:, 0] * bs + pos % bs
        return (slot, table, pos), nb * bs

    def _cached_kv(self, li: int, b: int, width: int, where: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' blocks gathered in table order (SDPA's path, without the kernel)."""
        table = where[1]
        n_kv, hd = self.n_kv, self.head_dim
        return self.k[li][table].view(b, width, n_kv, hd), self.v[li][table].view(b, width, n_kv, hd)

    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, blocks) pair a decode step can run, largest first (no
        row outgrows the pool, so neither do the buckets)."""
        rows = sorted({_bucket(i, _BATCH_BUCKETS, self.slots) for i in range(1, self.slots + 1)})
        cap = self.max_blocks * self.block_size
        most = min(self.max_len, self.capacity)
        blocks = sorted({_len_bucket(i, cap) // self.block_size for i in range(1, most + 1)})
        return [(b, nb) for b in reversed(rows) for nb in reversed(blocks)]

    def prepare(self) -> None:
        """Log the pool's layout and capture every decode graph."""
        logger.info("paged KV cache: %d blocks of %d positions (%d positions, %.2f GiB), %d rows x %d positions "
                    "at most, CUDA graphs %s, decode attention by %s", self.pool.capacity, self.block_size,
                    self.capacity, self.nbytes / 2**30, self.slots, self.max_len, "on" if self.graphs else "off",
                    "the triton kernel" if self.kernel else "gather + SDPA")
        if self.graphs:
            secs = self.capture_all()
            logger.info("captured %d decode graphs in %.1f s", len(self._graphs), secs)


def make_paged(model: Any, cfg: Any, device: torch.device) -> PagedBatch:
    """The paged batch of an ``EngineConfig``: the pool from its memory budget
    (on a CPU without ``kv_cache_memory_gb``: ``max_batch_size`` x
    ``max_model_len`` positions, what the static cache holds), ``max_model_len``
    0 meaning the model's context (at most what the pool holds)."""
    own = int(getattr(model.config, "max_position_embeddings", None) or 0) or 2048
    dtype = model.model.embed_tokens.weight.dtype
    token_bytes = kv_pool.bytes_per_token(model, dtype)
    bs = BLOCK_SIZE
    budget = kv_pool.budget_bytes(device, cfg.kv_cache_memory_gb, cfg.kv_cache_memory_fraction)
    if budget is None:
        num_blocks = cfg.max_batch_size * blocks_for(cfg.max_model_len or min(own, 2048), bs) + 1
    else:
        if cfg.kv_cache_memory_gb <= 0 and not paged_attention.available(device):
            # Sized by a fraction: keep a decode step's gathered K and V (one
            # layer, every row at the longest length) out of the pool (the
            # kernel gathers nothing).
            layers = int(model.config.num_hidden_layers)
            budget -= cfg.max_batch_size * (cfg.max_model_len or own) * token_bytes // layers
        num_blocks = kv_pool.pool_blocks(budget, token_bytes, bs)
    if num_blocks < 2:
        raise ValueError(f"KV cache budget too small: {budget} bytes for blocks of {token_bytes * bs} bytes "
                         "(--kv-cache-memory-gb / --kv-cache-memory-fraction)")
    max_len = cfg.max_model_len or min(own, (num_blocks - 1) * bs)
    if max_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_len}")
    if max_len > (num_blocks - 1) * bs:
        logger.warning("max_model_len %d is more than the KV pool holds (%d positions): requests that could "
                       "outgrow the pool are refused", max_len, (num_blocks - 1) * bs)
    return PagedBatch(model, device, cfg.max_batch_size, max_len, num_blocks, bs, graphs=cfg.cuda_graphs,
                      routes=cfg.return_routed_experts)
