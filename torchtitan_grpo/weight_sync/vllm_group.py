"""Trainer side of vLLM 0.33's NCCL weight-transfer group.

A real vLLM server (``--weight-transfer-config '{"backend":"nccl"}'``) does
not join a torch process group: each worker builds vLLM's own
``StatelessProcessGroup`` (a bare ``TCPStore`` used as a mailbox) and a
``PyNcclCommunicator`` (raw NCCL through ctypes). A trainer that uses
``group.py`` would publish torch's store keys, which no vLLM worker reads, and
both sides would wait forever. This module plays rank 0 of vLLM's scheme,
calling NCCL as a vLLM worker does, through ctypes (``nccl_lib``: torch's
``torch.cuda.nccl.init_rank`` fails on Python >= 3.10).

What it reproduces, from the vLLM 0.33.0 wheel (facts, no code taken):

* ``vllm/distributed/weight_transfer/nccl_common.py``: a worker's rank is
  ``rank_offset + dp_index * (TP*PP) + worker_rank``; the trainer is rank 0
  and passes ``world_size`` = 1 + all workers of all replicas in the group.
  ``nccl_unique_id_b64`` (standard base64 of the 128 raw id bytes) is an
  alternative rendezvous with no store, exclusive with master_address/port.
* ``vllm/distributed/utils.py`` ``StatelessProcessGroup.create``: rank 0 binds
  a listening socket (``SO_REUSEADDR``) on ``(host, port)`` and hosts a
  ``TCPStore`` on it (``master_listen_fd``, ``use_libuv=False``, 300 s
  timeout); other ranks connect as clients. No key prefix is used.
  ``broadcast_obj(obj, src)`` writes ``pickle.dumps(obj)`` under the key
  ``"broadcast_from/{src}/{n}"``, ``n`` counting that sender's broadcasts from 0.
* ``vllm/distributed/device_communicators/pynccl.py`` ``PyNcclCommunicator``:
  rank 0 calls ``ncclGetUniqueId`` and every rank calls
  ``group.broadcast_obj(unique_id, src=0)`` -- its first broadcast, hence key
  ``broadcast_from/0/0`` -- whose value is a pickled ``ncclUniqueId``, the
  ctypes Structure ``{internal: c_byte * 128}`` of
  ``vllm/distributed/device_communicators/pynccl_wrapper.py``. Then every rank
  calls ``ncclCommInitRank(world_size, unique_id, rank)`` and, as a warm-up,
  an ``all_reduce`` (sum) of ``torch.zeros(1)`` (float32, one element) on the
  current stream, then synchronizes. A peer that skips the warm-up hangs every
  rank on the first real collective.
* ``PyNcclCommunicator.broadcast``: ``ncclBroadcast`` of ``tensor.numel()``
  elements of the tensor's own NCCL dtype, root = src, in place.
* ``vllm/distributed/weight_transfer/nccl_engine.py`` /
  ``packed_tensor.py``: unpacked, one broadcast per tensor in ``names`` order;
  packed, tensors' raw bytes are concatenated in order and a chunk is sent
  (one uint8 broadcast) right after the tensor that takes it past
  ``packed_buffer_size_bytes`` (``buckets.plan_packed_chunks``).
  ``packed_num_buffers`` only sets how many chunks are in flight.

What it cannot guarantee, and what to check on the first real run:

* NCCL versions: torch's NCCL and vLLM's (vLLM loads ``libnccl.so.2`` with
  ctypes, usually the ``nvidia-nccl-cu12`` wheel's) must be wire-compatible;
  NCCL promises that only for equal versions. Log both.
* The pickle names vLLM's class by module path
  (``vllm.distributed.device_communicators.pynccl_wrapper.ncclUniqueId``);
  a vLLM that moves it needs :data:`VLLM_UNIQUE_ID_CLASS` changed. The
  ``nccl_unique_id_b64`` rendezvous avoids the pickle (and the store) and is
  the more robust choice where the server accepts it.
* Only the trainer (rank 0) sends: every broadcast's root is 0.
* Abort is ``ncclCommAbort`` (not destroy, which may wait for peers that are
  busy or gone).
* CI has no GPU: the unit tests drive the store layout and the collective
  sequence against a fake worker written from the facts above, and
  ``nccl_lib``'s calls against a fake library.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import pickle
import socket
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, Sequence

import torch
from torch.distributed import TCPStore

from torchtitan_grpo.reasons import reason
from torchtitan_grpo.weight_sync.buckets import TensorSpec, pack, plan_packed_chunks
from torchtitan_grpo.weight_sync.nccl_lib import UNIQUE_ID_BYTES, CtypesNccl

logger = logging.getLogger(__name__)

VLLM_UNIQUE_ID_CLASS = ("vllm.distributed.device_communicators.pynccl_wrapper", "ncclUniqueId")
"""Module and name of the ctypes class a vLLM worker unpickles the id into."""
STORE_TIMEOUT_S = 300.0  # StatelessProcessGroup.create's default store_timeout


def broadcast_obj_key(src: int, count: int) -> str:
    """Store key of the ``count``-th ``StatelessProcessGroup.broadcast_obj`` from ``src``."""
    return f"broadcast_from/{src}/{count}"


UNIQUE_ID_KEY = broadcast_obj_key(0, 0)
"""Where every vLLM worker reads the NCCL unique id: rank 0's first broadcast."""


# --------------------------------------------------------------------------- #
# The pickled ncclUniqueId
# --------------------------------------------------------------------------- #


def pickle_unique_id(raw: bytes, cls: tuple[str, str] = VLLM_UNIQUE_ID_CLASS) -> bytes:
    """Pickle bytes that a vLLM worker's ``pickle.loads`` turns into its own
    ``ncclUniqueId`` holding ``raw``, without importing vLLM here.

    A ctypes Structure pickles as ``_ctypes._unpickle(cls, (__dict__, bytes(obj)))``;
    the stream below spells that call out opcode by opcode (protocol 3), so
    the class is referenced by name and only resolved on the vLLM side.
    """
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    module, name = cls
    return b"".join([
        b"\x80\x03",                                          # PROTO 3
        b"c_ctypes\n_unpickle\n",                             # GLOBAL _ctypes._unpickle
        b"c" + module.encode() + b"\n" + name.encode() + b"\n",  # GLOBAL the vLLM class
        b"}",                                                 # EMPTY_DICT (instance __dict__)
        b"C" + bytes([len(raw)]) + raw,                       # SHORT_BINBYTES the 128 bytes
        b"\x86",                                              # TUPLE2 (dict, bytes)
        b"\x86",                                              # TUPLE2 (cls, state)
        b"R",                                                 # REDUCE
        b".",                                                 # STOP
    ])


class _UniqueIdUnpickler(pickle.Unpickler):
    """Loads only ``_ctypes._unpickle``, a class named ``ncclUniqueId`` (and,
    for old protocols, ``_codecs.encode``): a store value is never trusted to
    run anything else."""

    class _Stub:
        pass

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_ctypes", "_unpickle"):
            return lambda cls, state: state[1]  # keep the raw bytes
        if (module, name) == ("_codecs", "encode"):  # how protocols < 3 spell bytes
            import codecs

            return codecs.encode
        if name == "ncclUniqueId":
            return self._Stub
        raise pickle.UnpicklingError(f"unexpected global {module}.{name} in a pickled NCCL unique id")


def load_unique_id(data: bytes) -> bytes:
    """The 128 raw bytes of a pickled vLLM ``ncclUniqueId`` (ours or vLLM's)."""
    raw = _UniqueIdUnpickler(io.BytesIO(data)).load()
    if not isinstance(raw, bytes) or len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"not a pickled {UNIQUE_ID_BYTES}-byte ncclUniqueId")
    return raw


# --------------------------------------------------------------------------- #
# NCCL calls (torch's own bindings; a fake stands in for tests)
# --------------------------------------------------------------------------- #


class NcclApi(Protocol):
    """The five NCCL operations the trainer side needs."""

    def unique_id(self) -> bytes: ...

    def init_rank(self, world_size: int, unique_id: bytes, rank: int, device: torch.device) -> Any:
        """Blocks until every rank of ``unique_id`` has called it."""

    def all_reduce(self, tensor: torch.Tensor, comm: Any) -> None:
        """In-place sum; returns once complete."""

    def broadcast(self, tensor: torch.Tensor, comm: Any, stream: Any = None) -> None:
        """In-place broadcast from rank 0; returns once complete."""

    def abort(self, comm: Any) -> None: ...


# --------------------------------------------------------------------------- #
# The group
# --------------------------------------------------------------------------- #


@dataclass
class VLLMWeightGroup:
    """Rank 0 of a vLLM weight-transfer group; the same surface as
    ``group.WeightGroup`` (broadcast / abort / close), so the pusher can drive
    either."""

    world_size: int
    device: torch.device
    _nccl: Any = field(repr=False)
    _comm: Any = field(repr=False)
    _store: Any = field(default=None, repr=False)
    """Kept alive: rank 0 hosts the store the workers are connected to."""
    rank: int = 0
    backend_name: str = "nccl"
    group_name: str = "vllm"
    _closed: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None, wait: bool = True) -> torch.Tensor:
        """Broadcast ``tensor`` (contiguous, on :attr:`device`) to every worker;
        return once it is complete. ``wait`` is accepted for the pusher's
        sake (``WeightGroup.broadcast``'s signature) and ignored: this path
        always waits on the host."""
        if self._closed:
            raise RuntimeError("vLLM weight group is closed")
        if src != 0:
            raise ValueError("the trainer is rank 0 and the only sender (src must be 0)")
        if not tensor.is_contiguous():
            raise ValueError("broadcast needs a contiguous tensor")
        self._nccl.broadcast(tensor, self._comm, stream)
        return tensor

    def abort(self) -> None:
        """Tear the communicator down without waiting for workers (unblocks a
        hung broadcast). The group cannot be used afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._nccl.abort(self._comm)
        except Exception as e:  # best effort by nature
            logger.warning("abort of the vLLM weight group failed: %s", reason(e))
        self._comm, self._store = None, None

    def close(self) -> None:
        # Abort, not destroy: a destroy finalizes, which may wait for workers
        # that are busy or gone; between transfers nothing is in flight.
        self.abort()

    @property
    def closed(self) -> bool:
        return self._closed


def open_store(host: str, port: int, world_size: int, timeout_s: float = STORE_TIMEOUT_S) -> TCPStore:
    """Host the rendezvous store as vLLM's rank 0 does: our own listening socket
    (SO_REUSEADDR, so a port just released by a previous group is reusable)
    handed to a non-libuv TCPStore. Returns at once; workers connect later."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()
        fd = sock.detach()
    except OSError:
        sock.close()
        raise
    try:
        return TCPStore(host, port, world_size, True, timedelta(seconds=timeout_s),
                        wait_for_workers=False, master_listen_fd=fd, use_libuv=False)
    except Exception:
        os.close(fd)
        raise


def _join(nccl: Any, world_size: int, unique_id: bytes, device: torch.device) -> Any:
    """``ncclCommInitRank`` as rank 0, then the 1-element float32 sum
    all_reduce every vLLM worker issues right after its own init."""
    comm = nccl.init_rank(world_size, unique_id, 0, device)
    warm = torch.zeros(1, dtype=torch.float32, device=device)
    nccl.all_reduce(warm, comm)
    return comm


def _device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def init_vllm_weight_group(
    master_address: str,
    master_port: int,
    world_size: int,
    device: torch.device | str | int | None = None,
    timeout_s: float = STORE_TIMEOUT_S,
    nccl: NcclApi | None = None,
) -> VLLMWeightGroup:
    """Store rendezvous: host the store, publish the unique id, join NCCL.

    Call it while ``/init_weight_transfer_engine`` (with the same address,
    port and world_size, ``rank_offset`` >= 1) is in flight on every replica of
    the group: it returns once every worker has joined and warmed up. The id
    is published before this rank enters ``ncclCommInitRank``, because each
    worker blocks on that key first.
    """
    if world_size < 2:
        raise ValueError(f"world_size must be >= 2 (trainer + at least one worker), got {world_size}")
    nccl = nccl or CtypesNccl()
    dev = _device(device)
    store = open_store(master_address, master_port, world_size, timeout_s)
    unique_id = nccl.unique_id()
    store.set(UNIQUE_ID_KEY, pickle_unique_id(unique_id))
    comm = _join(nccl, world_size, unique_id, dev)
    logger.info("vLLM weight group ready: rank 0 of %d, store %s:%d", world_size, master_address, master_port)
    return VLLMWeightGroup(world_size, dev, nccl, comm, store)


def mint_unique_id_b64(nccl: NcclApi | None = None) -> tuple[bytes, str]:
    """A fresh NCCL unique id and its standard base64 (``init_info.nccl_unique_id_b64``)."""
    raw = (nccl or CtypesNccl()).unique_id()
    return raw, base64.b64encode(raw).decode("ascii")


def init_vllm_weight_group_from_unique_id(
    unique_id: bytes,
    world_size: int,
    device: torch.device | str | int | None = None,
    nccl: NcclApi | None = None,
) -> VLLMWeightGroup:
    """Store-free rendezvous (vLLM 0.33's ``nccl_unique_id_b64``): join with an
    id minted by :func:`mint_unique_id_b64` while the init requests carrying
    it are in flight (NCCL init has no barrier: all ranks must enter it)."""
    if len(unique_id) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
    nccl = nccl or CtypesNccl()
    dev = _device(device)
    return VLLMWeightGroup(world_size, dev, nccl, _join(nccl, world_size, unique_id, dev))


def send_weights(
    group: Any,
    named: Sequence[tuple[str, torch.Tensor]],
    packed: bool,
    packed_buffer_size_bytes: int = 1 << 30,
    stream: Any = None,
) -> int:
    """Broadcast one ``/update_weights`` worth of tensors as vLLM receives them
    (the HTTP call with the same names, in the same order, must be in flight).
    Returns the number of broadcasts."""
    if not packed:
        for _, t in named:
            group.broadcast(t.contiguous(), src=0, stream=stream)
        return len(named)
    tensors = dict(named)
    chunks = plan_packed_chunks([TensorSpec.of(n, t) for n, t in named], packed_buffer_size_bytes)
    for chunk in chunks:
        group.broadcast(pack([tensors[s.name] for s in chunk]), src=0, stream=stream)
    return len(chunks)
