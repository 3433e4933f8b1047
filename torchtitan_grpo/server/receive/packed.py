"""vLLM's packed weight transfer, receive side: the chunks a trainer
broadcasts with ``packed=True`` (one uint8 broadcast per chunk, cut by
``plan_packed_chunks``), received into buffers whose aligned tensors are
returned as views (no copy), the others copied out once their chunk is in.
Used by the vLLM weight-transfer routes (``vllm_weights``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_grpo.fleet import vllm as proto
from torchtitan_grpo.server.engine.weights import PostedReceive, SpecCheck, run_check
from torchtitan_grpo.weight_sync.buckets import TensorSpec, offsets, plan_packed_chunks, slots
from torchtitan_grpo.weight_sync.group import Posted


def post_packed(group: Any, specs: list[TensorSpec], buffer_bytes: int,
                num_buffers: int = proto.DEFAULT_PACKED_NUM_BUFFERS,
                check: SpecCheck | None = None,
                chunks: list[list[TensorSpec]] | None = None) -> PostedReceive:
    """Post the receives of vLLM packed-mode chunks: one uint8 broadcast per
    chunk, cut exactly as the sender cuts (``plan_packed_chunks``). Returns
    once every receive is posted, the views cut and ``check`` passed; the
    bytes arrive meanwhile (``PostedReceive.wait``).

    Each chunk is received into a buffer of its own, and a tensor whose byte
    offset in its chunk is a multiple of its itemsize is returned as a typed
    view of that buffer: no copy, and ``install_weights`` adopts the view as
    the parameter's storage. Only the others (offsets made odd by mixed
    itemsizes, e.g. an fp32 tensor after a bf16 one of odd length) are copied
    out into tensors of their own once their chunk is in: on GPUs on a second
    CUDA stream that waits for the chunk, on CPU (gloo) by ``wait``. Every
    receive is posted before any view is cut or copy queued, and nothing
    waits on the host, so the link is never idle between chunks; only the
    last chunk's copies (if any) follow its receive.

    Memory: the chunk buffers add up to the update's bytes, plus a copy of
    each unaligned tensor (in practice the few odd-sized small ones between
    bf16 weights). That replaces per-tensor destinations (the update's bytes)
    plus up to ``num_buffers`` chunk buffers, so it is no more than before
    unless unaligned tensors outweigh those buffers. A buffer is freed once
    no view of it is used (a chunk of unaligned tensors only: at return).
    ``num_buffers`` means nothing here: a real vLLM worker double-buffers its
    receives with it, so it stays for protocol compatibility. ``check``
    (``Engine.check_weights``) runs while the chunks arrive; what it raises is
    raised once every chunk is in (the group stays in step with the sender).
    ``chunks``: ``plan_packed_chunks(specs, buffer_bytes)`` when the caller
    has it already.
    """
    if chunks is None:
        chunks = plan_packed_chunks(specs, buffer_bytes)
    if not chunks:
        return PostedReceive([], group)
    cuda = group.device.type == "cuda"
    # Streams named by device: this runs on a worker thread, whose current
    # device need not be the group's (an event recorded on "the current
    # stream" there would order nothing).
    main = torch.cuda.current_stream(group.device) if cuda else None
    received = [_post_chunk(group, chunk, main) for chunk in chunks]
    side = torch.cuda.Stream(group.device) if cuda and any(r.spills for r in received) else None
    out: list[tuple[str, torch.Tensor]] = []
    later: list[tuple[torch.Tensor, torch.Tensor]] = []
    for r in received:
        out.extend(_chunk_tensors(r, side, later))
    error = run_check(check, specs)
    posted = [r.posted for r in received]
    if side is not None:  # every copy of an unaligned tensor
        copied = torch.cuda.Event()
        copied.record(side)
        posted.append(Posted(event=copied))

    def copy_out() -> None:  # gloo: each unaligned tensor, once its chunk is in
        for dest, slot in later:
            dest.view(-1).view(torch.uint8).copy_(slot)

    receive = PostedReceive(out, group, posted, copy_out if later else None)
    if error is not None:
        receive.wait()
        raise error
    return receive


def receive_packed(group: Any, specs: list[TensorSpec], buffer_bytes: int,
                   num_buffers: int = proto.DEFAULT_PACKED_NUM_BUFFERS,
                   check: SpecCheck | None = None,
                   chunks: list[list[TensorSpec]] | None = None) -> list[tuple[str, torch.Tensor]]:
    """Receive vLLM packed-mode chunks completely (:func:`post_packed`, then
    its ``wait``)."""
    return post_packed(group, specs, buffer_bytes, num_buffers, check, chunks).wait()


@dataclass
class _PostedChunk:
    """A chunk whose receive is posted."""

    specs: list[TensorSpec]
    buf: torch.Tensor
    spills: list[torch.Tensor]
    """Where the chunk's unaligned tensors go, in order."""
    posted: Posted
    """Done once the chunk is in."""
    ready: Any = None
    """GPUs: a CUDA event after the receive and the allocation of ``spills``
    (``posted`` waits for it; the copies out of the chunk too)."""


def receive_packed_update(ack: bool, group: Any, specs: list[TensorSpec], buffer_bytes: int, num_buffers: int,
                          check: SpecCheck | None, chunks: list[list[TensorSpec]] | None) -> PostedReceive:
    """One packed update on the transfer thread (one hop either way): posted
    (:func:`post_packed`), then, unless ``ack``, waited for."""
    posted = post_packed(group, specs, buffer_bytes, num_buffers, check, chunks)
    if not ack:
        posted.wait()
    return posted


def _post_chunk(group: Any, chunk: list[TensorSpec], main: Any) -> _PostedChunk:
    pos = offsets(chunk)
    buf = torch.empty(pos[-1], dtype=torch.uint8, device=group.device)
    posted = group.post_broadcast(buf, src=0, stream=main)
    # Allocated after the receive is posted (the first receive goes out sooner)
    # and before ``ready``: a block the allocator hands out on ``main`` may still
    # be in use by work queued there earlier (another thread's generation, say),
    # so the copies into it, on another stream, must wait for an event after it.
    spills = [torch.empty(s.shape, dtype=s.dtype, device=group.device)
              for s, p in zip(chunk, pos) if p % s.itemsize]
    if main is None:
        return _PostedChunk(chunk, buf, spills, posted)
    ready = torch.cuda.Event()
    ready.record(main)
    return _PostedChunk(chunk, buf, spills, Posted(event=ready), ready)


def _chunk_tensors(r: _PostedChunk, side: Any,
                   later: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a posted chunk: views of its buffer where aligned, else
    its spill tensors, filled on ``side`` (GPU) once the chunk is in, or (CPU)
    listed in ``later`` as (spill, raw bytes) to copy once it is."""
    spills = iter(r.spills)
    out: list[tuple[str, torch.Tensor]] = []
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        if side is not None and r.spills:
            side.wait_event(r.ready)
        for spec, slot in zip(r.specs, slots(r.buf, r.specs)):
            if slot.dtype != spec.dtype:  # unaligned: ``slot`` holds the raw bytes
                dest = next(spills)
                if side is not None:
                    dest.view(-1).view(torch.uint8).copy_(slot)
                else:
                    later.append((dest, slot))
                slot = dest
            out.append((spec.name, slot))
    return out
