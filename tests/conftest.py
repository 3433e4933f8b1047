import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The demo's tiny random Qwen3 + char tokenizer, written once per session."""
    from torchtitan_grpo.demo_assets import ensure_tiny_qwen3

    return ensure_tiny_qwen3(str(tmp_path_factory.mktemp("models") / "tiny-qwen3"))


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return tiny_model_dir


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """One built-in server per test module (SGLang and vLLM routes), stopped cleanly after it."""
    from tests.server_procs import start_server, stop_server

    log = tmp_path_factory.mktemp("logs") / "server.log"
    proc, url = start_server(model_dir, log)
    yield url
    stop_server(proc, log)


@pytest.fixture(scope="session")
def generating_server(tiny_model_dir, tmp_path_factory):
    """One built-in server, started once per session, for the test files that
    only generate from it (no weight push, no pause): their module's
    ``server`` is this one instead of one more server start each. It serves
    its own copy of the tiny model, so tests that look for leftover servers
    of ``tiny_model_dir`` do not see it; stopped cleanly at the end."""
    import shutil

    from tests.server_procs import start_server, stop_server

    root = tmp_path_factory.mktemp("generating")
    model = str(shutil.copytree(tiny_model_dir, root / "tiny-qwen3"))
    proc, url = start_server(model, root / "server.log")
    yield url
    stop_server(proc, root / "server.log")
