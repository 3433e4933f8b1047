import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The demo's tiny random Qwen3 + char tokenizer, written once per session."""
    from torchtitan_grpo.models.demo_assets import ensure_tiny_qwen3

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

            launched = multirank.shared(_Shared, multirank.session_files(request.session))
            done.write_bytes(pickle.dumps(launched))
    return multirank._SESSION["launched"]


# Test files by their measured wall seconds, slowest first (a loaded suite
# run on 2 cores, 2026-11-27): under `--dist loadfile` each file is one unit
# of work, handed to whichever worker runs low. xdist's default queue is
# ordered by test count, which put the slowest files (few tests each, minutes
# of processes: test_atropos_e2e, test_faults, test_e2e) last, so one worker
# ran them alone at the end. Slowest first, the short files fill the gaps at
# the end instead. Files not named keep their collection order after these.
SLOWEST_FIRST = (
    "test_bench_scripts",    # ~260 s
    "test_parallel_parity",  # the shared multirank launch (~160 s) starts early
    "test_pusher",           # ~150 s
    "test_e2e",              # ~110 s
    "test_atropos_e2e",      # ~100 s
    "test_slurm",            # ~75 s
    "test_faults",           # ~130 s on 2026-11-29 (test_rough_edges' real-process run is in it now)
    "test_moe_e2e",          # ~55 s
    "test_client_process",   # ~55 s
    "test_hf_mapping",
    "test_fanout",
    "test_resume",
    "test_config",
    "test_eval",
    "test_launcher",
    "test_delta_push",
    "test_lora_push",
    "test_pool",
    "test_vllm_protocol",
)


def pytest_configure(config):
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False  # keep the order below, not xdist's by test count


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    # stable: each file's tests keep their order (module fixtures), other files theirs
    items.sort(key=lambda item: rank.get(os.path.splitext(os.path.basename(str(item.fspath)))[0], len(rank)))
