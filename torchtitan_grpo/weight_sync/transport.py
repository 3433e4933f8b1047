"""How a version reaches a replica: the interface of a transport, and the
per-replica record the Pusher and its transport share.

The Pusher (``pusher.py``) does what every transport needs: staging buffers,
versions, one sender per replica, deadlines, ejection and readmission. A
transport is the way there, one module each (``sglang_push``, ``vllm_push``,
``ipc_push``, ``vllm_ipc_push``, ``disk_push``; ``builtin_push`` adds the
built-in server's extensions to the first two), picked in ``pusher.TRANSPORTS``.

What the Pusher calls, all on its event loop but ``plan`` (trainer's thread)
and ``release`` (after the loop is done with the replica):

* ``start()`` once, before anything else; ``connect(r)`` for each replica at
  ``Pusher.connect``, and again, after ``reset(r)``, each time an ejected or
  newly added replica rejoins; ``tag(replicas, version)`` once, for the
  version the first replicas loaded from disk;
* ``send(r, staged)`` for each version a replica gets (one at a time per
  replica); the Pusher cancels it at its deadline or when the replica is
  reported down, and does not wait for its clean-up;
* ``abort(r)`` when ``r`` is ejected: it must unblock whatever of the
  transfer may hang (a broadcast, a thread) and drop the replica's link, so
  that ``connect`` starts afresh;
* at ``Pusher.close``, once the senders are stopped: ``reset(r)`` again on
  each replica that answers /health, within a short timeout (a new Pusher,
  a restarted trainer's, must be able to join it: a real SGLang refuses a
  second group of the same name until the first is destroyed), then
  ``close(replicas)``, then ``release(r)``.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from dataclasses import dataclass, field

import aiohttp
import torch

from torchtitan_grpo.aio import DaemonExecutor
from torchtitan_grpo.protocol import builtin, vllm
from torchtitan_grpo.reasons import reason
from torchtitan_grpo.weight_sync import buckets as bk
from torchtitan_grpo.weight_sync import control
from torchtitan_grpo.weight_sync.control import PipelinedConnection, read_reply
from torchtitan_grpo.weight_sync.group import WeightGroup
from torchtitan_grpo.weight_sync.push_config import PushConfig
from torchtitan_grpo.weight_sync.staging import Staged
from torchtitan_grpo.weight_sync.upload import Uploader

logger = logging.getLogger(__name__)


@dataclass
class Replica:
    """One replica as the Pusher and its transport see it."""

    url: str
    # ---- the Pusher's: versions, routing, the sender
    version: int = -1
    admitted: bool = True
    joined: bool = False
    """Connected (``Transport.connect``) since it was added or last ejected;
    its sender connects it before it sends anything otherwise."""
    busy: bool = False
    transfers: int = 0
    failures: int = 0
    last_error: str = ""
    eject_reason: str = ""
    next_reconnect: float = 0.0
    last_transfer_s: float = 0.0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    holding: Staged | None = None
    """The staging buffer its transfer in flight reads (under ``StagingBuffers.lock``)."""
    give_up: asyncio.Future | None = None
    """While a transfer is in flight: setting its result (an exception) makes
    the sender abandon the transfer at once and eject the replica with it."""
    # ---- the transport's link to it: set by ``connect``, dropped by ``abort``
    world_size: int = 2  # trainer + the replica's ranks (its TP*PP*DP workers)
    group: WeightGroup | None = None
    executor: DaemonExecutor | None = None
    """The thread its blocking broadcasts run on."""
    stream: object | None = None
    """nccl: the CUDA stream its broadcasts run on."""
    uploader: Uploader | None = None  # staging "host" over nccl: the device buffers buckets are sent from
    conn: PipelinedConnection | None = None
    """The built-in server's pipelined connection of the last transfer
    (``PushConfig.pipelined``), reused while usable."""
    # ---- what it said it takes (probed when it connects)
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
    dialect: vllm.Dialect = vllm.V0_33
    """vLLM: the release whose bodies ``r`` takes (its /version, read at each connect)."""
    round_open: bool | None = None
    """vLLM: whether this trainer left an update round open there (started, not
    finished); None until it has posted either."""


class Transport(abc.ABC):
    """One way of getting staged versions to replicas (one per Pusher).

    Subclasses implement ``connect`` and ``send`` and override what else
    they need; the defaults suit a transport with nothing to join and
    nothing to tear down."""

    def __init__(self, cfg: PushConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.session: aiohttp.ClientSession | None = None
        """The HTTP session of every request to the replicas but pipelined ones."""

    # ------------------------------------------------------------ interface

    @property
    def reads_host_memory(self) -> bool:
        """Whether it sends each version from host memory whatever
        ``PushConfig.staging`` says (gloo, disk): the snapshots are then
        made there."""
        return False

    def plan(self, specs: list[bk.TensorSpec]) -> list[list[bk.TensorSpec]]:
        """The buckets a version is staged and sent in: SGLang's flattened
        buckets of ``bucket_bytes`` (itemsize-aligned) unless the protocol
        wants another layout."""
        return bk.plan_buckets(specs, self.cfg.bucket_bytes)

    def prepare_buffers(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """New staging buffers, before their first use (e.g. made shareable)."""
        return buffers

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(headers=self.auth)

    @abc.abstractmethod
    async def connect(self, r: Replica) -> None:
        """Make ``r`` ready to receive (join its weight group, learn its ranks)."""

    async def reset(self, r: Replica) -> None:
        """Before ``r`` rejoins, and at ``Pusher.close``: close what this
        transport set up on it (its weight group, transfer engine) and what an
        abandoned transfer may have left open (a session, a pause); each
        piece may already be gone."""

    async def tag(self, replicas: list[Replica], version: int) -> None:
        """Name the weights ``replicas`` loaded from disk ``version``, where the protocol can."""

    @abc.abstractmethod
    async def send(self, r: Replica, staged: Staged) -> None:
        """One whole version to ``r``; raise if it fails. Whatever reads the
        staging buffers first waits for ``staged.await_written``."""

    def abort(self, r: Replica) -> None:
        """``r`` is ejected: unblock its transfer, if any, and drop its link."""

    async def close(self, replicas: list[Replica]) -> None:
        """The senders are stopped: close what lives on the event loop."""
        if self.session:
            await self.session.close()

    def release(self, r: Replica) -> None:
        """After ``close``: free what ``r``'s link holds off the event loop."""

    # -------------------------------------------------------------- helpers

    @property
    def auth(self) -> dict[str, str]:
        """The headers every request to a replica carries (``PushConfig.api_key``)."""
        return {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}

    async def post(self, r: Replica, path: str, body: dict | bytes | None, timeout_s: float,
                   params: dict | None = None) -> dict:
        """A request of its own to ``r`` (``control.post``)."""
        return await control.post(self.session, r.url + path, body, timeout_s, params)

    async def get(self, url: str) -> dict | None:
        """A probe's JSON; None if the route is missing or unreadable. A 401
        raises: taken for "no such route", it would make a replica that wants
        another key look like a different engine."""
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
                if resp.status == 401:
                    read_reply(url, resp.status, await resp.text(), method="GET")  # raises, naming the key
                return await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    async def healthy(self, r: Replica) -> bool:
        """Whether ``r`` answers /health (before a rejoin: joining a group with
        a replica that is not there would block a thread until its timeout)."""
        try:
            async with self.session.get(r.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def probe_builtin(self, r: Replica) -> builtin.BuiltinTraits:
        """Whether ``r`` is the built-in server, whose /model_info names it (a
        real vLLM has no /model_info; a real SGLang's has no ``engine``
        field), and which of its extensions the protocol in use may rely on
        (``protocol.builtin``)."""
        return builtin.traits(await self.get(r.url + "/model_info"), self.cfg.protocol)

    async def unpause(self, r: Replica, path: str, body: dict | None) -> None:
        """Let ``r`` generate again after a transfer whose pipelined requests
        did not all come back (their own unpause among them), or that had none:
        on a request of its own, and only logged if it fails (the eject path
        reports the transfer's error)."""
        try:
            await self.post(r, path, body, 30)
        except Exception as e:
            logger.warning("%s on %s failed: %s", path.lstrip("/"), r.url, reason(e))
