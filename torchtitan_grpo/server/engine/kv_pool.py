"""The block pool of the paged KV cache (``server/engine/paged_batch.py``): sizing and bookkeeping.

KV memory is one pool per layer of fixed-size blocks (``block_size``
positions each); a sequence owns a list of blocks, its block table, and grows
one block at a time. This module holds no tensors: it decides how many
blocks the memory budget buys (:func:`pool_blocks`) and which block ids are
free (:class:`BlockPool`).

The budget, as the reference engines size theirs (facts from their docs):
vLLM's ``--gpu-memory-utilization`` (default 0.9) is a fraction of the GPU's
*total* memory for the whole instance, the KV cache getting what is left after
the weights and a profiled activation peak; SGLang's ``--mem-fraction-static``
is a fraction of total memory for weights plus the KV pool; TensorRT-LLM's
``free_gpu_memory_fraction`` (default 0.9) is a fraction of the memory still
free after the weights. Ours is TensorRT-LLM's kind: ``kv_cache_memory_fraction``
of the memory free once the weights are loaded (what torch's
``cuda.mem_get_info`` reports, so other processes on the GPU are counted), or
an absolute ``kv_cache_memory_gb``. What stays free holds the activations: a
prefill bounded by ``MAX_PREFILL_TOKENS`` and a decode step's attention. On a
GPU with triton that is ``server/engine/paged_attention.py``'s kernel, which reads the
blocks where they lie and needs only its splits' small partial results; on
the gather + SDPA path (CPU, no triton, ``TORCHTITAN_GRPO_PAGED_KERNEL=0``)
it is a contiguous copy of the step's blocks (at most one layer's share of
the pool).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

BLOCK_SIZE = 16
"""Positions per block (vLLM's default). Smaller wastes less of a sequence's
last block; larger means fewer table entries for a decode step to look up
(the kernel's tiles of 64 positions span several; the gather path copies
each). The decode step's length buckets are multiples of 64, so any power of
two up to 64 fits."""
DEFAULT_MEMORY_FRACTION = 0.8
"""Of the GPU memory free after the weights, when neither budget is set."""
NULL_BLOCK = 0
"""Never handed out: table entries past a row's blocks, and the padding rows
of a decode bucket, point here, so their (unread) writes land nowhere live."""


def bytes_per_token(model: Any, dtype: torch.dtype) -> int:
    """K and V bytes of one position across every layer."""
    cfg = model.config
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * int(cfg.num_hidden_layers) * int(cfg.num_key_value_heads) * head_dim * itemsize


def budget_bytes(device: torch.device, memory_gb: float, memory_fraction: float) -> int | None:
    """The KV budget in bytes: ``memory_gb`` GiB if set, else ``memory_fraction``
    (default :data:`DEFAULT_MEMORY_FRACTION` on a GPU) of the device's free
    memory now; None on a CPU without ``memory_gb`` (the caller sizes by slots)."""
    if memory_gb > 0:
        return int(memory_gb * 2**30)
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free * (memory_fraction or DEFAULT_MEMORY_FRACTION))


def pool_blocks(budget: int, token_bytes: int, block_size: int) -> int:
    """Blocks (the null block included) that ``budget`` bytes buy."""
    return budget // (token_bytes * block_size)


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks holding ``positions`` positions."""
    return -(-positions // block_size)


class BlockPool:
    """Free block ids of a pool of ``num_blocks`` (block 0 is :data:`NULL_BLOCK`).

    Lowest ids first (a stack of the freed ones on top), so a lightly used
    pool touches a compact region. Double frees and foreign ids raise: a
    leaked or shared block would silently corrupt another sequence's KV.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() gives the lowest id
        self._owned = [False] * num_blocks

    @property
    def capacity(self) -> int:
        """Blocks a sequence can ever own (every block but the null one)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV pool: {n} blocks asked, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._owned[b] = True
        return out

    def free(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if not 0 < b < self.num_blocks or not self._owned[b]:
                raise RuntimeError(f"KV pool: block {b} freed but not allocated")
            self._owned[b] = False
            self._free.append(b)

    def reset(self) -> None:
        """Every block free again (the batch was cleared)."""
        self.__init__(self.num_blocks, self.block_size)
