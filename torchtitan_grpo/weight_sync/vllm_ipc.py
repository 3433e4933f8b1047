"""vLLM's IPC weight-transfer handles, both ends (read from vLLM 0.26.0's
``distributed/weight_transfer/ipc_engine.py`` and ``packed_tensor.py``).

A packed IPC update names one buffer of the trainer's: ``ipc_handles_pickled``
is the base64 of a pickle of ``{key: args}``, ``args`` being what
``torch.multiprocessing.reductions.reduce_tensor(buffer)`` returns after the
rebuild function. A vLLM worker takes the entry keyed by its GPU's uuid
(``str(torch.cuda.get_device_properties(i).uuid)``), sets ``args[6]`` (the
device index) to its own, calls ``rebuild_cuda_tensor(*args)``, keeps the
first ``sum(tensor_sizes)`` bytes, splits them by ``tensor_sizes``, views each
piece as its dtype and shape, and clones it: the trainer's buffer is free
again once the request is answered.

On CPU (no CUDA, the built-in server in tests) the same body carries a
shared-memory handle instead, keyed :data:`CPU_KEY`: ``args`` is then
``(cls, storage, metadata)`` for ``rebuild_tensor``, and the storage pickles
(``ForkingPickler``) as the name of a file in /dev/shm. The receiving side
unpickles with the restricted unpickler of ``ipc`` and calls the rebuild
function itself, after checking the classes the arguments name: nothing in
a body is executed.
"""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, rebuild_tensor, reduce_tensor

from torchtitan_grpo.weight_sync import buckets as bk
from torchtitan_grpo.weight_sync.ipc import IpcFormatError, restricted_b64_loads

CPU_KEY = "cpu"
"""The key of a shared-memory (CPU) handle; a GPU's is its uuid."""
CUDA_ARGS = 15  # rebuild_cuda_tensor's parameters
DEVICE_ARG = 6  # its storage_device: the receiver puts its own index there
_TENSOR_CLASSES = (torch.Tensor, torch.nn.Parameter)
_STORAGE_CLASSES = (torch.TypedStorage, torch.UntypedStorage)


def device_key(device: torch.device) -> str:
    """The key a receiver on ``device`` looks its handle up by."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_properties(device).uuid)
    return CPU_KEY


def share(buf: torch.Tensor) -> tuple:
    """The reduction arguments of ``buf`` (a CUDA IPC memory handle, or a
    shared-memory storage). Made once per buffer: the handle names the
    allocation, not its contents, so it stays valid while ``buf`` lives.
    (The CUDA event it records covers only writes before this call, so the
    sender synchronizes each snapshot's copies itself before sending.)"""
    if buf.device.type == "cpu" and not buf.is_shared():
        raise ValueError("a CPU staging buffer must be in shared memory (share_memory_()) to be handed over")
    return reduce_tensor(buf)[1]


def encode_handles(handles: dict[str, tuple]) -> str:
    """``ipc_handles_pickled``. CUDA handles are plain data and pickle as vLLM's
    own sender pickles them; a CPU handle holds a storage, which only
    ``ForkingPickler`` turns into a shared-memory file name."""
    out = io.BytesIO()
    if any(len(a) != CUDA_ARGS for a in handles.values()):
        ForkingPickler(out).dump(handles)
    else:
        pickle.dump(handles, out)
    return base64.b64encode(out.getvalue()).decode("ascii")


def decode_handles(text: object) -> dict[str, tuple]:
    """``ipc_handles_pickled`` back to ``{key: args}`` without running anything
    but torch's tensor-reduction functions; :class:`IpcFormatError` says what is wrong."""
    handles = restricted_b64_loads(text)
    if not (isinstance(handles, dict) and handles
            and all(isinstance(k, str) and isinstance(a, tuple) for k, a in handles.items())):
        raise IpcFormatError("must hold a non-empty {key: reduction arguments} mapping")
    return handles


def _is_class(value: object, allowed: tuple) -> bool:
    return isinstance(value, type) and value in allowed


def open_buffer(args: tuple, device: torch.device) -> torch.Tensor:
    """The sender's buffer (a view of its memory) from one handle's arguments,
    which must be the kind ``device`` can open."""
    if device.type == "cuda":
        if len(args) != CUDA_ARGS or not _is_class(args[0], _TENSOR_CLASSES) \
                or not _is_class(args[4], _STORAGE_CLASSES):
            raise IpcFormatError(f"is not a CUDA tensor handle (rebuild_cuda_tensor's {CUDA_ARGS} arguments)")
        cuda_args = list(args)
        cuda_args[DEVICE_ARG] = device.index if device.index is not None else torch.cuda.current_device()
        return rebuild_cuda_tensor(*cuda_args)
    if len(args) != 3 or not _is_class(args[0], _TENSOR_CLASSES) or not isinstance(args[1], _STORAGE_CLASSES) \
            or not isinstance(args[2], tuple) or len(args[2]) != 4:
        raise IpcFormatError("is not a shared-memory tensor handle ((cls, storage, metadata) of rebuild_tensor)")
    return rebuild_tensor(*args)


def copy_out(buf: torch.Tensor, specs: Sequence[bk.TensorSpec], tensor_sizes: Sequence[int],
             device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The tensors packed from byte 0 of ``buf``, each copied to ``device``
    (the sender reuses its buffer once the update is answered)."""
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise IpcFormatError(f"maps a {buf.dtype} tensor of shape {tuple(buf.shape)}, not a flat uint8 buffer")
    total = sum(tensor_sizes)
    if total > buf.numel():
        raise IpcFormatError(f"maps {buf.numel()} bytes, fewer than tensor_sizes add up to ({total})")
    out = []
    for spec, piece in zip(specs, buf[:total].split(list(tensor_sizes))):
        t = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        t.view(-1).view(torch.uint8).copy_(piece)  # raw bytes: any offset, no alignment needed
        out.append((spec.name, t))
    return out
