"""A misbehaving inference replica for the pool's fault tests.

    python tests/fault_server.py --upstream http://127.0.0.1:PORT [--port 0]

prints ``ready http://HOST:PORT``. It forwards ``POST /generate`` (SGLang
protocol) to a real built-in server and answers ``POST /v1/completions`` (vLLM
protocol) by translating to and from the upstream's /generate, so its good
answers are real generations. A fault applies to the generation routes:

    POST /_fault {"mode": MODE, "count": null|K, "delay_s": S, "health": "ok"|"fail"}
    GET  /_fault  -> {"mode", "count", "health", "generate_requests"}

``count`` = K makes the fault apply to the next K generation requests only,
then mode returns to "ok". Modes:

    ok                 forward and answer correctly
    slow               sleep delay_s, then answer correctly
    hang               never answer (until the client gives up)
    http500            HTTP 500
    http503            HTTP 503 (vLLM while paused)
    bad_json           HTTP 200 with a body that is not JSON
    malformed_count    one completion short of n
    malformed_missing  a required field deleted (output_ids / token_ids)
    malformed_lengths  one logprob more than token ids
    drop               half the body, then the connection is cut
    abort              correct shape, every finish_reason "abort"

``health`` = "fail" makes GET /health answer 503.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import aiohttp
from aiohttp import web

MODES = ("ok", "slow", "hang", "http500", "http503", "bad_json", "malformed_count", "malformed_missing",
         "malformed_lengths", "drop", "abort")


class FaultServer:
    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.mode, self.count, self.delay_s, self.health = "ok", None, 0.0, "ok"
        self.generate_requests = 0
        self.session: aiohttp.ClientSession | None = None

    async def on_startup(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession()

    async def on_cleanup(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    # ---- control ----------------------------------------------------------- #

    async def set_fault(self, request: web.Request) -> web.Response:
        body = await request.json()
        mode = body.get("mode", "ok")
        if mode not in MODES:
            return web.json_response({"error": f"mode must be one of {MODES}"}, status=400)
        self.mode, self.count = mode, body.get("count")
        self.delay_s = float(body.get("delay_s", 0.0))
        self.health = body.get("health", "ok")
        return await self.get_fault(request)

    async def get_fault(self, request: web.Request) -> web.Response:
        return web.json_response({"mode": self.mode, "count": self.count, "health": self.health,
                                  "generate_requests": self.generate_requests})

    async def health_route(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.health == "ok" else 503)

    # ---- generation -------------------------------------------------------- #

    def _take_mode(self) -> str:
        """The mode for this request (a counted fault runs out)."""
        self.generate_requests += 1
        mode = self.mode
        if self.count is not None:
            self.count -= 1
            if self.count <= 0:
                self.mode, self.count = "ok", None
        return mode

    async def _upstream_generate(self, body: dict) -> tuple[int, bytes]:
        assert self.session is not None
        async with self.session.post(self.upstream + "/generate", json=body) as resp:
            return resp.status, await resp.read()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        mode = self._take_mode()
        body = await request.json()
        early = await self._early_fault(mode)
        if early is not None:
            return early
        status, raw = await self._upstream_generate(body)
        if status != 200:
            return web.Response(status=status, body=raw, content_type="application/json")
        data = json.loads(raw)
        items = data if isinstance(data, list) else [data]
        if mode == "malformed_count":
            items = items[:-1]
            data = items
        elif mode == "malformed_missing":
            del items[0]["output_ids"]
        elif mode == "malformed_lengths":
            items[0]["meta_info"]["output_token_logprobs"].append([-1.0, 0, None])
        elif mode == "abort":
            for it in items:
                it["meta_info"]["finish_reason"] = {"type": "abort", "message": "paused", "status_code": None}
        return await self._reply(request, mode, data)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """vLLM /v1/completions over the upstream's SGLang /generate."""
        mode = self._take_mode()
        body = await request.json()
        early = await self._early_fault(mode)
        if early is not None:
            return early
        n = int(body.get("n", 1))
        sp = {"max_new_tokens": body.get("max_tokens", 16), "n": n, "temperature": body.get("temperature", 1.0),
              "top_p": body.get("top_p", 1.0), "top_k": body.get("top_k", -1),
              "stop_token_ids": body.get("stop_token_ids") or []}
        if body.get("seed") is not None:
            sp["sampling_seed"] = body["seed"]
        status, raw = await self._upstream_generate(
            {"input_ids": body["prompt"], "sampling_params": sp, "return_logprob": True})
        if status != 200:
            return web.json_response({"error": {"message": raw.decode(errors="replace"), "type": "BadRequest",
                                                "param": None, "code": status}}, status=status)
        data = json.loads(raw)
        items = data if isinstance(data, list) else [data]
        choices = []
        for k, it in enumerate(items):
            ids = it["output_ids"]
            meta = it["meta_info"]
            choices.append({
                "index": k, "text": it.get("text", ""),
                "logprobs": {"text_offset": list(range(len(ids))),
                             "token_logprobs": [e[0] for e in meta["output_token_logprobs"]],
                             "tokens": [f"token_id:{t}" for t in ids], "top_logprobs": None},
                "finish_reason": meta["finish_reason"]["type"], "token_ids": ids, "prompt_token_ids": None,
                "weight_versions": [{"version": meta["weight_version"], "start": 0, "end": len(ids)}] if ids else [],
            })
        if mode == "malformed_count":
            choices = choices[:-1]
        elif mode == "malformed_missing":
            del choices[0]["token_ids"]
        elif mode == "malformed_lengths":
            choices[0]["logprobs"]["token_logprobs"].append(-1.0)
        elif mode == "abort":
            for c in choices:
                c["finish_reason"] = "abort"
        out = {"id": "cmpl-fault", "object": "text_completion", "created": 0, "model": body.get("model", ""),
               "choices": choices, "usage": {}}
        return await self._reply(request, mode, out)

    async def _early_fault(self, mode: str) -> web.StreamResponse | None:
        """Faults that do not need the upstream's answer."""
        if mode == "hang":
            await asyncio.sleep(3600)  # cancelled when the client disconnects
        if mode == "slow":
            await asyncio.sleep(self.delay_s)
        if mode == "http500":
            return web.Response(status=500, text="internal error (injected)")
        if mode == "http503":
            return web.Response(status=503, text="paused (injected)")
        if mode == "bad_json":
            return web.Response(status=200, text='{"text": "half', content_type="application/json")
        return None

    async def _reply(self, request: web.Request, mode: str, data) -> web.StreamResponse:
        raw = json.dumps(data).encode()
        if mode != "drop":
            return web.Response(body=raw, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": str(len(raw))})
        await resp.prepare(request)
        await resp.write(raw[: len(raw) // 2])
        request.transport.abort()  # the client sees a truncated body and a reset
        return resp


def build_app(upstream: str) -> web.Application:
    fs = FaultServer(upstream)
    app = web.Application()
    app.on_startup.append(fs.on_startup)
    app.on_cleanup.append(fs.on_cleanup)
    app.router.add_post("/_fault", fs.set_fault)
    app.router.add_get("/_fault", fs.get_fault)
    app.router.add_get("/health", fs.health_route)
    app.router.add_post("/generate", fs.generate)
    app.router.add_post("/v1/completions", fs.completions)
    return app


async def _serve(host: str, port: int, upstream: str) -> None:
    runner = web.AppRunner(build_app(upstream), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    print(f"ready http://{host}:{runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--upstream", required=True, help="base URL of a real built-in server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args(argv)
    try:
        asyncio.run(_serve(a.host, a.port, a.upstream))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
