"""InferencePool throughput and latency against direct calls, on localhost built-in servers.

    OMP_NUM_THREADS=1 python bench/pool_bench.py [--servers 2] [--requests 32] [--concurrency 1 8] \
        [--n 4] [--max-new-tokens 16] [--rounds 8] [--model DIR]

Starts ``--servers`` built-in servers (one torch thread each; without
``--model``, the demo's tiny random Qwen3 is written to a temporary
directory) and sends the same seeded requests (one prompt, a group of ``n``
samples each) three ways, at each concurrency:

* ``direct x1``: one aiohttp session straight to server 0 (the baseline:
  what a client without a pool pays), the reply parsed and validated the same way;
* ``pool x1``: the pool over server 0 alone (the pool's own overhead);
* ``direct xK round-robin``: straight to all K servers, request i to server
  i mod K (what the machine gives K servers without a pool);
* ``pool xK``: the pool over all K servers.

Requests are seeded, so every configuration generates exactly the same
tokens. The configurations alternate within each round, and requests/s is
the median over rounds, so that bursts of load from other processes on the
machine hit every configuration alike and do not decide the result. Prints
one table: requests/s, and p50 / p99 / mean request latency over all rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan_grpo.fleet import sglang  # noqa: E402
from torchtitan_grpo.fleet.launcher import ServerSpec, running_servers  # noqa: E402
from torchtitan_grpo.fleet.pool import InferencePool, PoolConfig, percentile  # noqa: E402
from torchtitan_grpo.fleet.types import SamplingParams  # noqa: E402


def workload(num: int, n: int, max_new_tokens: int) -> list[tuple[list[int], SamplingParams]]:
    # Printable-character ids of the tiny model's tokenizer; varied prompt lengths.
    return [([2 + (7 * i + j) % 90 for j in range(8 + i % 9)],
             SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=10_000 + i))
            for i in range(num)]


async def run_direct(urls: list[str], work, n: int, concurrency: int) -> tuple[float, list[float]]:
    """Straight to the servers, request i to server i mod K (no pool)."""
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as s:
        async def one(i, ids, p):
            url = urls[i % len(urls)]
            async with sem:
                t = time.perf_counter()
                async with s.post(url + "/generate", json=sglang.generate_request(ids, n, p)) as r:
                    r.raise_for_status()
                    sglang.parse_generate(await r.json(), n, url)
                lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, ids, p) for i, (ids, p) in enumerate(work)))
        return time.perf_counter() - t0, lat


async def run_pool(urls: list[str], work, n: int, concurrency: int) -> tuple[float, list[float]]:
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []
    pool = InferencePool(urls, PoolConfig())
    await pool.start()
    try:
        async def one(ids, p):
            async with sem:
                t = time.perf_counter()
                await pool.generate(ids, n, p)
                lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(ids, p) for ids, p in work))
        wall = time.perf_counter() - t0
        assert pool.metrics()["pool/failures"] == 0
        return wall, lat
    finally:
        await pool.close()


async def bench(urls: list[str], args) -> list[tuple]:
    work = workload(args.requests, args.n, args.max_new_tokens)
    configs = [("direct x1", lambda c: run_direct(urls[:1], work, args.n, c)),
               ("pool x1", lambda c: run_pool(urls[:1], work, args.n, c))]
    if len(urls) > 1:
        k = len(urls)
        configs += [(f"direct x{k} round-robin", lambda c: run_direct(urls, work, args.n, c)),
                    (f"pool x{k}", lambda c: run_pool(urls, work, args.n, c))]
    # Warm-up: first-request costs (connections, allocator, lazy inits) out of the numbers.
    await run_direct(urls, work[: 2 * len(urls)], args.n, 2 * len(urls))
    rows = []
    for c in args.concurrency:
        rates: dict[str, list[float]] = {name: [] for name, _ in configs}
        lats: dict[str, list[float]] = {name: [] for name, _ in configs}
        for _ in range(args.rounds):
            for name, fn in configs:
                wall, lat = await fn(c)
                rates[name].append(len(lat) / wall)
                lats[name] += lat
        for name, _ in configs:
            s = sorted(lats[name])
            rows.append((name, c, len(s), statistics.median(rates[name]), percentile(s, 50) * 1e3,
                         percentile(s, 99) * 1e3, statistics.mean(s) * 1e3))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32, help="requests per configuration and round")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--n", type=int, default=4, help="samples per request (group size)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--model", default=None, help="HF model dir (default: the tiny demo model)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from torchtitan_grpo.models.demo_assets import ensure_tiny_qwen3

            model = ensure_tiny_qwen3(os.path.join(tmp, "tiny-qwen3"))
        specs = [ServerSpec(model, threads=1, seed=k) for k in range(args.servers)]
        with running_servers(specs, os.path.join(tmp, "logs"), timeout_s=300) as servers:
            rows = asyncio.run(bench([s.url for s in servers], args))

    print(f"# {args.servers} built-in server(s), 1 torch thread each; {args.requests} requests x {args.rounds} "
          f"rounds per row; n={args.n}, max_new_tokens={args.max_new_tokens}; cpu_count={os.cpu_count()}")
    base = {c: p50 for name, c, _, _, p50, _, _ in rows if name == "direct x1"}
    print("| path | concurrency | requests | req/s (median of rounds) | p50 ms | p99 ms | mean ms | p50 vs direct x1 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, c, num, rps, p50, p99, mean in rows:
        print(f"| {name} | {c} | {num} | {rps:.1f} | {p50:.1f} | {p99:.1f} | {mean:.1f} | {p50 / base[c]:.2f}x |")


if __name__ == "__main__":
    main()
