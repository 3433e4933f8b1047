"""Delta codec: one tensor's change between two versions, and a version's
changes as one binary body (``weight_sync.delta``; issue 41).

A changed tensor is sent as the positions of the elements whose *bits*
changed (int32 indices, int64 past 2**31 elements) and their new bits. Bits,
not values: ``-0.0 == 0.0`` and ``nan != nan`` would lose a sign change and
resend every NaN. Where that costs at least as many bytes as the tensor
itself (``density_limit``: a third of the elements for bf16, half for fp32)
the whole tensor is sent instead; an unchanged tensor is not sent at all.

Why indices + values and not an XOR of the raw bits compressed: measured on
SmolLM2-135M after real GRPO steps (bench/delta_push.py, docs/PERFORMANCE.md
"Delta push"), zlib over the XOR is a few times slower to encode, and what it
saves over the indices does not pay for its CPU time; indices + values are
two vectorised torch ops each way, on any device.

Applying a delta gives a new tensor (the base is not written: the engine
takes full tensors and swaps them in under its exclusive section) and checks
it against the CRC-32 of the trainer's new tensor: a base that was not the
version the delta was made against fails there, never silently.

Body: ``MAGIC``, an 8-byte little-endian header length, a JSON header
(``version``, ``base_version``, per tensor ``name``, ``dtype``, ``shape``,
``count`` (changed elements; -1: the whole tensor), ``index`` dtype and
``crc``), then per tensor its index bytes and its value bytes, in header order.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Iterable

import torch

__all__ = ["DeltaError", "DeltaMismatch", "TensorDelta", "apply", "crc32", "decode_body", "density_limit",
           "encode", "encode_body"]

MAGIC = b"TGD1"
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INDEX = {"int32": torch.int32, "int64": torch.int64}
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


def density_limit(t: torch.Tensor, index_dtype: torch.dtype = torch.int32) -> float:
    """Changed fraction at which the indices + values take as many bytes as the
    tensor itself: 1/3 for bf16 with int32 indices, 1/2 for fp32."""
    item = t.element_size()
    return item / (item + torch.empty((), dtype=index_dtype).element_size())


@dataclass
class TensorDelta:
    """One tensor of a version: its changed elements, or all of it (``index`` None)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    values: torch.Tensor
    """The new bits: at ``index``, or the whole tensor flattened."""
    index: torch.Tensor | None = None
    crc: int = 0
    """CRC-32 of the whole new tensor (deltas only: a full tensor is its own check)."""
    changed: int = -1
    """Elements whose bits changed (-1: not compared, no base); not sent."""

    @property
    def full(self) -> bool:
        return self.index is None

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + (
            0 if self.index is None else self.index.numel() * self.index.element_size())


def encode(name: str, base: torch.Tensor | None, new: torch.Tensor,
           max_density: float | None = None) -> TensorDelta | None:
    """``new`` against ``base`` (same dtype and shape): None if no bit changed,
    the whole tensor if ``base`` is None or more than ``max_density`` of its
    elements changed (default: ``density_limit``, where the delta stops
    being smaller), else the changed elements."""
    b = bits(new)
    whole = TensorDelta(name, new.dtype, tuple(new.shape), b)
    if base is None:
        return whole
    if base.dtype != new.dtype or base.shape != new.shape:
        raise DeltaError(f"{name}: base is {base.dtype} {list(base.shape)}, new is {new.dtype} {list(new.shape)}")
    index = torch.ne(bits(base), b).nonzero().reshape(-1)
    n = index.numel()
    if n == 0:
        return None
    small = torch.int32 if b.numel() <= _INT32_MAX else torch.int64
    limit = density_limit(new, small) if max_density is None else max_density
    if n > limit * b.numel():
        whole.changed = n
        return whole
    return TensorDelta(name, new.dtype, tuple(new.shape), b[index], index.to(small), crc32(new), n)


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
    flat[d.index.to(device, torch.int64)] = d.values.to(device)
    if crc32(out) != d.crc:
        raise DeltaMismatch(f"{d.name}: applied to this replica's copy, the result is not the trainer's "
                            "tensor (CRC-32 differs): the base is not the version the delta was made against")
    return out


# --------------------------------------------------------------------- body


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_body(version: str, base_version: str | None, deltas: Iterable[TensorDelta]) -> bytes:
    """One version's changes as one HTTP body (see the module's docstring)."""
    deltas = list(deltas)
    header = {"version": version, "base_version": base_version, "tensors": [
        {"name": d.name, "dtype": _dtype_name(d.dtype), "shape": list(d.shape),
         "count": -1 if d.full else d.index.numel(), "index": None if d.full else _dtype_name(d.index.dtype),
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
        numel = 1
        for k in shape:
            numel *= int(k)
        index = None
        if count >= 0:
            if count > numel:
                raise DeltaError(f"{name}: {count} changed elements declared for a tensor of {numel}")
            index, at = _take(view, at, index_dtype, count, name)
            if count and (int(index.min()) < 0 or int(index.max()) >= numel):
                raise DeltaError(f"{name}: an index is out of range for a tensor of {numel} elements")
        values, at = _take(view, at, _BITS[dtype.itemsize], numel if count < 0 else count, name)
        out.append(TensorDelta(name, dtype, shape, values, index, crc))
    if at != len(view):
        raise DeltaError(f"the delta body has {len(view) - at} bytes past its last tensor")
    return header, out
