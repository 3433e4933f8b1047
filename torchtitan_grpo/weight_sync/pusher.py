"""The weight-push sidecar: snapshot on the trainer, one sender per replica.

The trainer calls ``push(tensors, version)`` after each optimizer step. That
call only copies the tensors into a free *staging buffer* (flattened buckets,
a device copy on GPUs) and returns; if every staging buffer is still being
sent, it skips this version instead of waiting. Everything else happens on the
sidecar:

* Each replica has its own sender: an asyncio task for the HTTP control
  plane, one thread for its blocking broadcasts (and on GPUs its own CUDA
  stream), and its own weight group (own store port, own communicator),
  never the trainer's FSDP/TP groups.
* A sender always sends the newest staged version and skips older ones; a
  replica only ever loads whole versions (SGLang's begin/update.../end
  session, with the served version set by the last bucket).
* A transfer that misses ``deadline_s`` (or fails) is abandoned: the group
  is aborted, the replica is ejected from routing, its sender reconnects in
  the background, sends it the newest version, and only then readmits it.
* A replica the inference pool knows to be down (``replica_down``) is
  treated the same way at once, not at its deadline: a hung replica must not
  hold a push that waits, nor a staging buffer, for ``deadline_s``.

``mode = "sync"`` uses the same machinery and then waits until every
admitted replica serves the new version (the on-policy baseline).

For SGLang's order: pause -> begin -> (update request in flight while the
trainer broadcasts) x buckets -> end -> continue. An update request is posted
before its broadcast, and the first broadcast waits until ``begin`` was
confirmed, so a receive is always waiting when the bytes arrive. The request
for bucket k+1 is posted as soon as bucket k has arrived; its broadcast
starts after the reply to k. A real SGLang or vLLM gets each request that
must follow another only after the other's reply. The built-in server takes
them pipelined on one connection (``control.PipelinedConnection``) and
handles them in order, so there every request goes out as soon as it can be
written (vLLM: start, update, finish and resume at once) and only the
broadcasts wait for replies; with pipelining off it still gets a session's
end with the last byte rather than after the last reply. Its updates also
ask for ``?ack=posted`` (``ack_posted``): each is answered once its receive
is posted. SGLang's bucket k then goes out, queued behind bucket k-1 still
in flight, so the link does not idle between buckets; vLLM's finish is
handled while the bytes arrive. That server receives into buffers of its
own and loads a version only at the session's end, so only the end must
follow a pause: with ``ack_posted`` the pause goes just before the end and
is handled while the bytes arrive, which then never wait for a generating
replica to stop (a decode step in mode "abort", every running request in
vLLM's "wait"). Its SGLang session's end takes the version
(``_Replica.end_version``), so every update body is the same bytes each
version, parsed once by the server.

When the caller waits for the replicas (sync mode), a version is handed to
the senders as soon as its staging buffer is chosen, before the trainer has
copied anything into it: pause, begin and the first update request (and the
replica's parsing of it) then run while the trainer's thread stages, and only
the broadcasts wait, each until the copies of its own bucket are queued. In
async mode it is handed over once staged, so that the trainer's thread never
competes with the senders for the GIL during its snapshot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import aiohttp
import torch

from torchtitan_grpo.aio import DaemonExecutor, LoopThread
from torchtitan_grpo.net import free_port
from torchtitan_grpo.protocol import sglang, vllm
from torchtitan_grpo.protocol.builtin import BUILTIN_ENGINE
from torchtitan_grpo.weight_sync import buckets as bk
from torchtitan_grpo.weight_sync import ipc
from torchtitan_grpo.weight_sync.control import PipelinedConnection, PushError, read_reply
from torchtitan_grpo.weight_sync.group import WeightGroup, init_weight_group, master_store
from torchtitan_grpo.weight_sync.upload import Uploader

logger = logging.getLogger(__name__)

GROUP_NAME = "weight_update_group"  # SGLang's default group name
VLLM_GROUP_NAME = "vllm_weight_transfer"  # the built-in server's vLLM-route group


class WeightPusher(Protocol):
    def push(self, tensors: dict[str, torch.Tensor], version: int, wait: bool | None = None) -> dict[str, float]: ...

    def close(self) -> None: ...


class NoPush:
    """``weight_sync.mode = "off"``: replicas keep their initial weights."""

    def push(self, tensors, version, wait=None):
        return {}

    def close(self) -> None:
        pass


@dataclass
class PushConfig:
    """Sidecar settings (built from ``[weight_sync]``)."""

    mode: str = "async"
    backend: str = "gloo"
    """How the bytes travel: "gloo" or "nccl" (a weight group per replica),
    "disk" (safetensors, see ``disk_folder``) or "ipc" (same host: the
    replica maps the staging buffer, CUDA IPC or shared memory, and copies
    out of it; see ``weight_sync.ipc``)."""
    master_address: str = "127.0.0.1"
    bucket_bytes: int = 1 << 30
    num_staging_buffers: int = 2
    deadline_s: float = 60.0
    init_timeout_s: float = 120.0
    pause_mode: str = "none"
    """SGLang /pause_generation mode around an update: "none" (updates wait for
    in-flight requests), "abort", "retract" or "in_place" (keeps KV cache)."""
    reconnect_interval_s: float = 2.0
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
    packed_buffer_bytes: int = vllm.DEFAULT_PACKED_BUFFER_SIZE_BYTES
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
    H200s, 8B in 1 GiB buckets: 0.73 -> 0.89 of raw NCCL; docs/PERFORMANCE.md
    runs 47-48). vLLM's protocol still broadcasts once the round is started;
    its finish is then handled while the bytes arrive, not after them."""
    api_key: str = ""
    """Replicas started with an API key: every HTTP request of the push
    (weight-update routes, probes, the pipelined connection) then carries
    ``Authorization: Bearer <api_key>``. Empty: no such header."""
    large_tensor_bytes: int = 16 << 20
    """Tensors of at least this many bytes are staged with a copy of their own,
    the others with one ``_foreach_copy_`` per bucket: a launch per tensor
    costs the trainer's thread microseconds each (milliseconds for ~300
    tensors), but the foreach kernel copies large tensors slower than a plain
    copy does (bench/snapshot_copy.py; docs/PERFORMANCE.md has the numbers)."""


@dataclass
class _BucketCopy:
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
    def of(cls, buf: torch.Tensor, bucket: list[bk.TensorSpec], large_bytes: int) -> _BucketCopy:
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
class _Staged:
    version: int
    """-1 while the trainer writes into it: no sender may take it then."""
    plan: list[list[bk.TensorSpec]]
    """The buckets (or vLLM chunks) of ``buffers``: the Pusher's plan when they were made."""
    buffers: list[torch.Tensor]
    copies: list[_BucketCopy]
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


@dataclass
class _Replica:
    url: str
    group: WeightGroup | None = None
    executor: DaemonExecutor | None = None
    stream: object | None = None
    uploader: Uploader | None = None  # staging "host" over nccl: the device buffers buckets are sent from
    sessionful: bool = True  # False: pre-0.5.23 SGLang without begin/end_weight_update
    builtin: bool = False
    """The built-in server (its /model_info says so): its end of a session
    (SGLang end, vLLM finish) waits for the update in flight, so the end can be
    posted as soon as the last byte has arrived instead of after the reply,
    and it takes pipelined requests (``conn``)."""
    ack_posted: bool = False
    """The built-in server answers an update with ``?ack=posted`` once its
    receive is posted. SGLang, pipelined: each broadcast then follows its own
    update's reply, never spinning, and the next one queues behind it. vLLM,
    pipelined: the finish is handled while the bytes arrive."""
    end_version: bool = False
    """The built-in server takes an SGLang session's version at its end
    (``/end_weight_update`` with ``weight_version``): every update body is
    then the same each version, encoded once here and parsed once there."""
    conn: PipelinedConnection | None = None
    """The pipelined connection of the last transfer (``PushConfig.pipelined``), reused while usable."""
    world_size: int = 2  # trainer + the replica's ranks (its TP*PP*DP workers)
    version: int = -1
    admitted: bool = True
    busy: bool = False
    transfers: int = 0
    failures: int = 0
    last_error: str = ""
    eject_reason: str = ""
    next_reconnect: float = 0.0
    reset_due: bool = False
    """disk and ipc (no weight group): rejoin before anything else is sent,
    as a grouped replica does when it has no group: after an ejection (an
    abandoned update session may be open there) or when it joined after
    ``connect`` (its ranks are not known yet)."""
    last_transfer_s: float = 0.0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    holding: _Staged | None = None
    """The staging buffer its transfer in flight reads (under ``Pusher._lock``)."""
    give_up: asyncio.Future | None = None
    """While a transfer is in flight: setting its result (an exception) makes
    the sender abandon the transfer at once and eject the replica with it."""


class ReplicaDown(PushError):
    """The inference pool reported the replica down (``Pusher.replica_down``)."""


async def _post(session: aiohttp.ClientSession, url: str, body: dict | bytes | None, timeout_s: float,
                params: dict | None = None) -> dict:
    """``body``: JSON, as an object or already encoded."""
    kw = ({"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes)
          else {"json": body})
    async with session.post(url, params=params, timeout=aiohttp.ClientTimeout(total=timeout_s), **kw) as r:
        return read_reply(url, r.status, await r.text())


def _spec_lists(specs: list[bk.TensorSpec]) -> tuple[list[str], list[str], list[list[int]]]:
    """Names, dtype names and shapes: the metadata of an update request."""
    return [b.name for b in specs], [bk.dtype_name(b.dtype) for b in specs], [list(b.shape) for b in specs]


ACK_POSTED = {"ack": "posted"}
"""The built-in server's extension of SGLang's update route: reply once the
receive is posted (``server.ack_posted``)."""

CONN_MAX_IDLE_S = 30.0
"""A pipelined connection idle for longer is replaced, not reused: servers
close idle connections (aiohttp after 75 s or more), and one closed while a
transfer's first request is on its way would fail that transfer."""


class _Requests:
    """How one transfer posts its control requests. On a pipelined connection
    (``in_order``) each is written at once and the server handles them in
    that order; otherwise each is a request of its own, so one that must
    follow another is posted only after the other's reply (``ordered``).
    Either way ``post`` returns a future of the reply; a pipelined request
    has no timeout of its own (the transfer's deadline bounds it)."""

    def __init__(self, session: aiohttp.ClientSession, url: str, conn: PipelinedConnection | None):
        self.session, self.url, self.conn = session, url, conn

    @property
    def in_order(self) -> bool:
        return self.conn is not None

    def post(self, path: str, body: dict | bytes | None, timeout_s: float,
             params: dict | None = None) -> asyncio.Future:
        if self.conn is not None:
            return self.conn.post(path, body, params)
        return asyncio.ensure_future(_post(self.session, self.url + path, body, timeout_s, params))

    async def ordered(self, reply: asyncio.Future | None) -> None:
        """Call before posting what must be handled after ``reply``'s request."""
        if reply is not None and self.conn is None:
            await reply


class Pusher:
    """Created on the trainer's rank 0. ``on_eject(url)`` / ``on_readmit(url)``
    let the inference pool stop and resume routing to a replica (both are
    called on the pusher's event loop); the pool's ``replica_down(url,
    reason)`` takes a replica it knows to be down out of the push at once."""

    def __init__(self, loop: LoopThread, urls: list[str], config: PushConfig, device: torch.device,
                 on_eject: Callable[[str], None] | None = None, on_readmit: Callable[[str], None] | None = None):
        if config.staging not in ("device", "host"):
            raise ValueError(f'staging must be "device" or "host", got {config.staging!r}')
        if config.backend == "ipc" and (config.staging != "device" or config.protocol != "sglang"):
            raise ValueError('backend "ipc" needs staging "device" (replicas map the staging buffers) and the '
                             f'SGLang protocol (/update_weights_from_tensor), got staging {config.staging!r}, '
                             f'protocol {config.protocol!r}')
        self.loop = loop
        self.cfg = config
        self.device = device
        self.replicas = [_Replica(u.rstrip("/")) for u in urls]
        self.on_eject = on_eject or (lambda url: None)
        self.on_readmit = on_readmit or (lambda url: None)
        self._lock = threading.Lock()
        self._staging: list[_Staged] = []
        self._latest: _Staged | None = None
        self._newest = -1  # the newest version staged (``_latest`` may be being rewritten)
        self._plan: list[list[bk.TensorSpec]] | None = None
        self._plan_key: list[tuple] | None = None  # (name, dtype, shape) of the tensors it was planned for
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._abandoned: set[asyncio.Task] = set()  # given-up transfers still running their clean-up
        self._progress = threading.Condition()
        self._closed = False
        self._started = False
        self.skipped_versions = 0
        # An ejected replica is readmitted once it is as current as admitted ones
        # are: the newest version in sync mode; in async mode also the one before
        # (a new version may be staged while its transfer runs; demanding lag 0
        # would never readmit a replica whose update outlasts a trainer step),
        # or any version the replicas it would join still serve (see _caught_up).
        self._readmit_lag = 0 if config.mode == "sync" else 1
        self.bytes_per_version = 0
        self._bodies: tuple[list, list[bytes]] | None = None  # (plan, its update requests' JSON)
        if config.backend == "ipc" and device.type == "cpu":
            ipc.share_cpu_memory()  # staging buffers any process on the host can map

    @property
    def stages_async(self) -> bool:
        """Whether ``push`` leaves a copy to pinned host memory running on the
        caller's stream: the source tensors must not change until it is done.
        gloo and disk send from host memory whatever ``staging`` says, so from
        a GPU they always stage this way: a copy into pageable memory would
        hold the trainer's thread for the whole transfer over PCIe."""
        return self.device.type == "cuda" and (self.cfg.staging == "host" or self._sends_from_host)

    @property
    def _sends_from_host(self) -> bool:
        """gloo and disk read each version from host memory, whatever ``staging`` says."""
        return self.cfg.backend in ("gloo", "disk")

    @property
    def _grouped(self) -> bool:
        """Whether each replica gets the bytes over a weight group of its own."""
        return self.cfg.backend in ("gloo", "nccl")

    # ------------------------------------------------------------ set-up

    def connect(self, initial_version: int = 0) -> None:
        """Join every replica's weight group and tag the weights they loaded
        from disk with ``initial_version``; fail (naming the replica) if any
        replica cannot join."""
        self.loop.run(self._connect_all(initial_version))

    @property
    def _auth(self) -> dict[str, str]:
        """The headers every request to a replica carries (``PushConfig.api_key``)."""
        return {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}

    async def _connect_all(self, initial_version: int) -> None:
        self._session = aiohttp.ClientSession(headers=self._auth)
        with self._lock:  # replicas added from now on join on their own (add_replica)
            self._started = True
            initial = list(self.replicas)
        results = await asyncio.gather(*((self._connect(r) if self._grouped else self._probe(r)) for r in initial),
                                       return_exceptions=True)
        errors = [f"{r.url}: {e}" for r, e in zip(initial, results) if isinstance(e, Exception)]
        if self.cfg.backend == "disk":
            import os

            os.makedirs(self.cfg.disk_folder, exist_ok=True)
            self._disk_lock = asyncio.Lock()
            self._disk_written: dict[int, str] = {}
        if errors:
            raise PushError("weight groups could not be set up: " + "; ".join(errors))
        if self.cfg.protocol == "sglang":  # vLLM has no route for this: its version is set by the first push
            await asyncio.gather(*(
                _post(self._session, r.url + "/update_weight_version",
                      {"new_version": str(initial_version), "abort_all_requests": False}, 30)
                for r in initial))
        for r in initial:
            r.version = initial_version
            self._tasks.append(asyncio.create_task(self._sender(r)))

    async def _probe(self, r: _Replica) -> None:
        """disk and ipc: no group to join; ipc sends one entry per replica rank."""
        if self.cfg.backend == "ipc":
            r.world_size = 1 + await self._replica_ranks(r)

    async def _connect(self, r: _Replica) -> None:
        """One weight group for replica ``r``: its HTTP join and ours run at
        once (each blocks until the other side has joined)."""
        r.world_size = 1 + await self._replica_ranks(r)
        r.builtin, r.ack_posted, r.end_version = await self._builtin(r)  # before the vLLM handshake below
        executor = DaemonExecutor(f"push-{r.url}")
        real_vllm_nccl = self.cfg.protocol == "vllm" and self.cfg.backend == "nccl" and not r.builtin
        if real_vllm_nccl:
            store, port = None, free_port(self.cfg.master_address)  # its join makes its own store
        else:
            try:
                store = await asyncio.get_running_loop().run_in_executor(
                    executor, master_store, self.cfg.master_address, r.world_size, self.cfg.init_timeout_s)
            except BaseException:
                executor.shutdown(wait=False, cancel_futures=True)
                raise
            port = store.port
        join_fn = lambda: init_weight_group(  # noqa: E731
            self.cfg.master_address, port, 0, r.world_size, backend=self.cfg.backend,
            group_name=GROUP_NAME if self.cfg.protocol == "sglang" else VLLM_GROUP_NAME,
            timeout_s=self.cfg.init_timeout_s, device=self.device if self.cfg.backend == "nccl" else None,
            store=store)
        if self.cfg.protocol == "sglang":
            path = "/init_weights_update_group"
            body = sglang.init_group_request(self.cfg.master_address, port, 1, r.world_size, GROUP_NAME,
                                             self.cfg.backend)
        else:
            path = vllm.INIT_WEIGHT_TRANSFER
            body = vllm.init_weight_transfer_request(r.world_size, 1, self.cfg.master_address, port, packed=True,
                                                     packed_buffer_size_bytes=self.cfg.packed_buffer_bytes)
            if real_vllm_nccl:
                # A real vLLM joins through its own store layout and PyNccl handshake.
                from torchtitan_grpo.weight_sync.vllm_group import init_vllm_weight_group

                join_fn = lambda: init_vllm_weight_group(  # noqa: E731
                    self.cfg.master_address, port, r.world_size, device=self.device,
                    timeout_s=self.cfg.init_timeout_s)
        http = asyncio.create_task(_post(self._session, r.url + path, body, self.cfg.init_timeout_s))
        join = asyncio.get_running_loop().run_in_executor(executor, join_fn)
        try:
            group, _ = await asyncio.gather(join, http)
        except BaseException:
            http.cancel()
            executor.shutdown(wait=False, cancel_futures=True)
            raise
        if self.cfg.backend == "nccl":
            r.stream = await asyncio.get_running_loop().run_in_executor(
                executor, lambda: torch.cuda.Stream(device=self.device))
        r.group, r.executor = group, executor

    async def _get(self, url: str) -> dict | None:
        """A probe's JSON; None if the route is missing or unreadable. A 401
        raises: taken for "no such route", it would make a replica that wants
        another key look like a different engine."""
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
                if resp.status == 401:
                    read_reply(url, resp.status, await resp.text(), method="GET")  # raises, naming the key
                return await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    async def _up(self, r: _Replica) -> bool:
        try:
            async with self._session.get(r.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def _replica_ranks(self, r: _Replica) -> int:
        """How many ranks the replica joins with: vLLM's /get_world_size,
        SGLang's tp_size from /get_server_info, else 1 (the built-in server)."""
        if self.cfg.protocol == "vllm":
            body = await self._get(r.url + vllm.WORLD_SIZE)
            return vllm.parse_world_size(body, r.url) if body is not None else 1
        info = await self._get(r.url + "/get_server_info")
        tp = info.get("tp_size") if isinstance(info, dict) else None
        return int(tp) if isinstance(tp, int) and tp >= 1 else 1

    async def _builtin(self, r: _Replica) -> tuple[bool, bool, bool]:
        """Whether ``r`` is the built-in server, whose /model_info names it
        (a real vLLM has no /model_info; a real SGLang's has no ``engine``
        field), whether the update route of the protocol in use takes
        ``?ack=posted`` and whether its SGLang session's end takes the version."""
        info = await self._get(r.url + "/model_info")
        builtin = isinstance(info, dict) and info.get("engine") == BUILTIN_ENGINE
        ack_key = "update_ack_posted" if self.cfg.protocol == "sglang" else "vllm_update_ack_posted"
        return (builtin, builtin and info.get(ack_key) is True,
                builtin and info.get("end_weight_version") is True)

    def add_replica(self, url: str) -> bool:
        """A replica that joined the fleet (e.g. through the pool's replica
        file); any thread. Before ``connect`` it is simply connected with the
        others (False). Afterwards it is joined in the background, sent the
        newest version and only then readmitted (True: route to it only after
        ``on_readmit``)."""
        url = url.rstrip("/")
        with self._lock:
            if any(r.url == url for r in self.replicas):
                return False
            r = _Replica(url)
            started = self._started
            if started:
                r.admitted = False
                r.reset_due = not self._grouped
            self.replicas.append(r)
        if started:
            def begin():
                self._tasks.append(asyncio.create_task(self._sender(r)))
                r.wake.set()  # no group yet: the sender joins, then catches up
            self.loop.loop.call_soon_threadsafe(begin)
        return started

    # ------------------------------------------------------- trainer side

    def push(self, tensors: dict[str, torch.Tensor], version: int, wait: bool | None = None) -> dict[str, float]:
        """Snapshot ``tensors`` as ``version`` and return. With ``wait`` (the
        default in sync mode) also wait until every admitted replica serves it.

        Without ``wait`` this never blocks: when every staging buffer is being
        sent, the version is skipped. With ``wait`` it waits for a buffer too,
        so the last version of a run is always delivered."""
        wait = self.cfg.mode == "sync" if wait is None else wait
        t0 = time.perf_counter()
        # Same tensors every step: plan once (this check is a list of tuples,
        # not of TensorSpecs: on the trainer's thread, ~300 tensors per push).
        key = [(n, t.dtype, t.shape) for n, t in tensors.items()]
        if key != self._plan_key:
            cast = self.cfg.dtype
            specs = [bk.TensorSpec(n, cast if cast is not None and t.is_floating_point() else t.dtype,
                                   tuple(t.shape)) for n, t in tensors.items()]
            # SGLang flattened buckets are itemsize-aligned; vLLM packed chunks
            # keep the tensors' order.
            plan = (bk.plan_buckets(specs, self.cfg.bucket_bytes) if self.cfg.protocol == "sglang"
                    else bk.plan_packed_chunks(specs, self.cfg.packed_buffer_bytes))
            with self._lock:  # staging buffers of an older plan are dropped once no sender holds them
                self._plan, self._plan_key = plan, key
            self.bytes_per_version = sum(s.nbytes for s in specs)
        staged = self._free_buffer()
        while staged is None and wait:
            self._reclaim_from_ejected()
            with self._progress:
                self._progress.wait(timeout=0.05)
            staged = self._free_buffer()
        if staged is None:
            self.skipped_versions += 1
            stall = time.perf_counter() - t0
            return {"push/skipped_versions": float(self.skipped_versions), "time/push_stall_s": stall,
                    **self._lag_metrics(version)}
        staged.start_writing()
        # A caller that waits for the replicas anyway (sync mode, a run's last
        # push) gets the version published before it is written: the senders'
        # control plane then runs during the snapshot and only the broadcasts
        # wait, each for its bucket's copies. Without ``wait`` the trainer's
        # thread goes back to training right after the snapshot, and a sender
        # busy on the event loop meanwhile would make every torch call of the
        # snapshot wait for the GIL: on 2 H200s the async step's stall went
        # from 0.6-1.0 ms to 2.7 ms that way (docs/PERFORMANCE.md, run 27), so
        # it publishes after.
        if wait:
            self._publish(staged, version)
        try:
            self._stage(staged, tensors)
        except BaseException as e:
            with self._lock:
                if staged.users == 0:
                    staged.version = -1  # no sender took it: as if never published
            staged.done_writing(f"{type(e).__name__}: {e}")
            raise
        staged.done_writing()
        if not wait:
            self._publish(staged, version)
        stall = time.perf_counter() - t0
        m = {"time/push_stall_s": stall, "push/bytes": float(self.bytes_per_version),
             "push/skipped_versions": float(self.skipped_versions)}
        if wait:
            self.wait_for(version)
            m["time/push_s"] = time.perf_counter() - t0
            m["push/GBps"] = self.bytes_per_version / m["time/push_s"] / 1e9
        return m | self._lag_metrics(version)

    def _publish(self, staged: _Staged, version: int) -> None:
        """Make ``staged`` the newest version and wake the senders."""
        with self._lock:
            staged.version = version
            self._latest = staged
            self._newest = max(self._newest, version)
        self.loop.loop.call_soon_threadsafe(self._wake_all)

    def _stage(self, staged: _Staged, tensors: dict[str, torch.Tensor]) -> None:
        """Copy ``tensors`` into ``staged``, cast to the push dtype on the way
        (one pass over the weights, no temporary), as ``_BucketCopy`` says."""
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

    def _free_buffer(self) -> _Staged | None:
        """A staging buffer no sender is reading: the not-yet-picked latest one
        can be overwritten (senders skip to the newest anyway). It is marked
        as being written (version -1) so that no sender takes it meanwhile."""
        with self._lock:
            # Tensors of another shape than before (not in a training run): new buffers.
            self._staging = [s for s in self._staging if s.plan is self._plan or s.users]
            for s in self._staging:
                if s.users == 0:
                    s.version = -1
                    return s
            if len(self._staging) >= self.cfg.num_staging_buffers:
                return None
            plan = self._plan
        # A new buffer, made outside the lock (pinning gigabytes of host memory
        # takes seconds; senders take the lock): only this thread adds buffers.
        on_device = not self._sends_from_host and self.cfg.staging == "device"
        where = self.device if on_device else torch.device("cpu")
        pinned = self.stages_async
        try:
            bufs = [torch.empty(bk.packed_nbytes(b), dtype=torch.uint8, device=where, pin_memory=pinned)
                    for b in plan]
            if self.cfg.backend == "ipc" and where.type == "cpu":
                bufs = [b.share_memory_() for b in bufs]  # a file in /dev/shm the replica maps
        except RuntimeError as e:  # torch.OutOfMemoryError included
            what = "pinned host" if pinned else f"{where}"
            if self._sends_from_host:  # host memory is the only choice: staging changes nothing
                remedy = "lower weight_sync.num_staging_buffers"
            else:
                other = ('"device"' if self.cfg.staging == "host" else '"host" (pinned host memory, slower pushes)')
                remedy = f"lower weight_sync.num_staging_buffers or set weight_sync.staging = {other}"
            raise PushError(
                f"staging buffer {len(self._staging) + 1} of {self.cfg.num_staging_buffers} "
                f"({sum(bk.packed_nbytes(b) for b in plan) / 1e9:.2f} GB of {what} memory) could not be "
                f"allocated: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; {remedy}") from e
        copies = [_BucketCopy.of(buf, b, self.cfg.large_tensor_bytes) for buf, b in zip(bufs, plan)]
        s = _Staged(-1, plan, bufs, copies, pinned=pinned)
        with self._lock:
            self._staging.append(s)
        return s

    def _reclaim_from_ejected(self) -> None:
        """A push that waits for a staging buffer waits for admitted replicas
        only. A buffer read by nothing but replicas out of routing (catch-up
        transfers) is taken back by giving those transfers up: such a replica
        gets the version being pushed next, instead of the one it was sent."""
        with self._lock:
            read_by_admitted = {id(r.holding) for r in self.replicas if r.admitted and r.holding is not None}
            held = [(r, r.holding) for r in self.replicas
                    if not r.admitted and r.holding is not None and id(r.holding) not in read_by_admitted]
        for r, staged in held:
            why = PushError(f"its catch-up transfer of version {staged.version} was given up: "
                            "a push that waits needs the staging buffer")
            self.loop.loop.call_soon_threadsafe(self._give_up, r, why, staged)

    def _take(self, r: _Replica) -> _Staged | None:
        """The staged version ``r`` should get next (None: it has the newest,
        or the newest is still being written); the caller gives it back
        (``users -= 1`` and ``holding = None``, under the lock) when its
        transfer ends."""
        with self._lock:
            staged = self._latest
            if staged is None or staged.version <= r.version:
                return None
            staged.users += 1
            r.holding = staged
            return staged

    def replica_down(self, url: str, reason: str) -> None:
        """The inference pool's word that ``url`` is down (connection refused,
        its process exited, a failed health check): it leaves the push now
        rather than at its deadline.

        Any thread, the pusher's event loop included; never blocks, and calls
        no hook from inside. Soon after, on the pusher's event loop: its
        transfer in flight, if any, is abandoned (releasing its staging
        buffer) and it is ejected as at a missed deadline (``on_eject``; once
        it answers /health again it rejoins, is sent the newest version and
        ``on_readmit`` follows), so a push or ``wait_for`` waiting for it stops
        waiting. A no-op for a URL this pusher does not send to, for a replica
        already out of routing with no transfer in flight, before ``connect``
        and after ``close``."""
        url = url.rstrip("/")
        with self._lock:
            r = next((x for x in self.replicas if x.url == url), None)
            if r is None or not self._started or self._closed:
                return
        try:
            self.loop.loop.call_soon_threadsafe(self._down, r, reason)
        except RuntimeError:  # the loop is already closed: nothing is in flight
            pass

    def _down(self, r: _Replica, reason: str) -> None:
        """Event loop: ``replica_down``'s work."""
        if self._closed:
            return
        why = ReplicaDown(f"reported down by the inference pool: {reason}")
        if not self._give_up(r, why) and r.admitted:
            self._eject(r, why)  # nothing in flight: out of routing now all the same
        self._notify()

    def _give_up(self, r: _Replica, why: Exception, staged: _Staged | None = None) -> bool:
        """Event loop: make ``r``'s sender abandon its transfer in flight (only
        if that transfer reads ``staged``, when given) and eject ``r`` with
        ``why``. False if there is no such transfer."""
        if r.give_up is None or r.give_up.done() or (staged is not None and r.holding is not staged):
            return False
        r.give_up.set_result(why)
        return True

    def wait_for(self, version: int, timeout_s: float | None = None) -> None:
        """Block until every admitted replica serves ``version`` or newer. A
        replica out of routing is never waited for: one ejected meanwhile (a
        missed deadline, a failure, ``replica_down``) stops counting at once."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._progress:
            while not all(r.version >= version or not r.admitted for r in self.replicas):
                if not any(r.admitted for r in self.replicas):
                    raise PushError("every replica has been ejected: " +
                                    "; ".join(f"{r.url}: {r.last_error}" for r in self.replicas))
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"replicas did not reach version {version} in {timeout_s}s")
                self._progress.wait(timeout=left if left is not None else 1.0)

    def _lag_metrics(self, version: int) -> dict[str, float]:
        m = {}
        for k, r in enumerate(self.replicas):
            m[f"push/replica{k}_version_lag"] = float(version - r.version)
            if r.last_transfer_s > 0:  # its newest whole transfer, HTTP control plane included
                m[f"push/replica{k}_GBps"] = self.bytes_per_version / r.last_transfer_s / 1e9
        m["push/ejected_replicas"] = float(sum(not r.admitted for r in self.replicas))
        m["push/failures"] = float(sum(r.failures for r in self.replicas))
        return m

    def status(self) -> list[dict]:
        return [{"url": r.url, "version": r.version, "admitted": r.admitted, "transfers": r.transfers,
                 "failures": r.failures, "last_error": r.last_error, "eject_reason": r.eject_reason,
                 "last_transfer_s": r.last_transfer_s}
                for r in self.replicas]

    # -------------------------------------------------------- sender side

    def _wake_all(self) -> None:
        for r in self.replicas:
            r.wake.set()

    def _notify(self) -> None:
        with self._progress:
            self._progress.notify_all()

    async def _sender(self, r: _Replica) -> None:
        while True:
            await r.wake.wait()
            r.wake.clear()
            if r.group is None if self._grouped else r.reset_due:  # ejected earlier: rejoin before anything else
                early = r.next_reconnect - time.monotonic()
                if early > 0:
                    await asyncio.sleep(early)
                r.next_reconnect = time.monotonic() + self.cfg.reconnect_interval_s
                if not await self._up(r):
                    # Joining a group with a replica that is not there would leave
                    # a thread blocked in the rendezvous until its timeout.
                    r.last_error = "reconnect: replica not answering /health"
                    r.wake.set()
                    continue
                try:
                    await self._reset_remote(r)
                    await asyncio.wait_for(self._connect(r) if self._grouped else self._probe(r),
                                           self.cfg.init_timeout_s + 5)
                    r.reset_due = False
                except Exception as e:
                    r.last_error = f"reconnect: {type(e).__name__}: {e}"
                    await asyncio.sleep(self.cfg.reconnect_interval_s)
                    r.wake.set()
                    continue
            staged = self._take(r)
            if staged is None:
                continue
            t0 = time.perf_counter()
            try:
                r.busy = True
                await self._transfer_or_give_up(r, staged)
                r.version = staged.version
                r.transfers += 1
                r.last_transfer_s = time.perf_counter() - t0
                if not r.admitted and self._caught_up(r):
                    r.admitted = True  # caught up: route to it again
                    logger.info("replica %s caught up at version %d: readmitted", r.url, r.version)
                    self.on_readmit(r.url)
            except Exception as e:
                if isinstance(e, TimeoutError) and not str(e):  # aiohttp's, which says nothing
                    e = TimeoutError("a control request timed out")
                self._eject(r, e)
            finally:
                r.busy = False
                with self._lock:
                    staged.users -= 1
                    r.holding = None
                self._notify()
            if self._newest > r.version:
                r.wake.set()  # a newer version arrived meanwhile

    async def _transfer_or_give_up(self, r: _Replica, staged: _Staged) -> None:
        """Send ``staged`` to ``r``; raise if that fails, misses its deadline
        or is given up (``_give_up``). A transfer still running then is
        cancelled but not waited for: its own clean-up (e.g. an unpause
        request to a replica that does not answer) would otherwise hold the
        ejection, the staging buffer and a push that waits."""
        transfer = asyncio.ensure_future(self._transfer(r, staged))
        r.give_up = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait((transfer, r.give_up), timeout=self.cfg.deadline_s,
                               return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # close()
            self._abandon(transfer)
            raise
        finally:
            give_up, r.give_up = r.give_up, None
        if give_up.done():  # even if the transfer ended too: the replica is down
            why = give_up.result()
        elif transfer.done():
            return transfer.result()  # its own error, if it failed
        else:
            why = TimeoutError(f"missed its {self.cfg.deadline_s}s deadline")
        self._abandon(transfer)
        raise why

    def _abandon(self, transfer: asyncio.Future) -> None:
        """Cancel ``transfer`` and let it end on its own (``close`` waits for it)."""
        transfer.cancel()
        self._abandoned.add(transfer)
        transfer.add_done_callback(self._forget)

    def _forget(self, transfer: asyncio.Future) -> None:
        self._abandoned.discard(transfer)
        if not transfer.cancelled():
            transfer.exception()  # retrieved: the ejection already reported why the transfer ended

    def _caught_up(self, r: _Replica) -> bool:
        """Whether ``r``, just past a whole transfer, may be routed to again.

        In async mode a version can take longer to send than the trainer takes
        to step (gloo on one GPU: ~2.6 s against ~0.23 s per step for a 0.6B
        fp32 model), so no replica is ever within one version of the newest.
        One that holds at least what every admitted replica serves is then as
        current as the fleet gets, and is readmitted: waiting for a lag of one
        would keep it out for good. Sync mode brings every admitted replica
        to the newest version before the trainer goes on, so there it is that."""
        if self._newest - r.version <= self._readmit_lag:
            return True
        if self.cfg.mode == "sync":
            return False
        serving = [o.version for o in self.replicas if o.admitted and o is not r]
        return not serving or r.version >= min(serving)

    async def _reset_remote(self, r: _Replica) -> None:
        """Before rejoining, close what the abandoned transfer left open on the
        replica (its update session and old group); each may already be gone."""
        s = self._session
        # The group goes first: the built-in server then drops what it received
        # of the abandoned version, so that closing the session loads nothing.
        calls = ((("/destroy_weights_update_group", {"group_name": GROUP_NAME}), ("/end_weight_update", {}),
                  ("/continue_generation", {})) if self.cfg.protocol == "sglang" else
                 ((vllm.SHUTDOWN_WEIGHT_TRANSFER, None), (vllm.RESUME, None)))
        for path, body in calls:
            try:
                await _post(s, r.url + path, body, self.cfg.init_timeout_s)
            except Exception:
                pass

    def _eject(self, r: _Replica, e: BaseException) -> None:
        r.failures += 1
        r.last_error = r.eject_reason = f"{type(e).__name__}: {e}"
        r.next_reconnect = time.monotonic() + self.cfg.reconnect_interval_s
        logger.warning("replica %s ejected from routing at version %d: %s", r.url, r.version, r.last_error)
        if r.group is not None:
            r.group.abort()  # unblocks a hung NCCL receive; the trainer never waits on it
        if r.executor is not None:
            r.executor.shutdown(wait=False, cancel_futures=True)  # a stuck gloo thread is abandoned
        if r.conn is not None:
            r.conn.close()  # replies still due on it belong to the abandoned transfer
        r.group, r.executor, r.stream, r.uploader, r.conn = None, None, None, None, None
        r.reset_due = not self._grouped
        if r.admitted:
            r.admitted = False
            self.on_eject(r.url)
        asyncio.get_running_loop().call_later(self.cfg.reconnect_interval_s, r.wake.set)  # retry even if idle

    async def _transfer(self, r: _Replica, staged: _Staged) -> None:
        if self.cfg.backend == "disk":
            await self._transfer_disk(r, staged)
        elif self.cfg.backend == "ipc":
            await self._transfer_ipc(r, staged)
        elif self.cfg.protocol == "sglang":
            await self._transfer_sglang(r, staged)
        else:
            await self._transfer_vllm(r, staged)

    async def _with_broadcasts(self, r: _Replica, answers: list[asyncio.Task], staged: _Staged,
                               buckets: list[int], wait: bool = True) -> None:
        """Broadcast ``staged``'s ``buckets`` (indices) to ``r`` while its update requests ``answers``
        are in flight; return once the broadcasts are done (the replica has
        the bytes; its replies may still be coming), or with ``wait=False``
        once they are queued on the sender's stream. If a request fails
        meanwhile (a refused update posts no receive), stop at once."""
        stop = threading.Event()
        # One hop to the replica's thread for all of them, not one per buffer
        # through the event loop (on 2 H200s this made no measurable
        # difference to push bandwidth: docs/PERFORMANCE.md, runs 4 and 5).
        send = asyncio.ensure_future(
            asyncio.get_running_loop().run_in_executor(r.executor, self._broadcast_all, r, staged, buckets, stop,
                                                       wait))
        try:
            await self._until(send, answers)
        except BaseException:
            stop.set()  # no further buffer is sent to a replica that refused or failed
            raise

    @staticmethod
    async def _until(target: asyncio.Future, answers: list[asyncio.Task]) -> None:
        """Wait for ``target`` (a reply among ``answers``, or the broadcasts);
        the first failure of ``target`` or of any of ``answers`` meanwhile
        raises, and then ``target`` and every request still in flight are
        cancelled."""
        try:
            while True:
                for t in (target, *answers):
                    if t.done() and t.exception() is not None:
                        raise t.exception()
                if target.done():
                    return
                await asyncio.wait({target, *(a for a in answers if not a.done())},
                                   return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            for t in answers:
                t.cancel()
            target.cancel()
            raise

    @staticmethod
    async def _answered(answers: list[asyncio.Task]) -> None:
        """Every update request's reply (the first failure raises)."""
        try:
            await asyncio.gather(*answers)
        except BaseException:
            for t in answers:
                t.cancel()
            raise

    async def _close_session(self, r: _Replica, answers: list[asyncio.Task], path: str, body: dict | None) -> None:
        """Once every byte has arrived: the updates' replies and the session's
        end (``path`` with ``body``; None: no session to end). The built-in
        server takes its end after the update in flight (one lock), so there
        the end goes out at once and overlaps the last update's reply and
        checks (~1.4 ms per version for vLLM on 2 H200s); SGLang and vLLM
        promise no such order, so they get it after the replies."""
        if body is None:
            await self._answered(answers)
            return
        if r.builtin:
            end = asyncio.create_task(_post(self._session, r.url + path, body, self.cfg.deadline_s))
            await self._answered([*answers, end])
            return
        await self._answered(answers)
        await _post(self._session, r.url + path, body, self.cfg.deadline_s)

    def _update_bodies(self, plan: list[list[bk.TensorSpec]]) -> list[bytes]:
        """The update requests' JSON for ``plan``, the same every version, so
        encoded once per plan (~0.6 ms for 399 tensors): vLLM's one request;
        SGLang's request of each bucket, without the version (the last one
        flushes the cache; it carries the version unless the replica takes
        that at the session's end, ``_Replica.end_version``)."""
        if self._bodies is None or self._bodies[0] is not plan:
            if self.cfg.protocol == "sglang":
                bodies = [self._sglang_update(plan, k, None) for k in range(len(plan))]
            else:
                bodies = [vllm.update_weights_request(*_spec_lists([b for chunk in plan for b in chunk]))]
            self._bodies = (plan, [json.dumps(b).encode() for b in bodies])
        return self._bodies[1]

    def _sglang_update(self, plan: list[list[bk.TensorSpec]], k: int, version: str | None) -> dict:
        """Bucket ``k``'s SGLang update request (the last one flushes the cache)."""
        return sglang.update_request(*_spec_lists(plan[k]), GROUP_NAME, flattened=True,
                                     flush_cache=self.cfg.pause_mode != "in_place" and k == len(plan) - 1,
                                     weight_version=version)

    @staticmethod
    def _end_body(r: _Replica, staged: _Staged) -> dict:
        """An SGLang session's end: with the version where the replica takes it there."""
        return {"weight_version": str(staged.version)} if r.end_version else {}

    async def _requests(self, r: _Replica) -> _Requests:
        """A transfer's way to post requests: pipelined to a built-in server
        (its connection kept from the last transfer while usable)."""
        if not (r.builtin and self.cfg.pipelined):
            return _Requests(self._session, r.url, None)
        if r.conn is None or not r.conn.usable(CONN_MAX_IDLE_S):
            if r.conn is not None:
                r.conn.close()
            r.conn = None
            conn = PipelinedConnection(r.url, headers=self._auth)
            await conn.open(30)
            r.conn = conn
        return _Requests(self._session, r.url, r.conn)

    def _acks_posted(self, r: _Replica, req: _Requests) -> bool:
        """Whether this transfer's updates ask for ``?ack=posted``: pipelined
        to a built-in server that takes it, with ``PushConfig.ack_posted``."""
        return req.in_order and r.ack_posted and self.cfg.ack_posted

    async def _begin_session(self, r: _Replica, req: _Requests) -> asyncio.Future | None:
        """SGLang >= 0.5.23 needs an update session; older builds answer 404
        (probed once per replica, then skipped). Returns begin's reply (None:
        no session), which the first broadcast waits for: an update without
        a session posts no receive."""
        if not r.sessionful:
            return None
        begin = req.post("/begin_weight_update", {"selector": "all"}, 30)
        try:
            await req.ordered(begin)
        except FileNotFoundError:
            r.sessionful = False
            return None
        return begin

    async def _transfer_sglang(self, r: _Replica, staged: _Staged) -> None:
        """pause -> begin -> (update request + broadcast) per bucket -> end -> continue
        (to a built-in server with ``ack_posted``: the pause just before the end)."""
        req = await self._requests(r)
        pausing = self.cfg.pause_mode != "none"
        answered = False
        try:
            watched: list[asyncio.Future] = []  # every request so far: the first failure stops the transfer
            ack = self._acks_posted(r, req)
            late = pausing and ack  # the pause just before the end (module docstring)
            if pausing and not late:
                watched.append(req.post("/pause_generation", {"mode": self.cfg.pause_mode}, 30))
                await req.ordered(watched[-1])
            begin = await self._begin_session(r, req)
            if begin is not None:
                watched.append(begin)
            n = len(staged.plan)
            bodies = self._update_bodies(staged.plan)

            def post_update(k: int) -> asyncio.Future:
                body: dict | bytes = (bodies[k] if k < n - 1 or r.end_version
                                      else self._sglang_update(staged.plan, k, str(staged.version)))
                return req.post("/update_weights_from_distributed", body, self.cfg.deadline_s,
                                params=ACK_POSTED if ack else None)

            updates: list[asyncio.Future] = []
            if req.in_order:
                # Handled in this order, each after the one before: every
                # update, then the end and continue, go out now, and the
                # replica goes from one to the next without a round trip.
                updates = [post_update(k) for k in range(n)]
                watched += updates
                if late:
                    watched.append(req.post("/pause_generation", {"mode": self.cfg.pause_mode}, 30))
                if r.sessionful:
                    watched.append(req.post("/end_weight_update", self._end_body(r, staged), self.cfg.deadline_s))
                if pausing:
                    watched.append(req.post("/continue_generation", {}, 30))
            for k in range(n):
                if not req.in_order:
                    # Request k goes out once bucket k-1 has arrived, before the
                    # reply to k-1: the replica then already holds request k-1
                    # (its receive was posted), so k queues behind it (SGLang's
                    # and our update lock) and is parsed while k-1 finishes.
                    updates.append(post_update(k))
                    watched.append(updates[-1])
                if k == 0 and begin is not None:
                    # A session, or the update posts no receive. Not update 0's
                    # reply even with ``ack``: that would add its round trip to
                    # every version (2 H200s: ~1.5 ms, run 48), and on a new
                    # group it cannot come at all, NCCL making the communicator
                    # in the first collective on both sides at once (run 45).
                    await self._until(begin, watched)
                elif ack and k > 0:
                    # The built-in server answers update k once its receive is
                    # posted: bucket k goes out then, so it never spins on the
                    # trainer's GPU, and is queued behind k-1 with no host wait
                    # (the replica posts k while k-1 is in flight): no gap.
                    await self._until(updates[k], watched)
                elif k > 0:
                    # Bucket k is broadcast only after the reply to k-1, when the
                    # replica is about to post its receive: an NCCL broadcast
                    # launched earlier spins on the trainer's GPU until then
                    # (2 H200s: a replica slowed 10x made the async step 1.30x
                    # slower that way, docs/PERFORMANCE.md runs 10-11).
                    await self._until(updates[k - 1], watched)
                await self._with_broadcasts(r, watched, staged, [k], wait=k == n - 1 or not ack)
            # The replica loads a session's buckets as one version at its end.
            if req.in_order:
                await self._answered(watched)
            else:
                await self._close_session(r, updates, "/end_weight_update",
                                          self._end_body(r, staged) if r.sessionful else None)
            answered = True
        finally:
            if pausing and not (answered and req.in_order):
                await self._unpause(r, "/continue_generation", {})

    async def _version_on_disk(self, staged: _Staged) -> str:
        """Write ``staged`` once (the first sender to need it does it, off the
        event loop) and return its folder; older folders are pruned."""
        import os
        import shutil

        from safetensors.torch import save_file

        async with self._disk_lock:
            v = staged.version
            if v not in self._disk_written:
                path = os.path.join(self.cfg.disk_folder, f"v{v}")

                def write():
                    staged.await_written()
                    for done in staged.ready or []:  # staging "host": the copies from the GPU
                        done.synchronize()
                    tensors = {}
                    for bucket, buf in zip(staged.plan, staged.buffers):
                        for spec, t in zip(bucket, bk.unpack(buf.cpu(), bucket)):
                            tensors[spec.name] = t.clone()
                    tmp = path + ".tmp"
                    os.makedirs(tmp, exist_ok=True)
                    save_file(tensors, os.path.join(tmp, "model.safetensors"))
                    os.replace(tmp, path)  # replicas never see a half-written version

                await asyncio.get_running_loop().run_in_executor(None, write)
                self._disk_written[v] = path
                for old in sorted(self._disk_written)[:-2]:
                    shutil.rmtree(self._disk_written.pop(old), ignore_errors=True)
            return self._disk_written[v]

    async def _transfer_disk(self, r: _Replica, staged: _Staged) -> None:
        """begin -> /update_weights_from_disk(folder of the version) -> end."""
        s = self._session
        path = await self._version_on_disk(staged)
        await self._begin_session(r, _Requests(s, r.url, None))
        body = {"model_path": path, "load_format": "safetensors", "weight_version": str(staged.version),
                "flush_cache": self.cfg.pause_mode != "in_place", "abort_all_requests": False}
        await _post(s, r.url + "/update_weights_from_disk", body, self.cfg.deadline_s)
        if r.sessionful:
            await _post(s, r.url + "/end_weight_update", {}, self.cfg.deadline_s)

    async def _transfer_ipc(self, r: _Replica, staged: _Staged) -> None:
        """begin -> /update_weights_from_tensor (handles to the staging buffer's
        tensors; the replica copies them before it answers) -> end. The
        buffer is released only after the answer."""
        s = self._session
        await self._begin_session(r, _Requests(s, r.url, None))

        def handles() -> str:  # off the event loop: waits for the snapshot's copies
            staged.await_written()
            for done in staged.ready or []:
                done.synchronize()
            return ipc.serialize([(spec.name, t) for bucket, buf in zip(staged.plan, staged.buffers)
                                  for spec, t in zip(bucket, bk.unpack(buf, bucket))])

        entry = await asyncio.get_running_loop().run_in_executor(None, handles)
        body = {"serialized_named_tensors": [entry] * (r.world_size - 1), "load_format": None,
                "weight_version": str(staged.version), "flush_cache": self.cfg.pause_mode != "in_place",
                "abort_all_requests": False}
        await _post(s, r.url + "/update_weights_from_tensor", body, self.cfg.deadline_s)
        if r.sessionful:
            await _post(s, r.url + "/end_weight_update", {}, self.cfg.deadline_s)

    async def _transfer_vllm(self, r: _Replica, staged: _Staged) -> None:
        """pause -> start -> one update_weights call while every packed chunk
        is broadcast -> finish(version) -> resume (to a built-in server with
        ``ack_posted``: the pause just before the finish)."""
        req = await self._requests(r)
        # Our "none" (let running requests finish) is vLLM's "wait"; in_place keeps them, as "keep" does.
        mode = {"none": "wait", "abort": "abort", "retract": "abort", "in_place": "keep"}[self.cfg.pause_mode]
        body = self._update_bodies(staged.plan)[0]
        finish = vllm.finish_weight_update_request(str(staged.version))
        answered = False
        try:
            if req.in_order:
                # Built-in server: every request at once. With ``ack`` the update
                # is answered once posted, and the pause and the finish are
                # handled while the bytes arrive.
                ack = self._acks_posted(r, req)
                calls = {vllm.PAUSE: (None, 30, vllm.pause_query(mode)),
                         vllm.START_WEIGHT_UPDATE: (None, 30, None),
                         vllm.UPDATE_WEIGHTS: (body, self.cfg.deadline_s, ACK_POSTED if ack else None),
                         vllm.FINISH_WEIGHT_UPDATE: (finish, self.cfg.deadline_s, None),
                         vllm.RESUME: (None, 30, None)}
                order = list(calls)
                if ack:  # the pause just before the finish (module docstring)
                    order.remove(vllm.PAUSE)
                    order.insert(order.index(vllm.FINISH_WEIGHT_UPDATE), vllm.PAUSE)
                replies = {path: req.post(path, *calls[path]) for path in order}
                start, watched = replies[vllm.START_WEIGHT_UPDATE], list(replies.values())
                # The update is next in line: no broadcast spins while the round starts.
                await self._until(start, watched)
                await self._with_broadcasts(r, watched, staged, list(range(len(staged.buffers))))
                await self._answered(watched)
            else:
                await _post(self._session, r.url + vllm.PAUSE, None, 30, params=vllm.pause_query(mode))
                await _post(self._session, r.url + vllm.START_WEIGHT_UPDATE, None, 30)
                update = req.post(vllm.UPDATE_WEIGHTS, body, self.cfg.deadline_s)
                await self._with_broadcasts(r, [update], staged, list(range(len(staged.buffers))))
                await self._close_session(r, [update], vllm.FINISH_WEIGHT_UPDATE, finish)
            answered = True
        finally:
            if not (answered and req.in_order):
                await self._unpause(r, vllm.RESUME, None)

    async def _unpause(self, r: _Replica, path: str, body: dict | None) -> None:
        """Let ``r`` generate again after a transfer whose pipelined requests
        did not all come back (their own unpause among them), or that had none:
        on a request of its own, and only logged if it fails (the eject path
        reports the transfer's error)."""
        try:
            await _post(self._session, r.url + path, body, 30)
        except Exception as e:
            logger.warning("%s on %s failed: %s", path.lstrip("/"), r.url, e)

    @staticmethod
    def _broadcast_all(r: _Replica, staged: _Staged, buckets: list[int], stop: threading.Event,
                       wait: bool = True) -> None:
        group, stream = r.group, r.stream  # an ejection clears them while this thread may still run
        up = None
        if stream is not None and staged.buffers[0].device.type == "cpu":  # staging "host" over nccl
            staged.await_written(stop)  # the uploads follow every bucket's copy to the host
            up = r.uploader
            need = max(b.numel() for b in staged.buffers)
            if up is None or up.nbytes < need:
                up = r.uploader = Uploader(stream.device, need)
            if buckets[0] == 0:  # every transfer starts at bucket 0
                up.begin(staged.buffers, staged.ready)
        for i, k in enumerate(buckets):
            if stop.is_set():
                return
            last = wait and i == len(buckets) - 1
            if up is not None:
                group.broadcast(up.take(k, stream), src=0, stream=stream, wait=False)
                up.sent(k, stream)  # bucket k+1 uploads while k is sent
                if last:
                    stream.synchronize()
                continue
            # Bucket by bucket: in a push that waits (published before it is
            # staged), the first broadcast is queued as soon as the first
            # bucket's copies are, not after the whole snapshot.
            staged.await_written(stop, bucket=k)
            if stop.is_set():
                return
            if staged.ready is not None:  # the snapshot's copy of this bucket
                if stream is not None:
                    stream.wait_event(staged.ready[k])
                else:
                    staged.ready[k].synchronize()  # gloo from pinned memory: the copy may still run
            # Only the last is waited for on the host: each chunk follows the
            # one before on the stream, with no host round trip in between.
            group.broadcast(staged.buffers[k], src=0, stream=stream, wait=last)

    # ------------------------------------------------------------ close

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def _close():
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            abandoned = list(self._abandoned)  # the senders' cancelled transfers among them
            for t in abandoned:
                t.cancel()
            await asyncio.gather(*abandoned, return_exceptions=True)
            for r in self.replicas:
                if r.conn is not None:
                    r.conn.close()
            if self._session:
                await self._session.close()

        try:
            self.loop.run(_close(), timeout=10)
        except Exception:
            pass
        for r in self.replicas:
            if r.group is not None:
                r.group.close()
            if r.executor is not None:
                r.executor.shutdown(wait=False, cancel_futures=True)
