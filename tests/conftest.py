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


@pytest.fixture(scope="session")
def multirank_launched(request, tmp_path_factory, worker_id):
    """tests/multirank.py's launches, run once per test *run*: under xdist
    test_parallel_parity, test_gather and multirank.EXTRAS usually land on
    different workers (processes), and each would pay every torchrun launch
    again. The first worker to ask runs them into the run's shared temp
    folder under a file lock; the other waits on the lock and reads the
    results. Only the parts of the files this run collected are launched
    (every xdist worker collects the same items)."""
    import fcntl
    import pickle

    from tests import multirank

    if "launched" in multirank._SESSION:
        return multirank._SESSION["launched"]
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent  # popen-gwN's parent is the run's own folder
    done = shared / "multirank-launched.pkl"
    with open(shared / "multirank.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held for the launches (minutes); the other worker waits here
        if done.exists():
            multirank._SESSION["launched"] = pickle.loads(done.read_bytes())
        else:
            class _Shared:  # multirank.shared's results under the run's folder, not this worker's
                @staticmethod
                def mktemp(name):
                    path = shared / name
                    path.mkdir()
                    return path

            files = {os.path.splitext(os.path.basename(str(item.fspath)))[0] for item in request.session.items}
            launched = multirank.shared(_Shared, files)
            done.write_bytes(pickle.dumps(launched))
    return multirank._SESSION["launched"]

