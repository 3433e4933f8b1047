"""A weight-transfer process group that lives beside torch.distributed's default group.

The trainer already owns a default process group (FSDP/TP collectives) and an
inference server owns none, yet the two must share one broadcast channel per
replica. So this module builds the backend object directly on its own
``TCPStore`` instead of going through ``init_process_group``: any number of such
groups can coexist in one process (one per replica), and none of them can
interleave with the trainer's FSDP collectives.

Wire compatibility with SGLang matters more than elegance here. SGLang's
``/init_weights_update_group`` joins the group through ``rendezvous(tcp://..)``
plus ``PrefixStore(group_name)`` and torch's private ``_new_process_group_helper``
(which adds ``"<group_name>/"`` and ``"<device>/"`` prefixes and, for gloo, a
sequence-number handshake through the store). We reproduce that same key layout
and handshake, so a trainer using this module can push to a real SGLang server
as well as to the built-in one.

NCCL communicators are created lazily, on the first broadcast, exactly as SGLang
does: an eagerly connecting trainer would wait forever for a server that only
connects on its first receive. ``eager_connect=True`` is there for pairs where
both sides use this module.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import PrefixStore, TCPStore

from torchtitan_grpo.reasons import reason

logger = logging.getLogger(__name__)

_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "ip6-localhost"}


def _is_loopback(address: str) -> bool:
    if address in _LOOPBACK_NAMES:
        return True
    try:
        return socket.inet_aton(address)[0] == 127
    except OSError:
        return False


def local_address_towards(master_address: str, master_port: int) -> str:
    """The local IP this host uses to reach ``master_address``.

    Gloo's default device resolves this machine's hostname, which on many hosts
    (containers, laptops) maps to an address peers cannot reach or to nothing
    at all. Asking the kernel which source address it would route from needs
    no name resolution and no packet (UDP ``connect`` only picks a route).
    """
    if _is_loopback(master_address):
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in master_address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((master_address, master_port or 9))
        return s.getsockname()[0]


def _gloo_options(master_address: str, master_port: int, timeout: timedelta) -> Any:
    """Gloo options with one device bound to the right interface or address."""
    from torch.distributed import ProcessGroupGloo

    opts = ProcessGroupGloo._Options()
    opts._timeout = timeout
    # GLOO_SOCKET_IFNAME is the documented override; honour it like torch does.
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname:
        devices = [ProcessGroupGloo.create_device(interface=i) for i in ifname.split(",")]
    else:
        host = local_address_towards(master_address, master_port)
        devices = [ProcessGroupGloo.create_device(hostname=host)]
    opts._devices = devices
    opts._threads = 2  # one transfer at a time per group: a couple of threads suffice
    return opts


def _make_backend(
    store: Any,
    rank: int,
    world_size: int,
    backend: str,
    group_name: str,
    timeout: timedelta,
    device: torch.device | None,
    master_address: str,
    master_port: int,
) -> Any:
    # Same prefix chain as torch's _new_process_group_helper, which SGLang uses.
    group_store = PrefixStore(f"{group_name}/", store)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        dev_store = PrefixStore("cpu/", group_store)
        pg = ProcessGroupGloo(
            dev_store, rank, world_size, _gloo_options(master_address, master_port, timeout)
        )
    elif backend == "nccl":
        if not torch.distributed.is_nccl_available():
            raise RuntimeError("backend 'nccl' requested but this torch build has no NCCL")
        from torch.distributed import ProcessGroupNCCL

        dev_store = PrefixStore("cuda/", group_store)
        opts = ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        opts.group_name = group_name
        opts.global_ranks_in_group = list(range(world_size))
        pg = ProcessGroupNCCL(dev_store, rank, world_size, opts)
    else:
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    # Gloo ranks exchange a sequence number through the store here; a peer that
    # skipped it would block forever on the key, so keep torch's handshake.
    pg._set_sequence_number_for_group()
    return pg


class Posted:
    """A collective posted without a host wait (``WeightGroup.post_broadcast``):
    a CUDA event after it (NCCL) or the backend's work handle (gloo)."""

    def __init__(self, event: "torch.cuda.Event | None" = None, work: Any = None):
        self._event, self._work = event, work

    def done(self) -> bool:
        """Whether it has completed (never blocks)."""
        return self._event.query() if self._event is not None else self._work.is_completed()

    def wait(self) -> None:
        """Block until it has completed; a gloo failure (its timeout, an abort) raises."""
        if self._event is not None:
            self._event.synchronize()
        else:
            self._work.wait()


@dataclass
class WeightGroup:
    """One weight-transfer group (rank 0 = trainer, others = inference ranks).

    Holds the store and the backend object; not registered with
    torch.distributed, so the default group (if any) is untouched.
    """

    backend_name: str
    """"gloo" or "nccl"."""
    rank: int
    world_size: int
    group_name: str
    device: torch.device
    """Where received tensors live: cpu for gloo, the bound GPU for nccl."""
    _store: Any = field(repr=False)
    _pg: Any = field(repr=False)
    _closed: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, stream: "torch.cuda.Stream | None" = None,
        wait: bool = True,
    ) -> torch.Tensor:
        """Broadcast ``tensor`` from ``src`` in place; return once it is complete.

        For NCCL the collective is ordered after the work already on
        ``stream`` (or the current stream), and that stream after the
        collective; the host then waits for it, so the caller may read or
        reuse the tensor right after the call. ``wait=False`` skips the host
        wait (NCCL only): the next collective can be posted at once and work
        queued on the stream afterwards still sees the received bytes.
        """
        opts = self._broadcast_options(tensor, src)
        if self.backend_name == "nccl":
            ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
            with ctx:
                work = self._pg.broadcast([tensor], opts)
                work.wait()  # orders the current stream after the collective
                if wait:
                    torch.cuda.current_stream(tensor.device).synchronize()
        else:
            self._pg.broadcast([tensor], opts).wait()
        return tensor

    def post_broadcast(self, tensor: torch.Tensor, src: int = 0,
                       stream: "torch.cuda.Stream | None" = None) -> "Posted":
        """Post a broadcast of ``tensor`` from ``src`` and return at once: the
        receiver's side of an update that is acknowledged before its bytes are
        in. NCCL orders it on ``stream`` (or the current stream) like
        :meth:`broadcast` with ``wait=False``; gloo runs it on its own threads,
        each collective matched to the sender's by its sequence number, so
        several may be posted in a row. ``Posted.wait`` blocks until it is done."""
        opts = self._broadcast_options(tensor, src)
        if self.backend_name != "nccl":
            return Posted(work=self._pg.broadcast([tensor], opts))
        on = stream if stream is not None else torch.cuda.current_stream(tensor.device)
        with torch.cuda.stream(on):
            self._pg.broadcast([tensor], opts).wait()  # orders ``on`` after the collective
            done = torch.cuda.Event()
            done.record(on)
        return Posted(event=done)

    def _broadcast_options(self, tensor: torch.Tensor, src: int) -> Any:
        """What both kinds of broadcast check first, and their options."""
        if self._closed:
            raise RuntimeError(f"weight group {self.group_name!r} is closed")
        if not tensor.is_contiguous():
            raise ValueError("broadcast needs a contiguous tensor")
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        return opts

    def abort(self) -> None:
        """Tear the group down without waiting for peers (unblocks a hung receive
        where the backend supports it). The group cannot be used afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._pg.abort()
        except Exception as e:  # abort is best effort by nature
            logger.warning("abort of weight group %s failed: %s", self.group_name, reason(e))

    def close(self) -> None:
        """Release the communicator and the store connection; never waits for peers.

        NCCL's graceful ``shutdown()`` finalizes the communicator, which waits
        until the peer finalizes too: a replica destroying its group while the
        trainer is busy (or gone) would hang. Between transfers nothing is in
        flight, so ``abort()`` frees the same resources without that wait.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self.backend_name == "nccl":
                self._pg.abort()
        except Exception as e:
            logger.warning("closing weight group %s failed: %s", self.group_name, reason(e))
        self._pg = None
        self._store = None

    @property
    def closed(self) -> bool:
        return self._closed


def master_store(master_address: str, world_size: int, timeout_s: float = 300.0) -> TCPStore:
    """Rank 0's store, already listening, on a port the OS picked (its
    ``port``), for :func:`init_weight_group`'s ``store``. A port merely
    probed free and bound later can be taken in between, by this process's
    own outgoing connections among others (the HTTP calls of a join): the
    store then cannot listen and the peer retries its connect until its
    timeout (2 H200s: two benchmark runs stalled 120 s that way, 44 and 49)."""
    return TCPStore(host_name=master_address, port=0, world_size=world_size, is_master=True,
                    timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def init_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    group_name: str = "weight_update_group",
    timeout_s: float = 300.0,
    device: torch.device | str | int | None = None,
    eager_connect: bool = False,
    store: TCPStore | None = None,
) -> WeightGroup:
    """Join (rank > 0) or host (rank 0) a weight-transfer group; block until usable.

    Rank 0 starts a ``TCPStore`` server on ``master_address:master_port``;
    the other ranks connect to it as clients (retrying until ``timeout_s``), so
    all ranks may call this concurrently and in any order. For gloo the call
    returns once every rank is connected; for NCCL once the store handshake is
    done (the communicator itself forms on the first broadcast unless
    ``eager_connect``).

    ``device`` is the GPU the NCCL communicator is bound to (defaults to the
    current CUDA device); gloo always works on CPU tensors. ``store``
    (rank 0): a :func:`master_store` to host the group on instead of
    starting one on ``master_port`` (then its port).
    """
    if world_size < 2:
        raise ValueError(f"world_size must be >= 2 (trainer + at least one server), got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not group_name:
        raise ValueError("group_name must not be empty")
    if store is not None:
        if rank != 0:
            raise ValueError(f"only rank 0 hosts the store, got a store for rank {rank}")
        master_port = store.port
    timeout = timedelta(seconds=timeout_s)

    if backend == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"nccl needs a CUDA device, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")

    # Rank 0 must not wait for workers in the store constructor: the HTTP call
    # that makes a server join may only be answered after this returns.
    if store is None:
        store = TCPStore(
            host_name=master_address,
            port=master_port,
            world_size=world_size,
            is_master=(rank == 0),
            timeout=timeout,
            wait_for_workers=False,
        )
    store = PrefixStore(group_name, store)  # SGLang's own namespace layer
    # The NCCL backend picks up the current device for its internal streams.
    ctx = torch.cuda.device(dev) if dev.type == "cuda" else nullcontext()
    with ctx:
        pg = _make_backend(
            store, rank, world_size, backend, group_name, timeout, dev, master_address, master_port
        )
        if eager_connect and backend == "nccl":
            pg.eager_connect_single_device(dev)
    logger.info(
        "weight group %r ready: backend=%s rank=%d/%d store=%s:%d",
        group_name, backend, rank, world_size, master_address, master_port,
    )
    return WeightGroup(
        backend_name=backend,
        rank=rank,
        world_size=world_size,
        group_name=group_name,
        device=dev,
        _store=store,
        _pg=pg,
    )
