"""InferencePool: generation requests over a fleet of replicas.

One aiohttp session per replica (bounded connections, keep-alive),
least-outstanding-requests routing, per-request timeouts, and retry of a failed
request on another replica. A request is one prompt with its whole group of n
samples, so a retry regenerates the whole group: a group is never assembled
from two attempts and no sample is duplicated. Replicas are marked down after a
failure and skipped by routing until a health check readmits them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import aiohttp

from torchtitan_grpo.inference import sglang
from torchtitan_grpo.inference.types import Completion, MalformedResponse, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class Replica:
    url: str
    session: aiohttp.ClientSession | None = None
    outstanding: int = 0
    healthy: bool = True
    failures: int = 0
    served: int = 0
    last_error: str = ""


@dataclass
class PoolConfig:
    request_timeout_s: float = 120.0
    max_retries: int = 3
    max_connections: int = 64
    health_interval_s: float = 2.0


class NoHealthyReplica(RuntimeError):
    pass


class InferencePool:
    """Must be created and used on one event loop (see aio.LoopThread)."""

    def __init__(self, urls: list[str], config: PoolConfig | None = None):
        if not urls:
            raise ValueError("InferencePool needs at least one replica URL")
        self.config = config or PoolConfig()
        self.replicas = [Replica(u.rstrip("/")) for u in urls]
        self._health_task: asyncio.Task | None = None

    async def start(self) -> None:
        for r in self.replicas:
            r.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.config.max_connections, keepalive_timeout=60))
        self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        for r in self.replicas:
            if r.session:
                await r.session.close()

    def _pick(self, exclude: set[str]) -> Replica:
        live = [r for r in self.replicas if r.healthy and r.url not in exclude]
        if not live:
            live = [r for r in self.replicas if r.healthy]
        if not live:
            raise NoHealthyReplica("no healthy inference replica: " +
                                   "; ".join(f"{r.url}: {r.last_error}" for r in self.replicas))
        return min(live, key=lambda r: r.outstanding)

    async def generate(self, prompt_ids: list[int], n: int, params: SamplingParams) -> list[Completion]:
        """n samples for one prompt, all from one replica and one attempt."""
        tried: set[str] = set()
        errors = []
        for _ in range(self.config.max_retries):
            try:
                r = self._pick(tried)
            except NoHealthyReplica:
                # Wait for the health loop to readmit someone rather than fail the batch.
                await asyncio.sleep(self.config.health_interval_s)
                continue
            tried.add(r.url)
            try:
                return await self._generate_on(r, prompt_ids, n, params)
            except (aiohttp.ClientError, asyncio.TimeoutError, MalformedResponse, ValueError) as e:
                msg = f"{type(e).__name__}: {e}"
                errors.append(f"{r.url}: {msg}")
                self._mark_failed(r, msg)
        raise RuntimeError(f"generation failed after {self.config.max_retries} attempts: " + " | ".join(errors))

    async def _generate_on(self, r: Replica, prompt_ids, n, params) -> list[Completion]:
        body = sglang.generate_request(prompt_ids, n, params)
        r.outstanding += 1
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
            async with r.session.post(r.url + "/generate", json=body, timeout=timeout) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status,
                                                      message=text[:300])
                try:
                    import json
                    data = json.loads(text)
                except ValueError as e:
                    raise MalformedResponse(r.url, "(body)", f"not JSON: {text[:100]!r}") from e
            out = sglang.parse_generate(data, n, r.url)
            r.served += 1
            return out
        finally:
            r.outstanding -= 1

    def _mark_failed(self, r: Replica, msg: str) -> None:
        r.failures += 1
        r.last_error = msg
        if r.healthy:
            logger.warning("replica %s marked down: %s", r.url, msg)
        r.healthy = False

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await asyncio.gather(*(self._check(r) for r in self.replicas if not r.healthy))

    async def _check(self, r: Replica) -> None:
        try:
            async with r.session.get(r.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status == 200:
                    logger.info("replica %s healthy again", r.url)
                    r.healthy = True
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass

    def metrics(self) -> dict[str, float]:
        return {
            "pool/healthy_replicas": sum(r.healthy for r in self.replicas),
            "pool/failures": sum(r.failures for r in self.replicas),
        }
