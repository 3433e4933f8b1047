"""Delta codec: one tensor's change between two versions, and a version's
changes as one binary body (``weight_sync.delta``; issue 41).

A changed tensor is sent as the positions of the elements whose *bits*
changed and their new bits. Bits, not values: ``-0.0 == 0.0`` and
``nan != nan`` would lose a sign change and resend every NaN. The positions
go as int32 indices (int64 past 2**31 elements) or, where that is smaller
(more than 1 in 32 elements changed), as a bitmap of one bit per element.
Where the delta costs at least as many bytes as the tensor itself (bf16:
past ~94% of its elements changed) the whole tensor is sent instead; an
unchanged tensor is not sent at all.

Why positions + values and not an XOR of the raw bits compressed: measured
on SmolLM2-135M after real GRPO steps (bench/delta_push.py, docs/PERFORMANCE.md
"Delta push"), zlib over the XOR sends 0.60-0.74x the bytes but takes
1.7-2.2x the encode time on one core, as serial CPU work that cannot run on
a GPU trainer's snapshots; positions + values are a compare, a ``nonzero``
and a gather (a scatter to apply), vectorised on any device. The bitmap
halved the bytes at 10x the recipe's lr (12-18 % of the elements changed)
and changes nothing at its lr (~2 %).

Applying a delta gives a new tensor (the base is not written: the engine
takes full tensors and swaps them in under its exclusive section) and checks
it against the CRC-32 of the trainer's new tensor: a base that was not the
version the delta was made against fails there, never silently.

Body: ``MAGIC``, an 8-byte little-endian header length, a JSON header
(``version``, ``base_version``, per tensor ``name``, ``dtype``, ``shape``,
``count`` (changed elements; -1: the whole tensor), ``index`` ("int32",
"int64" or "bitmap") and ``crc``), then per tensor its position bytes and its
value bytes, in header order.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Iterable

import torch

__all__ = ["DeltaError", "DeltaMismatch", "TensorDelta", "apply", "crc32", "decode_body", "delta_nbytes",
           "encode", "encode_body", "pack_bits", "unpack_bits"]

MAGIC = b"TGD1"
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INDEX = {"int32": torch.int32, "int64": torch.int64, "bitmap": torch.uint8}
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_INT32_MAX = 2**31 - 1


class DeltaError(ValueError):
    """A delta body that cannot be applied (malformed, or not for this model): one line."""


class DeltaMismatch(DeltaError):
    """Applied, the result is not the trainer's tensor (its CRC-32 differs):
    the base was not the version the delta was made against."""


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits as a flat integer tensor of its element size (a view if contiguous)."""
    return t.detach().contiguous().reshape(-1).view(_BITS[t.element_size()])


def crc32(t: torch.Tensor) -> int:
    """CRC-32 of ``t``'s bytes (copied to the host first if it is not there)."""
    return zlib.crc32(bits(t).cpu().numpy())


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A flat bool mask as a bitmap: bit ``i % 8`` of byte ``i // 8`` is ``mask[i]``."""
    pad = (-mask.numel()) % 8
    m = torch.cat([mask, mask.new_zeros(pad)]) if pad else mask
    return (m.view(-1, 8).to(torch.uint8) * _BIT_WEIGHTS.to(m.device)).sum(1, dtype=torch.uint8)


def unpack_bits(bitmap: torch.Tensor, numel: int) -> torch.Tensor:
    """The flat bool mask of ``numel`` elements that ``bitmap`` holds."""
    w = _BIT_WEIGHTS.to(bitmap.device)
    return (bitmap.view(-1, 1).bitwise_and(w) != 0).view(-1)[:numel]


def delta_nbytes(numel: int, changed: int, itemsize: int) -> tuple[int, bool]:
    """(bytes of a delta with ``changed`` of ``numel`` elements changed,
    whether its positions go as a bitmap): the smaller of the two encodings."""
    index = changed * (4 if numel <= _INT32_MAX else 8)
    bitmap = (numel + 7) // 8
    return min(index, bitmap) + changed * itemsize, bitmap < index


@dataclass
class TensorDelta:
    """One tensor of a version: its changed elements, or all of it (``index`` None)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    values: torch.Tensor
    """The new bits: at ``index``, or the whole tensor flattened."""
    index: torch.Tensor | None = None
    """The changed positions: int32/int64 indices, or a uint8 bitmap (one bit per element)."""
    crc: int = 0
    """CRC-32 of the whole new tensor (deltas only: a full tensor is its own check)."""
    changed: int = -1
    """Elements whose bits changed (-1: not compared, no base); not sent."""

    @property
    def full(self) -> bool:
        return self.index is None

    @property
    def bitmap(self) -> bool:
        return self.index is not None and self.index.dtype == torch.uint8

    def positions(self) -> torch.Tensor:
        """The changed flat positions (int64), in increasing order for a bitmap."""
        if self.bitmap:
            return unpack_bits(self.index, _numel(self.shape)).nonzero().view(-1)
        return self.index.to(torch.int64)

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + (
            0 if self.index is None else self.index.numel() * self.index.element_size())


def encode(name: str, base: torch.Tensor | None, new: torch.Tensor,
           max_density: float | None = None) -> TensorDelta | None:
    """``new`` against ``base`` (same dtype and shape): None if no bit changed,
    the whole tensor if ``base`` is None, if more than ``max_density`` of its
    elements changed, or (default) where the delta would not be smaller
    (``delta_nbytes``); else the changed elements."""
    b = bits(new)
    whole = TensorDelta(name, new.dtype, tuple(new.shape), b)
    if base is None:
        return whole
    if base.dtype != new.dtype or base.shape != new.shape:
        raise DeltaError(f"{name}: base is {base.dtype} {list(base.shape)}, new is {new.dtype} {list(new.shape)}")
    mask = torch.ne(bits(base), b)
    index = mask.nonzero().reshape(-1)
    n, numel = index.numel(), b.numel()
    if n == 0:
        return None
    nbytes, as_bitmap = delta_nbytes(numel, n, new.element_size())
    if nbytes >= numel * new.element_size() or (max_density is not None and n > max_density * numel):
        whole.changed = n
        return whole
    positions = pack_bits(mask) if as_bitmap else index.to(torch.int32 if numel <= _INT32_MAX else torch.int64)
    return TensorDelta(name, new.dtype, tuple(new.shape), b[index], positions, crc32(new), n)


def apply(base: torch.Tensor, d: TensorDelta) -> torch.Tensor:
    """The new tensor: ``d`` applied to a copy of ``base`` (in ``d``'s dtype,
    on ``base``'s device); raises :class:`DeltaMismatch` if it is not the
    trainer's (CRC-32)."""
    device = base.device
    if d.full:
        return d.values.to(device).view(d.dtype).reshape(d.shape).clone()
    if tuple(base.shape) != d.shape:
        raise DeltaError(f"{d.name}: delta for shape {list(d.shape)}, the model's is {list(base.shape)}")
    out = base.detach().to(d.dtype, copy=True).contiguous()
    flat = bits(out)
    flat[d.positions().to(device)] = d.values.to(device)
    if crc32(out) != d.crc:
        raise DeltaMismatch(f"{d.name}: applied to this replica's copy, the result is not the trainer's "
                            "tensor (CRC-32 differs): the base is not the version the delta was made against")
    return out


# --------------------------------------------------------------------- body


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for k in shape:
        n *= int(k)
    return n


def encode_body(version: str, base_version: str | None, deltas: Iterable[TensorDelta]) -> bytes:
    """One version's changes as one HTTP body (see the module's docstring)."""
    deltas = list(deltas)
    header = {"version": version, "base_version": base_version, "tensors": [
        {"name": d.name, "dtype": _dtype_name(d.dtype), "shape": list(d.shape),
         "count": -1 if d.full else d.values.numel(),
         "index": None if d.full else "bitmap" if d.bitmap else _dtype_name(d.index.dtype),
         "crc": d.crc} for d in deltas]}
    head = json.dumps(header).encode()
    parts = [MAGIC, struct.pack("<Q", len(head)), head]
    for d in deltas:
        if not d.full:
            parts.append(d.index.cpu().numpy().tobytes())
        parts.append(d.values.cpu().numpy().tobytes())
    return b"".join(parts)


def _take(body: memoryview, at: int, dtype: torch.dtype, count: int, what: str) -> tuple[torch.Tensor, int]:
    size = torch.empty((), dtype=dtype).element_size()
    end = at + count * size
    if count < 0 or end > len(body):
        raise DeltaError(f"{what}: the body ends at byte {len(body)}, before the {count} elements it declares")
    t = torch.frombuffer(body, dtype=dtype, count=count, offset=at) if count else torch.empty(0, dtype=dtype)
    return t, end


def decode_body(body: bytes | bytearray) -> tuple[dict, list[TensorDelta]]:
    """(header, tensors) of a body from :func:`encode_body`, every length and
    index checked; raises :class:`DeltaError` naming what is wrong. The
    tensors are views of ``body`` (a bytearray keeps them writable)."""
    view = memoryview(body)
    if bytes(view[:4]) != MAGIC or len(view) < 12:
        raise DeltaError(f"not a delta body (it must start with {MAGIC!r})")
    (n,) = struct.unpack("<Q", view[4:12])
    try:
        header = json.loads(bytes(view[12:12 + n]))
        specs = header["tensors"]
        version = header["version"]
    except (ValueError, KeyError, TypeError):
        raise DeltaError("the delta body's header is not JSON with 'version' and 'tensors'") from None
    if not isinstance(version, str) or not isinstance(specs, list):
        raise DeltaError("the delta body's 'version' must be a string and 'tensors' a list")
    at, out = 12 + n, []
    for s in specs:
        try:
            name, dtype, shape, count = s["name"], getattr(torch, s["dtype"]), tuple(s["shape"]), int(s["count"])
            index_dtype = None if count < 0 else _INDEX[s["index"]]
            crc = int(s["crc"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise DeltaError(f"tensor entry {str(s)[:120]} of the delta body is malformed") from None
        if not isinstance(dtype, torch.dtype) or dtype.itemsize not in _BITS:
            raise DeltaError(f"{name}: dtype {s['dtype']!r} cannot be sent as a delta")
        numel = _numel(shape)
        index = None
        if count >= 0:
            if count > numel:
                raise DeltaError(f"{name}: {count} changed elements declared for a tensor of {numel}")
            if index_dtype == torch.uint8:  # a bitmap: its set bits are the count, none past the tensor
                index, at = _take(view, at, index_dtype, (numel + 7) // 8, name)
                mask = unpack_bits(index, (numel + 7) // 8 * 8)
                if int(mask.sum()) != count or bool(mask[numel:].any()):
                    raise DeltaError(f"{name}: the bitmap marks {int(mask.sum())} elements, {count} declared")
            else:
                index, at = _take(view, at, index_dtype, count, name)
                if count and (int(index.min()) < 0 or int(index.max()) >= numel):
                    raise DeltaError(f"{name}: an index is out of range for a tensor of {numel} elements")
        values, at = _take(view, at, _BITS[dtype.itemsize], numel if count < 0 else count, name)
        out.append(TensorDelta(name, dtype, shape, values, index, crc))
    if at != len(view):
        raise DeltaError(f"the delta body has {len(view) - at} bytes past its last tensor")
    return header, out
