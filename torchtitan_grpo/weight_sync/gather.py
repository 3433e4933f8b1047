"""Full HF-named tensors from a sharded trainer, off the critical path.

With more than one trainer rank the weights a replica needs are spread over
ranks: FSDP/HSDP shards, TP shards, PP stages. ``ShardGatherer`` keeps the
trainer's cost to one device copy per step:

* ``snapshot(version)`` on every rank copies the rank's *local* shards into a
  free slot (cast to the push dtype on the way, so a bf16 push also halves
  the gather) and returns.
* A sidecar thread on every rank turns the slot into full tensors with
  collectives on communicators of its own: a copy of TorchTitan's device
  mesh built with its own process groups (``sidecar_mesh``), never the groups
  FSDP or TP use, on its own CUDA stream. So the gather overlaps the next
  step's forward/backward and cannot interleave with its collectives.
* PP stages other than rank 0's send their full tensors to rank 0 (point to
  point, on the sidecar's own world group). Rank 0 maps the whole set to HF
  names and hands it to ``deliver`` (the Pusher, which snapshots it again into
  its own staging buffers and sends each replica the newest version).

Every rank gathers every version in the same order (a skipped version on one
rank would desynchronise the collectives), so when all slots are still being
gathered ``snapshot`` waits for one; that wait is bounded by one gather among
trainer ranks and never by a replica. Replicas that are slow or dead only
make the Pusher skip versions, on rank 0's sidecar thread.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from torchtitan_grpo.distributed import stage_transfer

logger = logging.getLogger(__name__)

# TorchTitan 0.2.2's ParallelDims: the names of the dims its meshes unflatten
# the world into; a parameter's mesh is a sub-mesh of one of them ("sparse":
# MoE experts under expert parallelism, built only then).
_MESHES = {
    "dense": ("pp", "dp_replicate", "fsdp", "tp"),
    "dataloading": ("pp", "batch", "cp", "tp"),
    "sparse": ("pp", "dp_replicate", "efsdp", "ep", "etp"),
}


def _degrees(parallel_dims) -> dict[str, int]:
    p = parallel_dims
    ep, etp = getattr(p, "ep", 1), getattr(p, "etp", 1)  # layouts described without experts have none
    return {"pp": p.pp, "dp_replicate": p.dp_replicate, "fsdp": p.dp_shard * p.cp, "tp": p.tp,
            "batch": p.dp_replicate * p.dp_shard, "cp": p.cp, "ep": ep, "etp": etp,
            "efsdp": p.dp_shard * p.cp * p.tp // (ep * etp)}


def sidecar_mesh(parallel_dims, device_type: str, backend: str) -> dict[str, DeviceMesh]:
    """The trainer's meshes again, with process groups of their own.

    Same rank layout as TorchTitan's, so a parameter's placements mean the
    same thing on either; every dim of size > 1 gets a new communicator (an
    explicit backend keeps DeviceMesh from reusing the default group for a
    dim that spans the world). A collective: every rank calls it, once."""
    # registers the "fake" backend that TorchTitan, and we, give size-1 dims
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    world = dist.get_world_size()
    root = DeviceMesh(device_type, torch.arange(world), mesh_dim_names=("world",),
                      backend_override=((backend, None),))
    deg = _degrees(parallel_dims)
    meshes = {"world": root}
    for key, names in _MESHES.items():
        if key == "sparse" and deg["ep"] == 1:
            continue
        override = {n: (backend if deg[n] > 1 else "fake") for n in names}
        meshes[key] = root._unflatten(0, tuple(deg[n] for n in names), names, backend_override=override)
    return meshes


def _own_mesh(meshes: dict[str, DeviceMesh], mesh: DeviceMesh) -> DeviceMesh:
    """The sidecar's copy of ``mesh`` (a parameter's mesh), checked rank for rank."""
    names = mesh.mesh_dim_names
    for key in _MESHES:
        if key in meshes and names and all(n in _MESHES[key] for n in names):
            own = meshes[key][names]
            if not torch.equal(own.mesh, mesh.mesh):
                raise RuntimeError(f"sidecar mesh {names} has ranks {own.mesh.tolist()}, "
                                   f"the trainer's has {mesh.mesh.tolist()}")
            return own
    raise NotImplementedError(f"weight push: no sidecar mesh for a parameter on mesh dims {names}")


@dataclass
class _Param:
    names: list[str]  # TorchTitan FQNs (two for a tied parameter)
    live: torch.Tensor  # the parameter (DTensor or plain)
    kind: str  # "whole": full on this rank; "flat": sharded on one mesh dim; "dtensor": anything else
    mesh: DeviceMesh | None = None  # "dtensor": the sidecar's copy of its mesh
    dim: int = 0  # "flat": the tensor dim it is sharded on
    group_dim: int = 0  # "flat": the mesh dim it is sharded over
    ways: int = 1  # "flat": the number of shards
    offset: int = 0  # "flat": where its padded shard starts in its chunk's buffer (elements)

    @property
    def padded(self) -> list[int]:
        """"flat": the shape of one shard padded to the largest (torch.chunk's split)."""
        out = list(self.live.shape)
        out[self.dim] = -(-out[self.dim] // self.ways)
        return out


@dataclass
class _Chunk:
    """Shards of several "flat" parameters of one process group and dtype,
    gathered by a single all_gather_into_tensor."""

    group: dist.ProcessGroup
    ways: int
    dtype: torch.dtype
    device: torch.device
    params: list[int] = field(default_factory=list)  # indices into ShardGatherer.params
    numel: int = 0  # per rank, padding included


@dataclass
class _Slot:
    locals_: list[torch.Tensor | None]  # per parameter: its snapshot ("whole"/"dtensor") or None
    chunks: list[torch.Tensor]  # per chunk: this rank's padded shards, back to back
    dst: list[torch.Tensor] = field(default_factory=list)  # snapshot copies: destination views...
    src: list[int] = field(default_factory=list)  # ...and the parameter each one copies
    ready: torch.cuda.Event | None = None
    released: torch.cuda.Event | None = None
    """Recorded on the sidecar's stream once everything queued there has read
    the slot (the gather and the Pusher's copy out of it); the trainer's
    stream waits for it before writing the slot again."""
    version: int = -1
    done: threading.Event = field(default_factory=threading.Event)


def _shard_size(size: int, ways: int, index: int) -> int:
    """Rows of shard ``index`` under torch.chunk's split (FSDP2's and DTensor's)."""
    per = -(-size // ways)
    return max(0, min(per, size - index * per))


class ShardGatherer:
    """See the module docstring. ``deliver(tensors, version, wait)`` runs on
    rank 0's sidecar thread; its metrics come back from ``snapshot``.

    The common layouts take a fast path: a parameter sharded on one mesh dim
    (FSDP, TP, HSDP's shard dim; replicated on the others) is copied at
    snapshot time straight into a flat per-group buffer, and one
    ``all_gather_into_tensor`` per ``chunk_bytes`` of output brings every
    shard over; only the ranks at coordinate 0 of the replicated dims take
    part (the others hold copies). Per-parameter DTensor redistribution (a
    Python round trip per tensor, which would compete with the trainer's
    thread for the GIL) is left to layouts with two sharded dims (FSDP+TP)."""

    def __init__(self, model_parts: list[nn.Module], adapter, parallel_dims, device: torch.device,
                 deliver: Callable[[dict[str, torch.Tensor], int, bool], dict[str, float]] | None,
                 dtype: torch.dtype | None = None, num_slots: int = 2, sync: bool = False,
                 chunk_bytes: int = 512 << 20):
        self.device = device
        self.sync = sync  # snapshot's default for ``wait``
        self.adapter = adapter
        self.deliver = deliver
        self.dtype = dtype
        self.rank = dist.get_rank()
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.meshes = sidecar_mesh(parallel_dims, device.type, backend)
        self.world_group = self.meshes["world"].get_group()

        self.params: list[_Param] = []
        seen: dict[int, _Param] = {}
        for part in model_parts:
            for name, t in part.state_dict(keep_vars=True).items():
                if id(t) in seen:  # tied: one gather, both names
                    seen[id(t)].names.append(name)
                    continue
                seen[id(t)] = self._classify(name, t)
                self.params.append(seen[id(t)])
        self.chunks = self._plan_chunks(chunk_bytes)
        self._plan_stage_transfers()

        self.slots = [self._new_slot() for _ in range(max(1, num_slots))]
        self.free: queue.Queue[_Slot] = queue.Queue()
        for s in self.slots:
            self.free.put(s)
        self.work: queue.Queue[tuple[_Slot, bool] | None] = queue.Queue()
        self.results: queue.Queue[dict[str, float]] = queue.Queue()
        self._delivered: dict[str, float] = {}  # metrics of the newest delivery, repeated until the next
        self.error: BaseException | None = None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.thread = threading.Thread(target=self._run, name="weight-gather", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------ set-up

    def _classify(self, name: str, t: torch.Tensor) -> _Param:
        if not isinstance(t, DTensor):
            return _Param([name], t, "whole")
        own = _own_mesh(self.meshes, t.device_mesh)
        # a size-1 dim (EP's efsdp of 1) shards nothing: experts then take the flat path over ep
        sharded = [i for i, pl in enumerate(t.placements) if not pl.is_replicate() and own.size(i) > 1]
        if not sharded:
            return _Param([name], t, "whole")
        if len(sharded) == 1 and type(t.placements[sharded[0]]) is Shard:
            i = sharded[0]
            return _Param([name], t, "flat", mesh=own, dim=t.placements[i].dim, group_dim=i, ways=own.size(i))
        return _Param([name], t, "dtensor", mesh=own)

    def _takes_part(self, p: _Param) -> bool:
        """A "flat" parameter is gathered by the ranks at coordinate 0 of its
        replicated mesh dims (the others hold copies of the same shards)."""
        return all(p.mesh.get_local_rank(j) == 0 for j in range(p.mesh.ndim) if j != p.group_dim)

    def _plan_chunks(self, chunk_bytes: int) -> list[_Chunk]:
        chunks: list[_Chunk] = []
        open_: dict[tuple[str, torch.dtype], _Chunk] = {}
        for k, p in enumerate(self.params):
            if p.kind != "flat" or not self._takes_part(p):
                continue
            group = p.mesh.get_group(p.group_dim)
            dtype = self._push_dtype(p.live)
            padded = math.prod(p.padded)
            key = (group.group_name, dtype)
            c = open_.get(key)
            if c is None or (c.numel + padded) * p.ways * dtype.itemsize > chunk_bytes and c.params:
                c = open_[key] = _Chunk(group, p.ways, dtype, p.live.to_local().device)
                chunks.append(c)
            p.offset = c.numel
            c.params.append(k)
            c.numel += padded
        return chunks

    def _plan_stage_transfers(self) -> None:
        """Which tensors rank 0 lacks (other PP stages) and who sends them
        (:func:`stage_transfer.plan_to_rank0`, once, on the sidecar's world
        group): ``incoming`` on every rank, ``outgoing`` the names this rank sends."""
        mine = [(p.names, tuple(p.live.shape), self._push_dtype(p.live)) for p in self.params]
        self.incoming = stage_transfer.plan_to_rank0(mine, self.world_group, skip=self._no_hf_name)
        self.outgoing = stage_transfer.sent_by(self.incoming, self.rank)

    def _no_hf_name(self, names: list[str], shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """No HF name (the last stage's copy of tied embeddings): nothing to send."""
        return not self.adapter.to_hf({names[0]: torch.empty(shape, dtype=dtype, device="meta")})

    def _push_dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype

    def _keeps(self, p: _Param) -> bool:
        """Whether this rank needs the full value (rank 0 delivers, a stage's first rank sends)."""
        return self.rank == 0 or p.names[0] in self.outgoing

    def _new_slot(self) -> _Slot:
        locals_: list[torch.Tensor | None] = []
        for p in self.params:
            local = p.live.to_local() if isinstance(p.live, DTensor) else p.live
            if p.kind == "dtensor" or (p.kind == "whole" and self._keeps(p)):
                locals_.append(torch.empty(local.shape, dtype=self._push_dtype(local), device=local.device))
            else:
                locals_.append(None)
        chunks = [torch.empty(c.numel, dtype=c.dtype, device=c.device) for c in self.chunks]
        slot = _Slot(locals_, chunks)
        # where each shard goes in the chunk buffers (views, made once per slot)
        for c, buf in zip(self.chunks, chunks):
            for k in c.params:
                p = self.params[k]
                local = p.live.to_local()
                shape = p.padded
                region = buf[p.offset : p.offset + math.prod(shape)]
                slot.dst.append(region.view(shape).narrow(p.dim, 0, local.shape[p.dim]))
                slot.src.append(k)
        for k, t in enumerate(locals_):
            if t is not None:
                slot.dst.append(t)
                slot.src.append(k)
        return slot

    # ------------------------------------------------------ trainer side

    def snapshot(self, version: int, wait: bool | None = None) -> dict[str, float]:
        """Copy this rank's shards as ``version`` and return (every rank calls
        it after the optimizer step). With ``wait`` (default: sync mode): also
        wait until the version is gathered and, on rank 0, delivered."""
        wait = self.sync if wait is None else wait
        self._raise_if_failed()
        t0 = time.perf_counter()
        slot = self.free.get()
        waited = time.perf_counter() - t0
        if slot.released is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.released)  # on the GPU: no host wait
        with torch.no_grad():
            srcs = []
            for k in slot.src:
                live = self.params[k].live
                srcs.append((live.to_local() if isinstance(live, DTensor) else live).detach())
            if srcs:
                torch._foreach_copy_(slot.dst, srcs)
        if self.stream is not None:
            slot.ready = torch.cuda.Event()
            slot.ready.record()
        slot.version = version
        slot.done.clear()
        self.work.put((slot, wait))
        m = {"time/push_stall_s": time.perf_counter() - t0, "time/gather_slot_wait_s": waited}
        if wait:
            slot.done.wait()
            self._raise_if_failed()
        while not self.results.empty():  # the newest delivery's metrics (lags, bytes, skips)
            self._delivered = self.results.get()
        return self._delivered | m

    def close(self, abandon: bool = False) -> None:
        """Let the queued versions finish, then stop the thread. ``abandon``
        (the run is failing): give the thread a moment, never hang on a
        collective whose peers are gone, and keep the original error."""
        self.work.put(None)
        self.thread.join(timeout=5 if abandon else 600)
        if not abandon:
            if self.thread.is_alive():
                raise RuntimeError(f"weight gather on rank {self.rank} did not finish within 600 s")
            self._raise_if_failed()

    def __enter__(self) -> ShardGatherer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(abandon=exc_type is not None)

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"weight gather failed on rank {self.rank}: {self.error}") from self.error

    # ------------------------------------------------------ sidecar side

    def _run(self) -> None:
        if self.stream is not None:
            torch.cuda.set_device(self.device)
        while (item := self.work.get()) is not None:
            slot, wait = item
            try:
                if self.error is None:
                    self._gather_one(slot, wait)
            except BaseException as e:  # noqa: BLE001 - surfaced on the trainer's next call
                logger.exception("weight gather of version %d failed", slot.version)
                self.error = e
            finally:
                slot.done.set()
                self.free.put(slot)

    def _gather_one(self, slot: _Slot, wait: bool) -> None:
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with ctx, torch.no_grad():
            if slot.ready is not None:
                self.stream.wait_event(slot.ready)
            full: dict[str, torch.Tensor] = {}

            def keep(p: _Param, value: torch.Tensor) -> None:
                if self._keeps(p):
                    for n in p.names:
                        full[n] = value

            for c, buf in zip(self.chunks, slot.chunks):
                out = torch.empty(c.ways * c.numel, dtype=c.dtype, device=buf.device)
                dist.all_gather_into_tensor(out, buf, group=c.group)
                for k in c.params:
                    p = self.params[k]
                    if not self._keeps(p):
                        continue
                    shape = p.padded
                    n = math.prod(shape)
                    parts = [out[r * c.numel + p.offset : r * c.numel + p.offset + n].view(shape).narrow(
                        p.dim, 0, _shard_size(p.live.shape[p.dim], p.ways, r)) for r in range(p.ways)]
                    keep(p, torch.cat(parts, dim=p.dim))
                del out
            for p, local in zip(self.params, slot.locals_):
                if p.kind == "whole" and local is not None:
                    keep(p, local)
                elif p.kind == "dtensor":
                    keep(p, DTensor.from_local(local, p.mesh, p.live.placements, run_check=False,
                                               shape=p.live.shape, stride=p.live.stride()).full_tensor())
            stage_transfer.exchange_to_rank0(self.incoming, full, self.device, self.world_group)
            if self.stream is not None:
                self.stream.synchronize()
            if self.rank == 0 and self.deliver is not None:
                self.results.put(self.deliver(self.adapter.to_hf(full), slot.version, wait))
            if self.stream is not None:
                # The Pusher's copy out of the slot ("whole" parameters are
                # delivered straight from it) is queued on this stream.
                slot.released = torch.cuda.Event()
                slot.released.record(self.stream)


class DirectPush:
    """One trainer rank: every parameter is whole on it, and the Pusher's own
    snapshot is the only copy (no gather, no extra thread).

    With ``weight_sync.staging = "host"`` that copy goes to pinned host memory
    (PCIe: ~0.3 s for 16 GB) and reads the live parameters, so it runs on a
    stream of its own beside the next forward and backward, which only read
    them; ``optimizers`` gets a step pre-hook that makes the next optimizer
    step wait for it on the GPU (the trainer's thread never waits)."""

    def __init__(self, model_parts: list[nn.Module], adapter, pusher, sync: bool, optimizers=None,
                 adapter_only: bool = False):
        self.model_parts, self.adapter, self.pusher, self.sync = model_parts, adapter, pusher, sync
        self.adapter_only = adapter_only  # weight_sync.lora_push = "adapter": the peft tensors, not the weights
        self._aliases: list[list[tuple[str, nn.Parameter]] | None] | None = None
        self._copy_stream: torch.cuda.Stream | None = None
        self._copied: torch.cuda.Event | None = None
        # (start, end) on the GPU of a copy to the host, reported once complete
        self._copy_span: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._hook = optimizers.register_step_pre_hook(self._before_step) if optimizers is not None else None

    def _before_step(self, *args, **kwargs) -> None:
        if self._copied is not None:
            torch.cuda.current_stream().wait_event(self._copied)

    def _copy_time(self) -> dict[str, float]:
        """staging "host": how long an earlier copy to the host took on the GPU
        (once it is complete; a copy longer than a step would make the next
        optimizer step wait for it)."""
        span = self._copy_span
        if span is None or not span[1].query():
            return {}
        self._copy_span = None
        return {"time/push_host_copy_s": span[0].elapsed_time(span[1]) / 1e3}

    def tensors(self) -> dict[str, torch.Tensor]:
        """The HF-named weights, aliasing the live parameters where the
        adapter only renames (looked up once, on the first call)."""
        from torchtitan_grpo.lora.adapters import has_lora, merged_hf_state
        from torchtitan_grpo.models.hf_bridge import hf_aliases, hf_state_dict

        if self.adapter_only:
            from torchtitan_grpo.weight_sync.adapter_push import adapter_tensors

            return {k: v for part in self.model_parts for k, v in adapter_tensors(part, self.adapter).items()}
        if self._aliases is None:  # with LoRA no name aliases a parameter: the merged weights are new tensors
            self._aliases = [None if has_lora(part) else hf_aliases(part, self.adapter) for part in self.model_parts]
        out: dict[str, torch.Tensor] = {}
        for part, aliases in zip(self.model_parts, self._aliases):
            if aliases is not None:
                out |= {name: p.detach() for name, p in aliases}
            else:
                out |= merged_hf_state(part, self.adapter) if has_lora(part) else hf_state_dict(part, self.adapter)
        return out

    def snapshot(self, version: int, wait: bool | None = None) -> dict[str, float]:
        t0 = time.perf_counter()
        tensors = self.tensors()
        export_s = time.perf_counter() - t0
        wait = self.sync if wait is None else wait
        if getattr(self.pusher, "stages_async", False):
            if self._hook is None:
                raise RuntimeError('weight_sync.staging = "host" needs the optimizers (DirectPush(optimizers=...)): '
                                   "the next optimizer step must wait for the copy to the host")
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream()
            timings = self._copy_time()
            self._copy_stream.wait_stream(torch.cuda.current_stream())  # after this step's optimizer
            began = torch.cuda.Event(enable_timing=True)
            began.record(self._copy_stream)
            with torch.cuda.stream(self._copy_stream):
                m = self.pusher.push(tensors, version, wait)
            copied = torch.cuda.Event(enable_timing=True)
            copied.record(self._copy_stream)
            self._copied = copied
            # Timed when staged (not skipped), not waited for (then ``copied``
            # comes after the whole push), and none is still being timed.
            if self._copy_span is None and "push/bytes" in m and not wait:
                self._copy_span = began, copied
            m |= timings
        else:
            m = self.pusher.push(tensors, version, wait)
        if "time/push_stall_s" in m:  # the trainer's thread waited for the export too
            m["time/push_stall_s"] += export_s
        return m

    def close(self, abandon: bool = False) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def __enter__(self) -> DirectPush:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()


def push_dtype(weight_sync) -> torch.dtype | None:
    """``weight_sync.dtype`` as a torch dtype; None keeps the trainer's."""
    return None if weight_sync.dtype == "model" else getattr(torch, weight_sync.dtype)


def trainer_push(model_parts: list[nn.Module], adapter, parallel_dims, device: torch.device, pusher,
                 weight_sync, optimizers=None) -> DirectPush | ShardGatherer:
    """What the loop calls on every rank: ``snapshot(version, wait=None)``
    after each optimizer step and ``close()`` at the end. ``pusher`` is rank
    0's Pusher (None on the other ranks); ``weight_sync`` the config section;
    ``optimizers`` the trainer's (one rank, staging "host": see DirectPush)."""
    sync = weight_sync.mode == "sync"
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return DirectPush(model_parts, adapter, pusher, sync, optimizers,
                          adapter_only=getattr(weight_sync, "lora_push", "merged") == "adapter")
    from torchtitan_grpo.lora.adapters import has_lora

    if any(has_lora(part) for part in model_parts):  # every rank gathers and merges, rank 0 pushes
        from torchtitan_grpo.lora.pp import PipelineLoraPush
        from torchtitan_grpo.lora.sharded import ShardedLoraPush

        kind = PipelineLoraPush if parallel_dims.pp > 1 else ShardedLoraPush  # PP: stages' tensors to rank 0
        return kind(model_parts, adapter, pusher, sync,
                    adapter_only=getattr(weight_sync, "lora_push", "merged") == "adapter")
    deliver = None if pusher is None else pusher.push
    return ShardGatherer(model_parts, adapter, parallel_dims, device, deliver, push_dtype(weight_sync),
                         weight_sync.num_staging_buffers, sync)
