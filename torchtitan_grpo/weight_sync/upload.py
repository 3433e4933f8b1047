"""Host-staged buckets on their way back to a GPU (``weight_sync.staging = "host"``).

NCCL sends from device memory only. With staging in pinned host memory each
replica's sender therefore uploads a bucket into one of two device buffers of
its own, on an upload stream of its own, and broadcasts it from there; while
bucket k is broadcast, bucket k+1 is uploaded into the other buffer, so the
PCIe copy and the NVLink broadcast overlap. The device memory this costs is
two buckets per replica instead of whole snapshots on the trainer's GPU.

Every call is made on the sender's broadcast thread. Without CUDA (tests)
the copies are plain synchronous copies into host buffers.
"""

from __future__ import annotations

import torch


class Uploader:
    """Two device buffers of ``nbytes`` and an upload stream, for one replica."""

    def __init__(self, device: torch.device, nbytes: int):
        self.nbytes = nbytes
        self.slots = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._freed: list[torch.cuda.Event | None] = [None, None]
        """Per slot: recorded after the broadcast that last read it."""
        self._host: list[torch.Tensor] = []
        self._ready: list[torch.cuda.Event] | None = None
        self._uploaded: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}

    def begin(self, host: list[torch.Tensor], ready: list[torch.cuda.Event] | None) -> None:
        """A new transfer of the staged buckets ``host``; ``ready[k]`` is
        recorded once the snapshot's copy into ``host[k]`` is done."""
        if max(b.numel() for b in host) > self.nbytes:
            raise ValueError(f"a bucket of {max(b.numel() for b in host)} bytes does not fit "
                             f"the upload buffers of {self.nbytes} bytes")
        self._host, self._ready, self._uploaded = host, ready, {}

    def _upload(self, k: int) -> None:
        if k in self._uploaded or k >= len(self._host):
            return
        src, i = self._host[k], k % 2
        dst = self.slots[i][: src.numel()]
        if self.stream is None:
            dst.copy_(src)
            self._uploaded[k] = (dst, None)
            return
        with torch.cuda.stream(self.stream):
            if self._ready is not None:
                self.stream.wait_event(self._ready[k])  # the snapshot has written it
            if self._freed[i] is not None:
                self.stream.wait_event(self._freed[i])  # bucket k-2 has left this slot
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._uploaded[k] = (dst, done)

    def take(self, k: int, stream: torch.cuda.Stream | None) -> torch.Tensor:
        """Bucket k in device memory; work queued on ``stream`` from now on
        runs after its upload."""
        self._upload(k)
        dst, done = self._uploaded.pop(k)
        if done is not None and stream is not None:
            stream.wait_event(done)
        return dst

    def sent(self, k: int, stream: torch.cuda.Stream | None) -> None:
        """Bucket k's broadcast is queued on ``stream``: its slot is free once
        that has run. Bucket k+1 starts uploading into the other slot now."""
        if self.stream is not None and stream is not None:
            freed = torch.cuda.Event()
            freed.record(stream)
            self._freed[k % 2] = freed
        self._upload(k + 1)
