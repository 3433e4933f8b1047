"""The weight push's settings (``PushConfig``, built from ``[weight_sync]``).

Its own module so that the Pusher and every transport can read it without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchtitan_grpo.protocol.vllm import DEFAULT_PACKED_BUFFER_SIZE_BYTES


@dataclass
class PushConfig:
    """Sidecar settings (built from ``[weight_sync]``)."""

    mode: str = "async"
    """"async": ``push`` only snapshots and returns; "sync": it also waits
    until every admitted replica serves the new version."""
    backend: str = "gloo"
    """How the bytes travel: "gloo" or "nccl" (a weight group per replica,
    speaking ``protocol`` over it), "disk" (safetensors, see ``disk_folder``)
    or "ipc" (same host: the replica maps the staging buffer, CUDA IPC or
    shared memory, and copies out of it; see ``weight_sync.ipc``). Which
    transport that is: ``pusher.TRANSPORTS``."""
    master_address: str = "127.0.0.1"
    """The trainer's address as the replicas reach it (weight-group rendezvous)."""
    bucket_bytes: int = 1 << 30
    """SGLang's flattened buckets: one update request and one broadcast each."""
    num_staging_buffers: int = 2
    """Snapshots that can wait or be sent at once; with all of them being
    sent, an async push skips its version instead of waiting."""
    deadline_s: float = 60.0
    """A transfer not done by then is abandoned and its replica ejected."""
    init_timeout_s: float = 120.0
    """Joining a replica's weight group (and the requests that clean up before a rejoin)."""
    pause_mode: str = "none"
    """SGLang /pause_generation mode around an update: "none" (updates wait for
    in-flight requests), "abort", "retract" or "in_place" (keeps KV cache)."""
    reconnect_interval_s: float = 2.0
    """An ejected replica is tried again (health check, rejoin) this often."""
    protocol: str = "sglang"
    """Weight-update protocol of the replicas: "sglang" (also the built-in
    server's default) or "vllm"."""
    disk_folder: str = ""
    """backend "disk": a folder every replica can read; version v is written
    once to <disk_folder>/v<v>/model.safetensors and loaded with
    /update_weights_from_disk. The two newest versions are kept."""
    dtype: torch.dtype | None = None
    """Dtype the replicas receive (e.g. bfloat16 for bf16 servers); the cast
    happens inside the snapshot copy. None: the trainer's own dtype."""
    packed_buffer_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    """vLLM packed mode: a chunk closes right after the tensor that takes it past this size."""
    staging: str = "device"
    """Where snapshots wait to be sent (nccl): "device", on the trainer's GPU
    (``num_staging_buffers`` copies of the pushed weights; the fastest), or
    "host", in pinned host memory for models that do not fit on the GPU
    twice: the snapshot is then a copy to the host queued on the caller's
    stream (the trainer's thread does not wait for it; whoever changes the
    source tensors next must, see ``DirectPush``), and each replica's sender
    uploads bucket by bucket through two device buffers of its own
    (``upload.Uploader``), so the push runs at PCIe speed. gloo and disk
    always stage on the host, from a GPU in pinned memory as "host" does."""
    pipelined: bool = True
    """Built-in servers only: write a transfer's control requests on one
    HTTP/1.1 connection without waiting for the replies in between (the
    server handles them in order), instead of one request after another's
    reply (``control.PipelinedConnection``). The broadcasts still wait for the
    same replies (a confirmed session, the previous bucket) either way."""
    ack_posted: bool = True
    """Pipelined to a built-in server: ask for each update's reply once its
    receive is posted (``?ack=posted``). SGLang's protocol sends each bucket
    then, queued behind the one in flight, so the link never idles between
    buckets and no broadcast waits on the trainer's GPU for a receive (2
    H200s, 8B in 1 GiB buckets: 0.73 -> 0.89 of raw NCCL; docs/perf-history/weight-push.md
    runs 47-48). vLLM's protocol still broadcasts once the round is started;
    its finish is then handled while the bytes arrive, not after them."""
    api_key: str = ""
    """Replicas started with an API key: every HTTP request of the push
    (weight-update routes, probes, the pipelined connection) then carries
    ``Authorization: Bearer <api_key>``. Empty: no such header."""
    adapter_config: dict | None = None
    """backend "adapter" (``weight_sync.lora_push = "adapter"``): the peft
    ``adapter_config.json`` written beside each version's adapter tensors
    (``adapter_push.adapter_config``)."""
    fanout: str = "per_replica"
    """Over a weight group: "per_replica" (a group per replica) or "broadcast"
    (one group over the trainer and the admitted replicas, ``fanout``)."""
    large_tensor_bytes: int = 16 << 20
    """Tensors of at least this many bytes are staged with a copy of their own,
    the others with one ``_foreach_copy_`` per bucket: a launch per tensor
    costs the trainer's thread microseconds each (milliseconds for ~300
    tensors), but the foreach kernel copies large tensors slower than a plain
    copy does (bench/snapshot_copy.py; docs/PERFORMANCE.md has the numbers)."""
