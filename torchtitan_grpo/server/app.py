"""Built-in inference server: an HF model behind SGLang's HTTP protocol and
vLLM's OpenAI + weight-transfer subset, in one process.

    python -m torchtitan_grpo.server --model DIR --port 30000 \
        [--host 127.0.0.1] [--device cpu|cuda|cuda:N] [--dtype auto|float32|bfloat16|float16] \
        [--seed 0] [--max-batch-size 64] [--api-key KEY] [--weight-group-timeout 300] \
        [--num-threads N] [--chat-template FILE] [--trust-request-chat-template] \
        [--debug-update-delay-s X] [--debug-decode-delay-s S]

It is the embedded default backend and the stand-in for SGLang and vLLM in
tests, so the routes follow docs PROTOCOLS.md field by field (request names,
defaults, reply shapes, status codes). ``--port 0`` picks a free port; the
``ready http://HOST:PORT`` line on stdout says which.

This module is the process: command line, app assembly, error and API-key
middleware, serve until a signal. The routes live beside it, one concern per
module, each importing only from below (``httputil``, ``engine``):

* ``sglang_routes``: SGLang's ``/generate`` and health / info / abort routes;
* ``sglang_weights``: SGLang's weight-update session, groups, pause / continue;
* ``vllm_openai``: vLLM's ``/v1/completions`` and ``/v1/models``;
* ``vllm_chat`` (+ ``chat_template``): vLLM's ``/v1/chat/completions``;
* ``vllm_generate``: vLLM's native ``/generate`` body (atroposlib's ``vllm``
  handler), on SGLang's path;
* ``vllm_weights`` (+ ``packed_receive``): vLLM's weight transfer, pause / resume.

Generation and weight loading are :class:`Engine`'s, so both protocols serve
the same model and the same version. Weight updates are received during a
session (``/begin_weight_update`` .. ``/end_weight_update``, and vLLM's
``start`` .. ``finish``) and loaded as one version when it ends.

``--debug-update-delay-s X`` is a test knob: every weight-update handler of
either protocol sleeps X seconds after receiving, to play a slow replica in
fault tests and benchmarks. ``--debug-decode-delay-s S`` is its generation
twin: every decode step of the engine's batch takes S seconds longer.

Bounded requests (``httputil``): a body is refused with 413 past its route's
limit (``BodyLimits``: generation bodies sized from the context and batch,
weight metadata larger, control bodies small) before it is read, a text
prompt is refused by its length before it is tokenised, large bodies are
parsed off the event loop, and a body or field of the wrong type is a 400
naming it.

``--api-key KEY`` (or environment variable ``GRPO_API_KEY``, which keeps
it off the command line; the trainer starts its servers that way): every route but ``/health`` and ``/health_generate`` needs
``Authorization: Bearer KEY``, the vLLM routes included (see ``_middlewares``).
Without a key the server warns at start-up when it listens beyond loopback:
its weight routes load whatever they are sent.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import ipaddress
import logging
import os
import signal
import sys

from aiohttp import web

from torchtitan_grpo.models.chat_template import load_chat_template
from torchtitan_grpo.server.engine.engine import Engine, EngineConfig
from torchtitan_grpo.protocol.builtin import API_KEY_ENV
from torchtitan_grpo.server.httputil import OPEN_PATHS, BadRequest, BodyError, BodyLimits, Handler, authorized, read_json
from torchtitan_grpo.server.receive.delta import DeltaRoutes
from torchtitan_grpo.server.receive.lora import LoraRoutes
from torchtitan_grpo.server.engine.requests import ModelLoadError, RequestError
from torchtitan_grpo.server.settings import ServerConfig
from torchtitan_grpo.server.routes.sglang import SGLangGenerateRoutes
from torchtitan_grpo.server.routes.sglang_weights import SGLangWeightRoutes
from torchtitan_grpo.server.routes import logprob_json
from torchtitan_grpo.server.routes.vllm_chat import ChatRoutes
from torchtitan_grpo.server.routes.vllm_generate import VLLMGenerateRoute, is_vllm_generate_body
from torchtitan_grpo.server.vllm_http import PauseGate
from torchtitan_grpo.server.routes.vllm_openai import OpenAIRoutes
from torchtitan_grpo.server.routes.vllm_weights import VLLMWeightRoutes

__all__ = ["ServerConfig", "build_app", "engine_config", "exposure_warning", "main", "parse_args", "serve"]

logger = logging.getLogger("torchtitan_grpo.server")


# --------------------------------------------------------------------------- #
# App
# --------------------------------------------------------------------------- #


def _middlewares(cfg: ServerConfig) -> list:
    @web.middleware
    async def errors(request: web.Request, handler: Handler):
        try:
            return await handler(request)
        except (BadRequest, RequestError) as e:
            return web.json_response({"object": "error", "message": str(e)}, status=400)
        except BodyError as e:
            return web.json_response({"object": "error", "message": str(e)}, status=e.status)
        except web.HTTPException:  # aiohttp's own answers (404, 405, ...)
            raise
        except Exception as e:
            # A bug, not the client's fault; still a JSON answer naming it
            # rather than aiohttp's bare 500.
            logger.exception("%s %s failed", request.method, request.path)
            return web.json_response({"object": "error", "message": f"internal error: {type(e).__name__}: {e}"},
                                     status=500)

    @web.middleware
    async def auth(request: web.Request, handler: Handler):
        # Outermost: an unauthorized body is never read. Both protocols' routes
        # pass here (the vLLM ones too), so the key guards every weight route.
        if cfg.api_key and request.path not in OPEN_PATHS:
            if not authorized(request.headers.get("Authorization"), cfg.api_key):
                # Both SGLang and vLLM answer exactly this.
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return [auth, errors]



def build_app(engine: Engine, cfg: ServerConfig) -> tuple[web.Application, SGLangWeightRoutes]:
    """The app with both protocols' routes, and the routes whose ``close()``
    (weight groups, transfer thread) a caller runs at shutdown; the vLLM
    routes close with the app (``on_cleanup``)."""
    limits = BodyLimits.for_engine(engine.max_context, cfg.max_batch_size)
    # Each route reads at most its own limit (read_body); aiohttp's is the backstop.
    app = web.Application(client_max_size=limits.largest, middlewares=_middlewares(cfg))
    sglang = SGLangGenerateRoutes(engine, cfg, limits)
    sglang.register(app)
    weights = SGLangWeightRoutes(engine, cfg, limits)
    weights.register(app)
    gate = PauseGate(engine)  # vLLM's /pause, as its generation routes see it
    completions, chat = OpenAIRoutes(engine, cfg, gate, limits), ChatRoutes(engine, cfg, gate, limits)
    completions.register(app)
    chat.register(app)
    # LoRA adapters (both protocols' routes), merged on receive; vLLM's routes answer to their names
    LoraRoutes(engine, limits, [completions.served_names, chat.served_names]).register(app)
    DeltaRoutes(engine).register(app)  # weight_sync.delta: changed elements against the served version
    vllm_weights = VLLMWeightRoutes(engine, cfg, gate, limits)
    vllm_weights.register(app)
    vllm_generate = VLLMGenerateRoute(engine, gate, limits)

    async def generate(request: web.Request) -> web.StreamResponse:
        # One path, two protocols: SGLang's body (text / input_ids), or
        # vLLM's native one (prompt), which atroposlib's vLLM handler posts.
        raw, body = await read_json(request, limits.generate)
        if is_vllm_generate_body(body):
            return await vllm_generate.generate_body(request, raw, body)
        return await sglang.generate_body(request, raw, body)

    app.router.add_post("/generate", generate)
    app.router.add_put("/generate", generate)

    async def close_vllm(_app: web.Application) -> None:
        vllm_weights.close()

    app.on_cleanup.append(close_vllm)
    return app, weights


# --------------------------------------------------------------------------- #
# Process
# --------------------------------------------------------------------------- #


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_grpo.server",
        description="Built-in inference server (SGLang and vLLM HTTP protocols) for an HF causal LM.",
    )
    p.add_argument("--model", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--port", type=int, required=True, help="TCP port (0 = pick a free one)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    p.add_argument("--max-batch-size", type=int, default=64, help="most sequences decoded together")
    p.add_argument("--kv-cache", default="auto", choices=["auto", "static", "paged", "dynamic"],
                   help="static: preallocated KV slots, CUDA-graph decode (Llama/Qwen2/Qwen3/Mistral); paged: the "
                        "same decode on a pool of KV blocks sized by --kv-cache-memory-*, sequences retracted and "
                        "resumed when it runs out; dynamic: the HF forward on a growing cache (any model); auto "
                        "(default): on a GPU static when the model supports it and its slots fit the KV budget, "
                        "paged when they do not (or --kv-cache-memory-gb is given), else dynamic")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="static/paged cache: positions per sequence, prompt + output (vLLM's flag); 0 = the model's "
                        "context (static: at most 2048, as it takes max-batch-size x max-model-len positions up "
                        "front; paged: at most what the pool holds)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=0.0, metavar="GIB",
                   help="paged cache: the KV pool's size in GiB (default: by --kv-cache-memory-fraction)")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=0.0, metavar="F",
                   help="paged cache: the KV pool's share of the GPU memory free after the weights are loaded "
                        "(default 0.8, less one decode step's gathered KV)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="static cache on a GPU: launch the decode step's kernels one by one (debugging)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="record each decode step's tokens before launching the next (SGLang's flag; by default "
                        "a GPU engine launches step k+1 while the host records step k)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and /health_generate; "
                        f"without this flag the key is read from environment variable {API_KEY_ENV} when it is "
                        "set (a command line is visible to every user of the host in ps, the environment is not)")
    p.add_argument("--weight-group-timeout", type=float, default=300.0,
                   help="seconds to wait for the trainer to join a weight group / finish a broadcast")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--debug-update-delay-s", type=float, default=0.0,
                   help="TEST KNOB: sleep this long in every weight-update handler after receiving "
                        "(simulates a slow replica for fault tests and benchmarks)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="Jinja chat template (a file, or the template itself) for /v1/chat/completions, in place "
                        "of the tokenizer's own (vLLM's flag; needed when the tokenizer has none)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a 'chat_template' in /v1/chat/completions requests (vLLM refuses it without this)")
    p.add_argument("--debug-decode-delay-s", type=float, default=0.0, metavar="S",
                   help="DEBUG KNOB for benchmarks: the engine sleeps S seconds in every decode step of "
                        "its batch, so this replica generates more slowly than its peers (default 0: off)")
    p.add_argument("--admission-window-ms", type=float, default=40.0, metavar="MS",
                   help="an idle engine admits a burst of requests as one prefill: the first waits until none has "
                        "come for 5 ms, at most MS after it came (default 40; 0: admit each at once)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="MoE models: capture each MoE layer's routed experts per position, returned to requests "
                        "with 'return_routed_experts' (SGLang's and vLLM's flag)")
    a = p.parse_args(argv)
    if a.max_batch_size < 1:
        p.error("--max-batch-size must be >= 1")
    if a.max_model_len < 0 or a.max_model_len == 1:
        p.error("--max-model-len must be 0 (the model's context, at most 2048) or >= 2")
    if not a.kv_cache_memory_gb >= 0:
        p.error("--kv-cache-memory-gb must be >= 0")
    if not 0 <= a.kv_cache_memory_fraction < 1:
        p.error("--kv-cache-memory-fraction must be in [0, 1)")
    if a.debug_update_delay_s < 0:
        p.error("--debug-update-delay-s must be >= 0")
    if not 0 <= a.admission_window_ms <= 1000:  # (NaN too)
        p.error(f"--admission-window-ms must be in [0, 1000], got {a.admission_window_ms}")
    if not a.debug_decode_delay_s >= 0:  # (NaN too)
        p.error("--debug-decode-delay-s must be >= 0")
    if not a.device.startswith(("cpu", "cuda")):
        p.error(f"--device must be cpu, cuda or cuda:N, got {a.device!r}")
    try:
        chat_template = load_chat_template(a.chat_template)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        p.error(str(e) if isinstance(e, ValueError) else f"--chat-template {a.chat_template!r}: {e}")
    return ServerConfig(
        model=a.model, host=a.host, port=a.port, device=a.device, dtype=a.dtype, seed=a.seed,
        max_batch_size=a.max_batch_size, kv_cache=a.kv_cache, max_model_len=a.max_model_len,
        kv_cache_memory_gb=a.kv_cache_memory_gb, kv_cache_memory_fraction=a.kv_cache_memory_fraction,
        cuda_graphs=not a.no_cuda_graphs, overlap_schedule=not a.disable_overlap_schedule,
        api_key=a.api_key or os.environ.get(API_KEY_ENV) or None,
        weight_group_timeout_s=a.weight_group_timeout, num_threads=a.num_threads,
        debug_update_delay_s=a.debug_update_delay_s, debug_decode_delay_s=a.debug_decode_delay_s,
        chat_template=chat_template, trust_request_chat_template=a.trust_request_chat_template,
        enable_return_routed_experts=a.enable_return_routed_experts, admission_window_ms=a.admission_window_ms,
    )


def engine_config(cfg: ServerConfig) -> EngineConfig:
    return EngineConfig(cfg.model, cfg.device, cfg.dtype, cfg.seed, cfg.max_batch_size,
                        kv_cache=cfg.kv_cache, max_model_len=cfg.max_model_len, cuda_graphs=cfg.cuda_graphs,
                        kv_cache_memory_gb=cfg.kv_cache_memory_gb,
                        kv_cache_memory_fraction=cfg.kv_cache_memory_fraction,
                        overlap_schedule=None if cfg.overlap_schedule else False,
                        debug_decode_delay_s=cfg.debug_decode_delay_s,
                        return_routed_experts=cfg.enable_return_routed_experts,
                        admission_window_ms=cfg.admission_window_ms)


def exposure_warning(cfg: ServerConfig) -> str | None:
    """What to warn about when the server listens beyond this host without an
    API key (None when it does not): anyone who can reach the port can
    generate, and the weight routes load whatever weights they are sent."""
    if cfg.api_key or _is_loopback(cfg.host):
        return None
    return (f"the server listens on {cfg.host} WITHOUT --api-key: anyone who can reach this port "
            "can generate, pause generation and replace the model's weights (the update routes load whatever "
            "they are sent, from the network, from a path on this host, or from shared memory). Bind to "
            "127.0.0.1 or start it with --api-key KEY.")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


async def serve(engine: Engine, cfg: ServerConfig) -> None:
    """Serve until SIGINT/SIGTERM."""
    app, routes = build_app(engine, cfg)
    logprob_json.prepare(engine)  # every token's reply pieces, before any request (not in a thread)
    # What start-up left (torch, transformers, the model's modules, the tokenizer: ~430k tracked
    # objects) lives as long as the server; out of the collector's sight, a full pass walks only
    # what came later. Run 154 (an H200 host): full passes of ~300 ms stalled the event loop and
    # the worker mid-burst, splitting a burst's prefill in two.
    gc.collect()
    gc.freeze()
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else cfg.port
    warning = exposure_warning(cfg)
    if warning:
        logger.warning("%s\n!!! %s\n%s", "!" * 100, warning, "!" * 100)
    # Before "ready": a supervisor may stop the server as soon as it reads it.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # A failed device ends the engine's worker: exit (main's code 4) so a supervisor restarts us
    # rather than serve health checks from a process that can no longer compute.
    engine.on_fatal = lambda _e: loop.call_soon_threadsafe(stop.set)
    logger.info("ready: model %s on http://%s:%d (device %s)", cfg.model, cfg.host, port, engine.device)
    print(f"ready http://{cfg.host}:{port}", flush=True)
    await stop.wait()
    if engine.worker_error is not None:
        print(f"error: the device failed ({str(engine.worker_error).splitlines()[0][:200]}); exiting so that a "
              "supervisor restarts the server", file=sys.stderr, flush=True)
    logger.info("shutting down")
    engine.shutdown()
    routes.close()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=os.environ.get("LOGLEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    import torch

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    try:
        engine = Engine(engine_config(cfg))
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    engine.start()
    code = 0
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(serve(engine, cfg))
    except OSError as e:  # port in use, bad host
        print(f"error: cannot listen on {cfg.host}:{cfg.port}: {e}", file=sys.stderr, flush=True)
        engine.shutdown()
        code = 3
    if engine.worker_error is not None:
        code = 4
    # A thread may still sit in a collective (a trainer that vanished mid-push)
    # or in a rendezvous; waiting for it would hang shutdown until its timeout.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

