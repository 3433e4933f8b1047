"""Start and stop a built-in server subprocess for tests (shared by the
SGLang- and vLLM-route test files)."""

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHAT_TEMPLATE = (
    "{%- for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
"""A chat template in the tiny model's character vocabulary (printable ASCII,
no newline), for tests: the demo tokenizer has none of its own."""


def write_chat_template(path: Path) -> Path:
    """:data:`CHAT_TEMPLATE` as a file (for ``--chat-template``)."""
    path.write_text(CHAT_TEMPLATE)
    return path


def model_with_chat_template(model_dir: str, dest: Path) -> str:
    """A copy of ``model_dir`` whose tokenizer has :data:`CHAT_TEMPLATE` as
    its own (``chat_template.jinja``, what transformers saves and loads)."""
    import shutil

    shutil.copytree(model_dir, dest)
    write_chat_template(dest / "chat_template.jinja")
    return str(dest)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def start_server(model_dir: str, log: Path, *extra: str, timeout: float = 90) -> tuple[subprocess.Popen, str]:
    """Start on a port the server picks itself; return once it printed its URL
    (``timeout``: a hang guard; benchmarks loading large models raise it)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_grpo.server", "--model", model_dir, "--port", "0",
         "--num-threads", "1", *extra],
        stdout=subprocess.PIPE, stderr=open(log, "wb"), env=server_env(), cwd=REPO,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline().decode()
            if line.startswith("ready http://"):
                return proc, line.split()[1].strip()
        if proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"server did not start:\n{log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen, log: Path) -> None:
    """SIGTERM; the server must exit cleanly (code 0)."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    assert proc.returncode == 0, log.read_text()[-3000:]


def http_json(url: str, data: bytes | None, method: str, timeout: float) -> tuple[int, object]:
    """One JSON request: (status, parsed body or None), HTTP errors included."""
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, payload = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    return status, (json.loads(payload) if payload else None)


@contextlib.contextmanager
def in_process_server(args: list[str], engine_hook=None):
    """The built-in server in this process: the engine parsed from ``args``
    (the server's own command line), its app on an event loop in a thread.
    Yields ``(url, engine)``; ``engine_hook(engine)`` runs before the engine
    starts (a test's stand-ins). No subprocess to wait for."""
    import asyncio
    import threading

    from aiohttp import web

    from torchtitan_grpo.server.engine.engine import Engine
    from torchtitan_grpo.server.app import build_app, engine_config, parse_args

    cfg = parse_args(args)
    engine = Engine(engine_config(cfg))
    if engine_hook is not None:
        engine_hook(engine)
    engine.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="in-process-server", daemon=True)
    thread.start()

    async def start():
        app, routes = build_app(engine, cfg)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner, routes

    runner, routes = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=60)
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", engine
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=60)
        engine.shutdown()
        routes.close()
