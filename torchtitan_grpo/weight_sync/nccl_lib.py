"""The NCCL calls the trainer needs to be rank 0 of a real vLLM's weight group,
made on ``libnccl`` through ctypes.

Why not ``torch.cuda.nccl``: its ``init_rank`` parses the unique id with a
``#`` format under a C API that has not defined ``PY_SSIZE_T_CLEAN``, and on
Python 3.10 and later every call fails with "PY_SSIZE_T_CLEAN macro must be
defined for '#' formats" (first met on an H200 with torch 2.11 and Python
3.12, run 147). A vLLM worker talks to NCCL the same way this module does
(ctypes on the library), so the two sides call the same functions of the same
library with the same arguments.

The library is the one this process already loaded (torch's own NCCL), found
by ``loaded_libnccl``; only if none is loaded is ``libnccl.so.2`` opened by
name. NCCL's signatures and enum values are its public ABI (nccl.h).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Any, Callable

import torch

UNIQUE_ID_BYTES = 128

# ncclDataType_t (nccl.h)
DTYPES = {
    torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4,
    torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9,
}
SUM = 0  # ncclRedOp_t ncclSum


class UniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 opaque bytes, passed to ``ncclCommInitRank`` by value."""

    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


def loaded_libnccl() -> ctypes.CDLL | None:
    """The NCCL this process already loaded: a static build exports its
    symbols globally; a dynamic one is found by soname or in /proc/self/maps,
    without loading a second copy."""
    candidates: list[Callable[[], ctypes.CDLL]] = [lambda: ctypes.CDLL(None)]
    candidates.append(lambda: ctypes.CDLL("libnccl.so.2", mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL))
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libnccl" in line}
        candidates += [lambda p=p: ctypes.CDLL(p, mode=os.RTLD_NOLOAD) for p in sorted(paths)]
    except OSError:
        pass
    for make in candidates:
        try:
            lib = make()
            if hasattr(lib, "ncclCommInitRank"):
                return lib
        except OSError:
            continue
    return None


def open_libnccl() -> ctypes.CDLL:
    """The loaded NCCL, else ``libnccl.so.2`` opened by name; an error that says which."""
    lib = loaded_libnccl()
    if lib is not None:
        return lib
    try:
        return ctypes.CDLL("libnccl.so.2")
    except OSError as e:
        raise RuntimeError(f"no NCCL library: none is loaded in this process and libnccl.so.2 cannot be opened "
                           f"({e}); a vLLM weight group over NCCL needs torch's CUDA build") from e


def _signatures(lib: Any) -> None:
    """Declare the six functions' C signatures (ctypes guesses int otherwise,
    which truncates the pointers)."""
    res, ptr, i32, size = ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.ncclGetErrorString.restype, lib.ncclGetErrorString.argtypes = ctypes.c_char_p, [res]
    lib.ncclGetUniqueId.restype, lib.ncclGetUniqueId.argtypes = res, [ctypes.POINTER(UniqueId)]
    lib.ncclCommInitRank.restype = res
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ptr), i32, UniqueId, i32]
    lib.ncclAllReduce.restype = res
    lib.ncclAllReduce.argtypes = [ptr, ptr, size, i32, i32, ptr, ptr]
    lib.ncclBroadcast.restype = res
    lib.ncclBroadcast.argtypes = [ptr, ptr, size, i32, i32, ptr, ptr]
    lib.ncclCommAbort.restype, lib.ncclCommAbort.argtypes = res, [ptr]


def _stream(tensor: torch.Tensor, stream: Any) -> tuple[int, Callable[[], None]]:
    """The CUDA stream handle a collective on ``tensor`` runs on (``stream``,
    else the device's current one) and how to wait for it; a CPU tensor (only
    the tests' fake library sees one) gets the null stream and no wait."""
    if tensor.device.type != "cuda":
        return 0, lambda: None
    s = stream or torch.cuda.current_stream(tensor.device)
    return s.cuda_stream, s.synchronize


class CtypesNccl:
    """``vllm_group.NcclApi`` on libnccl through ctypes. A communicator is the
    ``ncclComm_t`` pointer as an int. ctypes releases the GIL during each
    call, so a rank blocked in ``ncclCommInitRank`` stops no other thread."""

    def __init__(self, lib: Any = None):
        self.lib = lib if lib is not None else open_libnccl()
        _signatures(self.lib)

    def _check(self, what: str, rc: int) -> None:
        if rc != 0:
            text = self.lib.ncclGetErrorString(rc)
            raise RuntimeError(f"{what} failed: NCCL error {rc} ({text.decode() if text else 'unknown'})")

    def unique_id(self) -> bytes:
        uid = UniqueId()
        self._check("ncclGetUniqueId", self.lib.ncclGetUniqueId(ctypes.byref(uid)))
        return bytes(uid.internal)

    def init_rank(self, world_size: int, unique_id: bytes, rank: int, device: torch.device) -> int:
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        uid = UniqueId()
        ctypes.memmove(uid.internal, unique_id, UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        # The communicator binds the current device (a CPU device: only the tests' fake library).
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            self._check("ncclCommInitRank", self.lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid, rank))
        return comm.value

    def _dtype(self, t: torch.Tensor) -> int:
        if t.dtype not in DTYPES:
            raise ValueError(f"NCCL has no type for {t.dtype}")
        if not t.is_contiguous():
            raise ValueError("NCCL needs a contiguous tensor")
        return DTYPES[t.dtype]

    def all_reduce(self, tensor: torch.Tensor, comm: int) -> None:
        handle, wait = _stream(tensor, None)
        p = ctypes.c_void_p(tensor.data_ptr())
        self._check("ncclAllReduce", self.lib.ncclAllReduce(p, p, tensor.numel(), self._dtype(tensor), SUM,
                                                            ctypes.c_void_p(comm), ctypes.c_void_p(handle)))
        wait()

    def broadcast(self, tensor: torch.Tensor, comm: int, stream: Any = None) -> None:
        handle, wait = _stream(tensor, stream)
        p = ctypes.c_void_p(tensor.data_ptr())
        self._check("ncclBroadcast", self.lib.ncclBroadcast(p, p, tensor.numel(), self._dtype(tensor), 0,
                                                            ctypes.c_void_p(comm), ctypes.c_void_p(handle)))
        wait()

    def abort(self, comm: int) -> None:
        self._check("ncclCommAbort", self.lib.ncclCommAbort(ctypes.c_void_p(comm)))
