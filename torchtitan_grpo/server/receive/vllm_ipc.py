"""vLLM's IPC weight transfer, receive side of the built-in server's vLLM
routes (``vllm_weights``): an ``/update_weights`` whose ``update_info`` names
a buffer of the trainer's by handle (``weight_sync.vllm_ipc``), packed as
vLLM's IPC engine sends it. The tensors are copied out before the reply, so
the trainer may reuse its buffer as soon as it has the answer.

Only what vLLM 0.26's ``IPCWeightTransferUpdateInfo`` takes is accepted, and
only its packed form over HTTP (``ipc_handles_pickled``, one buffer): the
unpacked form needs one handle per tensor and Ray's in-process
``ipc_handles``, neither of which a trainer sends over HTTP to this server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_grpo.server.vllm_http import bad as _bad, field as _field
from torchtitan_grpo.protocol import vllm as proto
from torchtitan_grpo.weight_sync import vllm_ipc
from torchtitan_grpo.weight_sync.buckets import SpecError, TensorSpec, specs_from_lists
from torchtitan_grpo.weight_sync.ipc import IpcFormatError

HANDLES = "update_info.ipc_handles_pickled"


@dataclass
class IpcUpdate:
    """A checked packed IPC ``update_info``."""

    specs: list[TensorSpec]
    tensor_sizes: list[int]
    handles: str
    """``ipc_handles_pickled``, decoded only when it is used (``receive``)."""


def is_ipc_update(info: Any) -> bool:
    """Whether an ``update_info`` is meant for the IPC engine (it names handles)."""
    return isinstance(info, dict) and ("ipc_handles_pickled" in info or "ipc_handles" in info)


def parse_ipc_update_info(info: Any) -> IpcUpdate:
    if not isinstance(info, dict):
        raise _bad("'update_info' must be an object", "update_info")
    unknown = sorted(set(info) - proto.IPC_UPDATE_INFO_KEYS)
    if unknown:
        raise _bad(f"Invalid update_info for the IPC engine: unexpected key(s) {unknown}; "
                   f"accepted: {sorted(proto.IPC_UPDATE_INFO_KEYS)}", f"update_info.{unknown[0]}")
    if info.get("ipc_handles") is not None:
        raise _bad("update_info.ipc_handles (in-process handles) cannot come over HTTP: send "
                   "ipc_handles_pickled", "update_info.ipc_handles")
    w = "update_info."
    if _field(info, "packed", "bool", False, where=w) is not True:
        raise _bad("update_info.packed must be true: the built-in server takes IPC updates as one packed "
                   "buffer (ipc_handles_pickled of one buffer, tensor_sizes in bytes)", "update_info.packed")
    handles = info.get("ipc_handles_pickled")
    if not isinstance(handles, str):
        raise _bad(f"missing required field '{HANDLES}' (a base64 string)", HANDLES)
    names = _field(info, "names", "list", [], where=w)
    try:
        specs = specs_from_lists(names, _field(info, "dtype_names", "list", [], where=w),
                                 _field(info, "shapes", "list", [], where=w), ("names", "dtype_names", "shapes"),
                                 prefix=w, empty_names=False)
    except SpecError as e:
        raise _bad(str(e), e.field or "update_info") from None
    sizes = _field(info, "tensor_sizes", "list", None, where=w)
    if sizes is None:
        raise _bad("update_info.tensor_sizes is required when packed is true", "update_info.tensor_sizes")
    if len(sizes) != len(specs):
        raise _bad(f"update_info.tensor_sizes has {len(sizes)} entries for {len(specs)} names",
                   "update_info.tensor_sizes")
    for i, (n, spec) in enumerate(zip(sizes, specs)):
        if not isinstance(n, int) or isinstance(n, bool) or n != spec.nbytes:
            raise _bad(f"update_info.tensor_sizes[{i}] must be {spec.nbytes} ({spec.name}: "
                       f"{tuple(spec.shape)} {spec.dtype}), got {n!r}", f"update_info.tensor_sizes[{i}]")
    return IpcUpdate(specs, list(sizes), handles)


def receive(update: IpcUpdate, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Map the trainer's buffer and copy its tensors to ``device`` (the transfer thread)."""
    try:
        handles = vllm_ipc.decode_handles(update.handles)
    except IpcFormatError as e:
        raise _bad(f"{HANDLES} {e}", HANDLES) from None
    key = vllm_ipc.device_key(device)
    if key not in handles:
        raise _bad(f"{HANDLES} has no handle for this server's device {key!r} (it has {sorted(handles)}): "
                   "IPC reaches a server on the trainer's own GPU (or, on CPU, host)", HANDLES)
    try:
        buf = vllm_ipc.open_buffer(handles[key], device)
        return vllm_ipc.copy_out(buf, update.specs, update.tensor_sizes, device)
    except IpcFormatError as e:
        raise _bad(f"{HANDLES}[{key!r}] {e}", HANDLES) from None
