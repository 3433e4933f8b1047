"""Tensor metadata, bucket planning and byte packing for weight pushes.

Two engines, two flat layouts, one rule: tensors are concatenated as raw bytes
with no padding and no header (names, dtypes and shapes travel in the HTTP
body). What differs is how a list of tensors is cut into broadcasts:

* SGLang ``load_format="flattened_bucket"``: one uint8 broadcast per
  ``/update_weights_from_distributed`` call. The receiver reinterprets each
  slice with ``view(dtype)``, which needs every offset to be a multiple of the
  tensor's itemsize. Ordering a bucket by itemsize, largest first, gives that
  for free (each prefix is a sum of multiples of a larger power of two).
  -> :func:`plan_buckets`.
* vLLM packed mode: tensors keep their global order and a chunk closes right
  after the tensor that takes it past the buffer size (both sides compute the
  same cut from the same metadata). -> :func:`plan_packed_chunks`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling engines resolve with getattr)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"expected a torch.dtype, got {type(dtype).__name__}")
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; anything that is not a bare torch
    dtype attribute name fails, as it does in SGLang (``"torch.bfloat16"``
    included), so a trainer finds out here and not from a hung broadcast."""
    if not isinstance(name, str):
        raise TypeError(f"dtype name must be a string, got {type(name).__name__}")
    if name.startswith("torch."):
        raise ValueError(
            f"invalid dtype name {name!r}: use the bare name {name.removeprefix('torch.')!r}, "
            "engines resolve dtypes with getattr(torch, name)"
        )
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"invalid dtype name {name!r}: not a torch dtype")
    return value


@dataclass(frozen=True)
class TensorSpec:
    """What the receiver must know to allocate and reinterpret one tensor."""

    name: str
    """HF parameter name, e.g. ``model.layers.0.mlp.up_proj.weight``."""
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if any(s < 0 for s in self.shape):
            raise ValueError(f"tensor {self.name!r}: negative dimension in shape {self.shape}")

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorSpec":
        return cls(name, tensor.dtype, tuple(tensor.shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[list[TensorSpec]]:
    """Cut ``specs`` into SGLang ``flattened_bucket`` buckets of at most
    ``bucket_bytes`` each (a tensor larger than that gets a bucket of its own).

    Tensors are taken in the given order (a new bucket starts when the next
    tensor does not fit); within a bucket they are ordered by itemsize,
    largest first and otherwise stable, so every offset is aligned. Send each
    bucket's names in exactly the returned order.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    used = 0
    for spec in specs:
        if current and used + spec.nbytes > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(spec)
        used += spec.nbytes
    if current:
        buckets.append(current)
    return [sorted(b, key=lambda s: -s.itemsize) for b in buckets]


def plan_packed_chunks(specs: Sequence[TensorSpec], buffer_bytes: int) -> list[list[TensorSpec]]:
    """Cut ``specs`` into vLLM packed-mode chunks: order kept, a chunk closes
    right after the tensor that takes it past ``buffer_bytes``.

    Offsets inside a chunk are not aligned in general, so the receiver must
    copy bytes out (``unpack(..., copy=True)``) rather than view them.
    """
    if buffer_bytes <= 0:
        raise ValueError(f"buffer_bytes must be positive, got {buffer_bytes}")
    chunks: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    used = 0
    for spec in specs:
        current.append(spec)
        used += spec.nbytes
        if used > buffer_bytes:
            chunks.append(current)
            current, used = [], 0
    if current:
        chunks.append(current)
    return chunks


def offsets(specs: Sequence[TensorSpec]) -> list[int]:
    """Byte offset of each tensor in the packed layout (plus the total at the end)."""
    out = [0]
    for spec in specs:
        out.append(out[-1] + spec.nbytes)
    return out


def packed_nbytes(specs: Iterable[TensorSpec]) -> int:
    return sum(s.nbytes for s in specs)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(-1).view(torch.uint8)


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate the raw bytes of ``tensors`` into one flat uint8 tensor.

    With ``out`` (a preallocated uint8 buffer at least that large, e.g. a
    staging buffer reused across steps) the bytes are copied into its prefix
    and that prefix is returned; otherwise a new tensor on the first tensor's
    device is returned.
    """
    total = sum(t.numel() * t.element_size() for t in tensors)
    if out is None:
        device = tensors[0].device if tensors else torch.device("cpu")
        out = torch.empty(total, dtype=torch.uint8, device=device)
    else:
        if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
            raise ValueError("out must be a contiguous 1-D uint8 tensor")
        if out.numel() < total:
            raise ValueError(f"out holds {out.numel()} bytes, the tensors need {total}")
        out = out[:total]
    pos = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        out[pos : pos + n].copy_(_as_bytes(t))
        pos += n
    return out


def slots(buf: torch.Tensor, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
    """Where each tensor of ``specs`` goes in the packed buffer ``buf``: a view
    of its dtype and shape where its offset allows (a multiple of its
    itemsize: always in flattened buckets), else its raw uint8 bytes (vLLM
    packed chunks mixing itemsizes). Made once per staging buffer, so a
    snapshot is one ``torch._foreach_copy_`` over the typed views."""
    if packed_nbytes(specs) > buf.numel():
        raise ValueError(f"buffer holds {buf.numel()} bytes, the tensors need {packed_nbytes(specs)}")
    out: list[torch.Tensor] = []
    pos = 0
    for spec in specs:
        raw = buf[pos : pos + spec.nbytes]
        out.append(raw if pos % spec.itemsize else raw.view(spec.dtype).view(spec.shape))
        pos += spec.nbytes
    return out


def unpack(buf: torch.Tensor, specs: Sequence[TensorSpec], copy: bool = False) -> list[torch.Tensor]:
    """Split a packed uint8 buffer back into tensors described by ``specs``.

    Returns views into ``buf`` (no copy) unless ``copy``; views need each
    offset to be a multiple of the tensor's itemsize (the flattened-bucket
    rule), copies do not. The buffer size must match the specs exactly.
    """
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError(f"packed buffer must be 1-D uint8, got {buf.dtype} with shape {tuple(buf.shape)}")
    expected = packed_nbytes(specs)
    if buf.numel() != expected:
        raise ValueError(
            f"packed buffer holds {buf.numel()} bytes but the tensors "
            f"({', '.join(s.name for s in specs[:3])}{', ...' if len(specs) > 3 else ''}) need {expected}"
        )
    out: list[torch.Tensor] = []
    for spec, pos, slot in zip(specs, offsets(specs), slots(buf, specs)):
        if slot.dtype != spec.dtype:  # an unaligned offset: ``slot`` is the raw bytes
            if not copy:
                raise ValueError(
                    f"tensor {spec.name!r} ({dtype_name(spec.dtype)}) starts at byte {pos}, "
                    f"not a multiple of its itemsize {spec.itemsize}: order a bucket by itemsize, largest first"
                )
            slot = slot.clone().view(spec.dtype).view(spec.shape)
        elif copy:
            slot = slot.clone()
        out.append(slot)
    return out
