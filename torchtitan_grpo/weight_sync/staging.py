"""The Pusher's snapshots: staging buffers in the transport's bucket layout.

``push`` copies the trainer's tensors into a free staging buffer (``stage``:
flattened buckets, a device copy on GPUs, cast to the push dtype on the way)
and publishes it as the newest version; each replica's sender takes the
newest (``take``) and gives it back when its transfer ends. A buffer being
read by a sender is never rewritten; the newest one, not yet taken, may be.
One lock (``StagingBuffers.lock``) guards the buffers, the newest version and
every replica's ``holding``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

import torch

from torchtitan_grpo.weight_sync import buckets as bk
from torchtitan_grpo.weight_sync.control import PushError
from torchtitan_grpo.weight_sync.push_config import PushConfig


@dataclass
class BucketCopy:
    """Where the tensors of one bucket go in its staging buffer (made once per
    buffer: a snapshot is then a foreach copy of the small tensors and a plain
    copy of each large one, with no per-tensor Python on the trainer's thread
    beyond that)."""

    names: list[str]
    views: list[torch.Tensor]
    """Typed views (``buckets.slots``) of the small tensors named in ``names``."""
    large: list[tuple[str, torch.Tensor]]
    """(name, typed view) of tensors of ``PushConfig.large_tensor_bytes`` or more."""
    raw: list[tuple[str, torch.dtype, torch.Tensor]]
    """(name, dtype, uint8 slot) of tensors at an unaligned offset (vLLM chunks)."""

    @classmethod
    def of(cls, buf: torch.Tensor, bucket: list[bk.TensorSpec], large_bytes: int) -> BucketCopy:
        c = cls([], [], [], [])
        for spec, slot in zip(bucket, bk.slots(buf, bucket)):
            if slot.dtype != spec.dtype:
                c.raw.append((spec.name, spec.dtype, slot))
            elif spec.nbytes >= large_bytes:
                c.large.append((spec.name, slot))
            else:
                c.names.append(spec.name)
                c.views.append(slot)
        return c


@dataclass
class Staged:
    version: int
    """-1 while the trainer writes into it: no sender may take it then."""
    plan: list[list[bk.TensorSpec]]
    """The buckets (or vLLM chunks) of ``buffers``: the plan when they were made."""
    buffers: list[torch.Tensor]
    copies: list[BucketCopy]
    """Per bucket, where each of its tensors goes."""
    ready: list[torch.cuda.Event] | None = None
    """GPUs: one event per bucket, recorded after its copy, so the broadcast
    of bucket 0 can start while later buckets are still being copied."""
    users: int = 0
    pinned: bool = False
    """Pinned host memory, written by asynchronous copies from the GPU."""
    written: threading.Event = field(default_factory=threading.Event)
    """Set once the trainer has queued every copy into the buffers (and
    recorded ``ready``). A push that waits hands the version to the senders
    *before* that, so that their HTTP control plane (pause, begin, the first
    update request, the replica's parsing) runs while the trainer's thread is
    still staging; whatever reads the buffers waits for this first
    (``await_written``)."""
    queued: int = 0
    """How many buckets, from the first, have their copies queued (and their
    ``ready`` recorded): bucket 0 can be broadcast while the trainer's thread
    is still queueing the copies of the others."""
    failed: str = ""
    """Why the trainer's staging of this version raised, if it did."""
    _changed: threading.Condition = field(default_factory=threading.Condition)

    def start_writing(self) -> None:
        with self._changed:
            self.failed, self.queued = "", 0
            self.written.clear()

    def bucket_queued(self, k: int) -> None:
        """The trainer's thread: bucket ``k``'s copies are queued."""
        with self._changed:
            self.queued = k + 1
            self._changed.notify_all()

    def done_writing(self, failed: str = "") -> None:
        with self._changed:
            self.failed = failed
            self.written.set()
            self._changed.notify_all()

    def await_written(self, stop: threading.Event | None = None, bucket: int | None = None) -> None:
        """Block (a sender's thread, never the event loop) until the trainer
        has staged this version (with ``bucket``: queued that bucket's
        copies); raise if staging failed first. Returns early, without
        raising, once ``stop`` is set (the transfer is being abandoned)."""
        with self._changed:
            while not (self.written.is_set() or (bucket is not None and self.queued > bucket)):
                if stop is not None and stop.is_set():
                    return
                self._changed.wait(0.05)
            failed = self.failed if bucket is None or self.queued <= bucket else ""
        if failed:
            raise PushError(f"the trainer's snapshot of version {self.version} failed: {failed}")


class Layout(Protocol):
    """What the staging needs of the transport (``transport.Transport`` is one)."""

    @property
    def reads_host_memory(self) -> bool: ...

    def plan(self, specs: list[bk.TensorSpec]) -> list[list[bk.TensorSpec]]: ...

    def prepare_buffers(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]: ...


class Reader(Protocol):
    """What ``StagingBuffers.take`` needs of a replica (``transport.Replica`` is one)."""

    version: int
    holding: Staged | None


class StagingBuffers:
    """Up to ``num_staging_buffers`` snapshots, made on first need, in the
    layout ``transport.plan`` gives; rank 0's trainer thread writes them,
    the senders read them."""

    def __init__(self, cfg: PushConfig, device: torch.device, transport: Layout):
        self.cfg, self.device, self.transport = cfg, device, transport
        self.lock = threading.Lock()
        self.buffers: list[Staged] = []
        self.latest: Staged | None = None
        self.newest = -1
        """The newest version staged (``latest`` may be being rewritten)."""
        self.plan: list[list[bk.TensorSpec]] | None = None
        self._plan_key: list[tuple] | None = None  # (name, dtype, shape) of the tensors it was planned for
        self.bytes_per_version = 0

    @property
    def pinned(self) -> bool:
        """Whether a snapshot is a copy to pinned host memory left running on
        the caller's stream (``Pusher.stages_async``): from a GPU with
        staging "host", or to a transport that reads host memory anyway (a
        copy into pageable memory would hold the trainer's thread for the
        whole transfer over PCIe)."""
        return self.device.type == "cuda" and (self.cfg.staging == "host" or self.transport.reads_host_memory)

    def replan(self, tensors: dict[str, torch.Tensor]) -> None:
        """Plan the buckets of ``tensors`` unless they are the ones planned
        for (a training run pushes the same tensors every step: this check
        is a list of tuples, not of TensorSpecs, ~300 tensors per push)."""
        key = [(n, t.dtype, t.shape) for n, t in tensors.items()]
        if key == self._plan_key:
            return
        cast = self.cfg.dtype
        specs = [bk.TensorSpec(n, cast if cast is not None and t.is_floating_point() else t.dtype,
                               tuple(t.shape)) for n, t in tensors.items()]
        plan = self.transport.plan(specs)
        with self.lock:  # buffers of an older plan are dropped once no sender holds them
            self.plan, self._plan_key = plan, key
        self.bytes_per_version = sum(s.nbytes for s in specs)

    def free_buffer(self) -> Staged | None:
        """A staging buffer no sender is reading: the not-yet-picked latest one
        can be overwritten (senders skip to the newest anyway). It is marked
        as being written (version -1) so that no sender takes it meanwhile."""
        with self.lock:
            # Tensors of another shape than before (not in a training run): new buffers.
            self.buffers = [s for s in self.buffers if s.plan is self.plan or s.users]
            for s in self.buffers:
                if s.users == 0:
                    s.version = -1
                    return s
            if len(self.buffers) >= self.cfg.num_staging_buffers:
                return None
            plan = self.plan
        # A new buffer, made outside the lock (pinning gigabytes of host memory
        # takes seconds; senders take the lock): only this thread adds buffers.
        s = self._allocate(plan)
        with self.lock:
            self.buffers.append(s)
        return s

    def _allocate(self, plan: list[list[bk.TensorSpec]]) -> Staged:
        on_device = not self.transport.reads_host_memory and self.cfg.staging == "device"
        where = self.device if on_device else torch.device("cpu")
        pinned = self.pinned
        try:
            bufs = [torch.empty(bk.packed_nbytes(b), dtype=torch.uint8, device=where, pin_memory=pinned)
                    for b in plan]
            bufs = self.transport.prepare_buffers(bufs)
        except RuntimeError as e:  # torch.OutOfMemoryError included
            what = "pinned host" if pinned else f"{where}"
            if self.transport.reads_host_memory:  # host memory is the only choice: staging changes nothing
                remedy = "lower weight_sync.num_staging_buffers"
            else:
                other = ('"device"' if self.cfg.staging == "host" else '"host" (pinned host memory, slower pushes)')
                remedy = f"lower weight_sync.num_staging_buffers or set weight_sync.staging = {other}"
            raise PushError(
                f"staging buffer {len(self.buffers) + 1} of {self.cfg.num_staging_buffers} "
                f"({sum(bk.packed_nbytes(b) for b in plan) / 1e9:.2f} GB of {what} memory) could not be "
                f"allocated: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; {remedy}") from e
        copies = [BucketCopy.of(buf, b, self.cfg.large_tensor_bytes) for buf, b in zip(bufs, plan)]
        return Staged(-1, plan, bufs, copies, pinned=pinned)

    def stage(self, staged: Staged, tensors: dict[str, torch.Tensor]) -> None:
        """Copy ``tensors`` into ``staged``, cast to the push dtype on the way
        (one pass over the weights, no temporary), as ``BucketCopy`` says."""
        cuda = self.device.type == "cuda"
        if cuda and staged.ready is None:
            staged.ready = [torch.cuda.Event() for _ in staged.plan]
        pinned = staged.pinned  # copies to pinned memory are queued, not waited for
        with torch.no_grad():
            for k, c in enumerate(staged.copies):
                if pinned:  # one launch per tensor either way (a foreach copy across devices loops too)
                    for n, view in zip(c.names, c.views):
                        view.copy_(tensors[n], non_blocking=True)
                elif c.names:
                    torch._foreach_copy_(c.views, [tensors[n] for n in c.names])
                for name, view in c.large:
                    view.copy_(tensors[name], non_blocking=pinned)
                for name, dtype, slot in c.raw:  # an unaligned offset in a vLLM packed chunk
                    slot.copy_(tensors[name].to(dtype).contiguous().reshape(-1).view(torch.uint8),
                               non_blocking=pinned)
                if cuda:
                    staged.ready[k].record()  # the GPU orders this bucket's broadcast after its copies
                staged.bucket_queued(k)  # and its sender may queue that broadcast now

    def publish(self, staged: Staged, version: int) -> None:
        """Make ``staged`` the newest version (the caller wakes the senders)."""
        with self.lock:
            staged.version = version
            self.latest = staged
            self.newest = max(self.newest, version)

    def withdraw(self, staged: Staged, error: BaseException) -> None:
        """The trainer's staging of ``staged`` raised: a version no sender
        took is as if never published; one a sender took tells it why."""
        with self.lock:
            if staged.users == 0:
                staged.version = -1
        staged.done_writing(f"{type(error).__name__}: {error}")

    def take(self, r: Reader) -> Staged | None:
        """The staged version ``r`` should get next (None: it has the newest,
        or the newest is still being written); ``give_back`` when its
        transfer ends."""
        with self.lock:
            staged = self.latest
            if staged is None or staged.version <= r.version:
                return None
            staged.users += 1
            r.holding = staged
            return staged

    def give_back(self, r: Reader, staged: Staged) -> None:
        with self.lock:
            staged.users -= 1
            r.holding = None
