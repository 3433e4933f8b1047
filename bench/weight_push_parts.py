"""The parts of bench/weight_push.py that stand in for a replica or watch
the push: ``TensorEngine`` (the model behind the built-in server's real
SGLang and vLLM routes, served by ``serve_routes``) and the ``--trace``
timeline (``Trace``, the wrappers ``start_trace`` installs in one process,
``print_trace``). The measurement and its table stay in weight_push.py.

The wrappers are installed by the bench only; the product code has no
tracing in it.
"""

from __future__ import annotations

import time

import torch

from torchtitan_grpo.server.engine.engine import Engine
from torchtitan_grpo.server.engine.weights import install_weights
from torchtitan_grpo.weight_sync import buckets as bk


# -------------------------------------------------------------- the replica stand-in


class TensorEngine:
    """What the built-in server's weight-update routes (SGLang and vLLM) need
    of an ``Engine``: named parameters (real names, shapes, dtype), the same
    all-or-nothing checks and ``install_weights`` as ``Engine.load_weights``,
    pause/resume, and a served version. Generation never runs."""

    tokenizer = None
    max_context = 4096  # sizes the server's generation body limit (never used here)
    static_cache = False  # no captured graphs read the parameters: received buffers may become them

    def __init__(self, params: dict[str, torch.Tensor], device: torch.device):
        from types import SimpleNamespace

        self.device = device
        self._tensors = params
        self.weight_version = "default"
        self.paused = None
        self.alive = True
        # what the routes read off a model at start-up (the LoRA and delta receivers: names -> tensors)
        self.model = SimpleNamespace(config=SimpleNamespace(model_type="qwen3"),
                                     parameters=lambda: iter(params.values()),
                                     state_dict=lambda keep_vars=False: dict(params),
                                     named_modules=lambda: iter(()))

    check_weights = Engine.check_weights  # they read only ``_tensors`` (name -> parameter)
    check_received = Engine.check_received

    def load_weights(self, named, weight_version: str | None = None, checked: bool = False, adopt=None) -> None:
        if not checked:
            self.check_weights([bk.TensorSpec.of(n, t) for n, t in named])
        install_weights(self._tensors, named, adopt)
        if weight_version is not None:
            self.weight_version = weight_version

    def set_weight_version(self, version: str) -> None:
        self.weight_version = version

    def pause(self, mode: str = "abort") -> int:
        self.paused = mode
        return 0

    def resume(self) -> None:
        self.paused = None

    def abort_all(self, message: str = "") -> int:
        return 0

    def num_live_requests(self) -> int:
        return 0


async def serve_routes(engine: TensorEngine, device: torch.device):
    """The built-in server's app (SGLang and vLLM routes) over ``engine`` on a free port."""
    from aiohttp import web

    from torchtitan_grpo.server.app import ServerConfig, build_app

    app, _ = build_app(engine, ServerConfig(model="bench-stand-in", device=str(device), port=0,
                                            weight_group_timeout_s=120))
    if TRACE is not None:
        _trace_replica(app, engine)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


# ---------------------------------------------------------------------- tracing


class Trace:
    """(label, start, end) of wrapped calls, in ``time.perf_counter`` seconds."""

    def __init__(self):
        self.events: list[tuple[str, float, float]] = []

    def add(self, label: str, t0: float) -> None:
        self.events.append((label, t0, time.perf_counter()))

    def wrap(self, owner, attr: str, label, only_if=None) -> None:
        """Replace ``owner.attr`` (a function, sync or async) with a timed
        wrapper; ``label(*args)`` names each call; ``only_if(result)``: which
        calls of a sync function to record."""
        import functools
        import inspect

        fn = inspect.getattr_static(owner, attr)
        static = isinstance(fn, staticmethod)
        if static:
            fn = fn.__func__
        elif not inspect.isclass(owner) and not inspect.ismodule(owner):
            fn = getattr(owner, attr)  # an instance: its bound method
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def timed(*a, **k):
                t0 = time.perf_counter()
                try:
                    return await fn(*a, **k)
                finally:
                    self.add(label(*a), t0)
        else:
            @functools.wraps(fn)
            def timed(*a, **k):
                t0 = time.perf_counter()
                out = None
                try:
                    out = fn(*a, **k)
                    return out
                finally:
                    if only_if is None or only_if(out):
                        self.add(label(*a), t0)
        setattr(owner, attr, staticmethod(timed) if static else timed)


TRACE: Trace | None = None
"""This process's trace, once ``start_trace`` ran (``--trace``); read it as
``weight_push_parts.TRACE``, not imported by name (it is rebound)."""


def start_trace(rank: int) -> Trace:
    """Set up ``TRACE`` and wrap this process's side: rank 0 the trainer's
    HTTP and broadcasts, rank 1 the replica's receives (its routes and
    install are wrapped per app, by ``serve_routes``)."""
    global TRACE
    TRACE = Trace()
    if rank == 0:
        _trace_trainer()
    else:
        _trace_replica_receives()
    return TRACE


def _trace_trainer() -> None:
    from torchtitan_grpo.weight_sync import control, group_push

    TRACE.wrap(control, "post", lambda session, url, *a: "trainer POST " + url.split("/", 3)[-1])
    real_pipelined = control.PipelinedConnection.post

    def pipelined(conn, path, body, params=None):  # from its write to its reply
        t0 = time.perf_counter()
        fut = real_pipelined(conn, path, body, params)
        fut.add_done_callback(lambda f: TRACE.add("trainer POST (pipelined) " + path.lstrip("/"), t0))
        return fut

    control.PipelinedConnection.post = pipelined
    TRACE.wrap(group_push.GroupPush, "broadcast_all",
               lambda r, staged, ks, stop, wait=True:
               f"trainer broadcast x{len(ks)} ({sum(staged.buffers[k].numel() for k in ks) >> 20} MiB)")


def _trace_replica_receives() -> None:
    from torchtitan_grpo.server.receive import packed as packed_receive
    from torchtitan_grpo.server.routes import sglang_weights, vllm_weights
    from torchtitan_grpo.server.engine import weights

    # The routes post the receives and answer; the session's end waits for the bytes.
    TRACE.wrap(sglang_weights, "post_receive", lambda group, specs, *a: f"replica post receive ({len(specs)} tensors)")
    TRACE.wrap(packed_receive, "post_packed", lambda group, specs, *a: f"replica post packed ({len(specs)} tensors)")
    TRACE.wrap(weights.PostedReceive, "wait", lambda p: f"replica wait for the bytes ({len(p.named)} tensors)")
    # A session's end: the waits and the install inside, on the transfer thread.
    TRACE.wrap(weights.PendingVersion, "load", lambda p, *a: f"replica load session ({len(p.parts)} updates)")
    # A route's hop to the transfer thread and back, around what it runs there
    for routes in (sglang_weights.SGLangWeightRoutes, vllm_weights.VLLMWeightRoutes):
        TRACE.wrap(routes, "_run", lambda self, fn, *a: f"replica transfer-thread call {fn.__name__}")
    # ?ack=posted: the views cut after the reply (the calls that found nothing to cut are left out)
    TRACE.wrap(weights.PostedReceive, "cut_views", lambda p: f"replica cut views ({len(p.named)} tensors)",
               only_if=bool)


def _trace_replica(app, engine: "TensorEngine") -> None:
    """The routes and the install of one app (the receives are wrapped once per process)."""
    from aiohttp import web

    TRACE.wrap(engine, "load_weights", lambda named, *a: f"replica install ({len(named)} tensors)")

    @web.middleware
    async def timed(request, handler):
        t0 = time.perf_counter()
        try:
            return await handler(request)
        finally:
            TRACE.add("replica route " + request.path.lstrip("/"), t0)

    app.middlewares.insert(0, timed)


def print_trace(title: str, t0: float, events: list[tuple[str, float, float]]) -> None:
    print(f"trace: {title}: ms from the start of push()")
    for label, a, b in sorted(events, key=lambda e: e[1]):
        print(f"trace:   {(a - t0) * 1e3:8.2f} {(b - t0) * 1e3:8.2f} {(b - a) * 1e3:7.2f}  {label}")
