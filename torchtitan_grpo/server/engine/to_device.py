"""Small host lists as device tensors, without a stream sync: the one helper
the KV batches (``server/engine/batch.py``, ``server/engine/static_batch.py``), the engine and the
sampler share. It lives here, below all of them, so that none of those
modules has to import another for it."""

from __future__ import annotations

import torch


def upload(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list as a tensor on ``device``, without waiting for the
    device: ``torch.tensor(values, device="cuda")`` synchronises the stream
    (it copies from pageable memory), which would stall the host until the
    step in flight ends; a pinned copy is queued behind it instead."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
