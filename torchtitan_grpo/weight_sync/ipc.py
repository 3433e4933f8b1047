"""Named tensors handed to another process on the same host by reference.

``weight_sync.transport = "ipc"``: instead of sending the bytes, the trainer
sends a handle to its staging buffer and the server copies out of it. On a
GPU the handle is a CUDA IPC memory handle (the copy is a device-to-device
copy, so a server sharing the trainer's GPU gets a version at memory speed
where NCCL cannot run at all and gloo crawls through the host); on CPU it is
a shared-memory file. This is SGLang's ``/update_weights_from_tensor``
encoding: ``serialized_named_tensors`` holds, per server TP rank, the
base64 text of a ``multiprocessing`` ``ForkingPickler`` pickle of a list of
``(name, tensor)`` pairs (torch registers its tensor reductions with that
pickler, which is what turns a tensor into a handle).

Unpickling runs code named by the pickle, so the receiving side accepts only
the globals torch's tensor reductions use, and refuses anything else by name.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

# What ForkingPickler writes for CPU (shared-memory file) and CUDA (IPC handle) tensors.
_ALLOWED = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.nn.parameter", "Parameter"),
    ("torch.storage", "UntypedStorage"),
    ("torch", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),  # rebuild_cuda_tensor's storage class
    ("torch", "TypedStorage"),
}


class IpcFormatError(ValueError):
    """A ``serialized_named_tensors`` entry that is not what this module reads."""


class _TensorsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise IpcFormatError(f"refers to {module}.{name}, which is not part of a tensor's reduction")


def restricted_loads(raw: bytes) -> object:
    """Unpickle ``raw`` allowing only the globals of torch's tensor reductions
    (anything else raises :class:`IpcFormatError` naming it)."""
    return _TensorsOnly(io.BytesIO(raw)).load()


def share_cpu_memory() -> None:
    """Make CPU tensors travel as shared-memory file names, which any process
    on the host can open (torch's default passes file descriptors, which only
    a child process started by this one can receive)."""
    torch.multiprocessing.set_sharing_strategy("file_system")


def serialize(named: list[tuple[str, torch.Tensor]]) -> str:
    """``named`` as one ``serialized_named_tensors`` entry. The tensors must
    stay alive and unchanged until the receiver has copied them."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def restricted_b64_loads(text: object, into: str = "") -> object:
    """Base64 text of a pickle back to its object, unpickled with
    :func:`restricted_loads` (nothing but torch's tensor reductions runs);
    :class:`IpcFormatError` says what is wrong with it (``into``: what it
    should have held, for that message)."""
    if not isinstance(text, str):
        raise IpcFormatError(f"must be a base64 string, got {type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise IpcFormatError(f"is not valid base64: {e}") from None
    try:
        return restricted_loads(raw)
    except IpcFormatError:
        raise
    except Exception as e:  # a truncated pickle, a handle or shared-memory file that no longer maps, ...
        raise IpcFormatError(f"cannot be unpickled{into}: {type(e).__name__}: {e}") from None


def deserialize(entry: object) -> list[tuple[str, torch.Tensor]]:
    """One ``serialized_named_tensors`` entry back to ``(name, tensor)`` pairs
    that map the sender's memory; raises :class:`IpcFormatError` saying what
    is wrong with it."""
    named = restricted_b64_loads(entry, " into tensors")
    if not isinstance(named, list) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in named):
        raise IpcFormatError("must hold a list of (name, tensor) pairs")
    return named
