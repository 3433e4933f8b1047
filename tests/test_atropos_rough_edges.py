"""Issue 37's rough edges of the Atropos recipe, each without real processes
where an in-process stand-in does: atroposlib's own API app served from a
thread of this process (its real routes, state cleared per test), the example
environment's start-up checks, the trainer's stale replica file, and the
import layering of the rollout and inference modules."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import logging
import math
import sys
import threading
from pathlib import Path

import pytest

from tests.server_procs import free_port
from tests.test_atropos import AtroposAPI, Pull, _load_example_env, make_source, wait_until
from tests.test_atropos_groups import multi_turn_group, own_advantage_group

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "torchtitan_grpo"


# ------------------------------------------------------------------ layering


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function-level imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_atropos_modules_do_not_import_the_trainer():
    """The rollout side does not import the trainer: Sample comes from train/sample.py."""
    for name in ("atropos.py", "atropos_groups.py", "atropos_batch.py", "atropos_hints.py"):
        imported = _imported_modules(PKG / "rollout" / name)
        assert "torchtitan_grpo.train.trainer" not in imported and not any(
            m.startswith("torchtitan_grpo.train.trainer.") for m in imported), name
    for name in ("atropos_groups.py", "atropos_batch.py"):
        assert "torchtitan_grpo.train.sample.Sample" in _imported_modules(PKG / "rollout" / name), name


def test_the_kv_batches_do_not_import_each_other():
    batch = _imported_modules(PKG / "server/engine/batch.py")
    static = _imported_modules(PKG / "server/engine/static_batch.py")
    batch_uses_static = any(m.startswith("torchtitan_grpo.server.engine.static_batch") for m in batch)
    static_uses_batch = any(m == "torchtitan_grpo.server.engine.batch" or m.startswith("torchtitan_grpo.server.engine.batch.")
                            for m in static)
    assert not (batch_uses_static and static_uses_batch), "server/engine/batch.py and server/engine/static_batch.py import each other"


# ------------------------------------------------------------------ atroposlib's API, in this process


@pytest.fixture(scope="module")
def _served_api():
    """atroposlib's FastAPI app under uvicorn on a thread of this process (no
    signal handlers off the main thread): its real routes without a process start."""
    pytest.importorskip("atroposlib")
    import uvicorn
    from atroposlib.api.server import app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, name="atropos-api", daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout=30, what="the in-process Atropos API")
    yield app, port
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture
def api(_served_api, tmp_path) -> AtroposAPI:
    """A fresh API for each test: atroposlib keeps everything in ``app.state``."""
    app, port = _served_api
    app.state._state.clear()
    return AtroposAPI(port, tmp_path / "unused.log")


def _lines(caplog, start: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(start)]


def _registered(api: AtroposAPI, batch_size: int):
    return lambda: api.call("GET", "/info")["batch_size"] == batch_size


def test_a_long_wait_says_what_the_api_knows_of_environments(api, caplog):
    """The API answers but no batch comes: after startup_timeout_s one line
    says why (no environment registered / none posted / short of a batch),
    again every as long, and the trainer keeps waiting."""
    caplog.set_level(logging.INFO, logger="torchtitan_grpo")
    src = make_source(api.url, batch_size=8, startup_timeout_s=0.3, log_every_s=0.1)
    stop = threading.Event()
    p = Pull(src, stop)
    hints = lambda: _lines(caplog, "no batch from Atropos")  # noqa: E731

    wait_until(lambda: hints(), timeout=20, what="the first hint")
    first = hints()[0]
    assert api.url in first and "no environment has registered" in first and "still waiting" in first
    reply = api.call("POST", "/register-env", {"max_token_length": 64, "desired_name": "digits", "weight": 1.0,
                                               "group_size": 2})
    assert reply["status"] == "success"
    n = len(hints())
    wait_until(lambda: len(hints()) > n and "registered but none has posted" in hints()[-1], timeout=20,
               what="the hint after a registration")
    api.post_group(own_advantage_group())  # 2 of the 8 sequences of a batch
    n = len(hints())
    wait_until(lambda: len(hints()) > n and "groups have been posted (1 queued" in hints()[-1], timeout=20,
               what="the hint after a post")
    assert "a batch takes 8 sequences" in hints()[-1]
    assert p.t.is_alive()  # still waiting
    stop.set()
    assert p.get() is None
    src.close()


def _nan_group() -> dict:
    g = own_advantage_group()
    g["scores"] = [math.nan, 0.5]  # json.dumps writes NaN; atroposlib takes it and then cannot encode its batch
    return g


def test_a_batch_the_api_lost_to_a_nan_score_is_named(api, caplog):
    caplog.set_level(logging.INFO, logger="torchtitan_grpo")
    src = make_source(api.url, batch_size=2)
    p = Pull(src)
    wait_until(_registered(api, 2), what="registration")
    lost = lambda: [m for m in _lines(caplog, "Atropos API at") if "lost that batch" in m]  # noqa: E731
    api.post_group(_nan_group())
    wait_until(lambda: lost(), timeout=15, what="the lost-batch line")
    api.post_group(own_advantage_group())
    batch = p.get()
    assert len(batch.samples) == 2 and batch.metrics["atropos/lost_batches"] == 1
    (line,) = _lines(caplog, "Atropos API at")  # that line only: no outage, no re-registration
    assert api.url in line and "/batch" in line and "HTTP 500" in line and "non-finite score" in line
    assert src.reregistrations == 0

    api.post_group(_nan_group())  # now the prefetch thread meets it
    wait_until(lambda: len(lost()) == 2, timeout=15, what="the lost-batch line, prefetching")
    api.post_group(own_advantage_group())
    assert len(Pull(src).get().samples) == 2
    assert len(_lines(caplog, "Atropos API at")) == 2 and src.lost_batches == 2 and src.reregistrations == 0
    src.close()


def test_a_batch_with_no_trainable_group_is_skipped_with_its_reason(api, caplog):
    """Every group of a batch dropped: no empty batch (a NaN loss and a new
    version) reaches the trainer; one line says how many groups and why, and
    the next batch is trained."""
    caplog.set_level(logging.WARNING, logger="torchtitan_grpo")
    src = make_source(api.url, batch_size=4, vocab_size=32)
    p = Pull(src)
    wait_until(_registered(api, 4), what="registration")
    bad_shape = multi_turn_group()
    bad_shape["masks"][0].pop()
    too_long = multi_turn_group()
    too_long["tokens"][1] = [1] * 70
    too_long["masks"][1] = [-100] * 68 + [1, 1]
    too_long["inference_logprobs"][1] = [1.0] * 68 + [-0.1, -0.1]
    api.post_group(bad_shape)
    api.post_group(too_long)
    wait_until(lambda: _lines(caplog, "skipped an Atropos batch") or not p.t.is_alive(), timeout=15,
               what="the skipped batch")
    api.post_group(multi_turn_group())
    api.post_group(multi_turn_group())
    batch = p.get()
    assert len(batch.samples) == 4 and batch.metrics["atropos/dropped_groups"] == 0
    assert batch.metrics["atropos/skipped_batches"] == 1 and batch.indices == [2, 3]
    assert src.skipped_batches == 1 and src.step == 2 == api.call("GET", "/status")["current_step"]
    (line,) = _lines(caplog, "skipped an Atropos batch")
    assert "none of its 2 groups" in line and "1 shape" in line and "1 too_long" in line and "no step taken" in line
    assert src.dropped["shape"] == 1 and src.dropped["too_long"] == 1
    src.close()


def test_a_batch_of_constant_groups_filtered_out_is_skipped(api, caplog):
    caplog.set_level(logging.WARNING, logger="torchtitan_grpo")
    src = make_source(api.url, batch_size=2, filter_constant_groups=True, prefetch=False)
    p = Pull(src)
    wait_until(_registered(api, 2), what="registration")
    constant = multi_turn_group()
    constant["scores"] = [1.0, 1.0]
    api.post_group(constant)
    wait_until(lambda: _lines(caplog, "skipped an Atropos batch") or not p.t.is_alive(), timeout=15,
               what="the skipped batch")
    api.post_group(multi_turn_group())
    assert len(p.get().samples) == 2
    (line,) = _lines(caplog, "skipped an Atropos batch")
    assert "none of its 1 groups" in line and "1 constant (grpo.filter_constant_groups)" in line
    src.close()


# ------------------------------------------------------------------ the example environment


@pytest.fixture(scope="module")
def example_env():
    return _load_example_env()


@pytest.mark.parametrize("missing", ["tokenizer", "replica_file"])
def test_the_example_env_started_before_the_trainer_says_so_in_one_line(example_env, tiny_model_dir, tmp_path,
                                                                        monkeypatch, capsys, missing):
    """Through atroposlib's own CLI: the model (or the server list) the
    trainer writes is not there yet; one line naming the flag, exit 2."""
    model = str(tmp_path / "tiny-qwen3") if missing == "tokenizer" else tiny_model_dir
    replicas = tmp_path / "atropos_demo" / "servers" / "replicas.txt"
    monkeypatch.setattr(sys, "argv", ["digits_env.py", "serve", "--env.tokenizer_name", model,
                                      "--env.replica_file", str(replicas), "--env.use_wandb", "false"])

    async def started(self):  # without the check the environment would run (and wait for the file)
        raise AssertionError("the environment started")

    monkeypatch.setattr(example_env.DigitsTwoTurnEnv, "env_manager", started)
    with pytest.raises(SystemExit) as e:
        example_env.DigitsTwoTurnEnv.cli()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "start the trainer first" in err[0], err
    assert ("--env.tokenizer_name" if missing == "tokenizer" else str(replicas)) in err[0]


def test_the_example_env_started_while_the_atropos_api_is_down_says_so_in_one_line(example_env, tiny_model_dir,
                                                                                   tmp_path, monkeypatch, capsys):
    """Through atroposlib's own CLI, the trainer's files in place but nothing
    listening at --env.rollout_server_url: one line naming the URL and the
    flag, exit 2; not atroposlib's three retries and chained tracebacks."""
    replicas = tmp_path / "replicas.txt"
    replicas.write_text("http://127.0.0.1:1\n")
    api = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("DIGITS_MODEL", tiny_model_dir)  # the servers' model name, tokenizer of it loaded
    monkeypatch.setattr(sys, "argv", ["digits_env.py", "serve", "--env.tokenizer_name", tiny_model_dir,
                                      "--env.replica_file", str(replicas), "--env.use_wandb", "false",
                                      "--env.rollout_server_url", api])

    async def servers_up(self):  # the trainer's servers are up (not what this test is about)
        return None

    monkeypatch.setattr(example_env.DigitsTwoTurnEnv, "setup", servers_up)
    with pytest.raises(SystemExit) as e:
        example_env.DigitsTwoTurnEnv.cli()
    assert e.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and api in err[0] and "--env.rollout_server_url" in err[0], err
    assert "Error registering env" not in captured.out + captured.err


def test_the_example_env_reports_a_replica_url_that_refuses_connections(example_env, tmp_path, caplog):
    """A replica file left by an earlier run: its URL refuses connections; one
    line names the file and the URL (once, however often it is read), and the
    environment takes the servers only once the file lists live ones."""
    caplog.set_level(logging.WARNING, logger="digits_env")
    path = tmp_path / "replicas.txt"
    dead = f"http://127.0.0.1:{free_port()}"
    path.write_text(dead + "\n")

    async def scenario() -> list[str]:
        live_server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        live = f"http://127.0.0.1:{live_server.sockets[0].getsockname()[1]}"
        task = asyncio.create_task(example_env.DigitsTwoTurnEnv._wait_for_replicas(str(path), timeout_s=60,
                                                                                   poll_s=0.05))
        for _ in range(400):  # a hang guard only
            if task.done() or any("refuses connections" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # several more reads of the same file
        path.write_text(live + "\n")  # the trainer's servers are up
        urls = await asyncio.wait_for(task, 60)
        live_server.close()
        return urls, live

    urls, live = asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records if "refuses connections" in r.getMessage()]
    assert len(lines) == 1 and str(path) in lines[0] and dead in lines[0]
    assert urls == [live]


def test_the_example_env_drops_a_group_with_a_non_finite_score(example_env, tiny_model_dir, monkeypatch):
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig

    env_cfg, _ = example_env.DigitsTwoTurnEnv.config_init()
    env_cfg = env_cfg.model_copy(update={"tokenizer_name": tiny_model_dir, "group_size": 2})
    server_cfg = APIServerConfig(model_name=tiny_model_dir, base_url=f"http://127.0.0.1:{free_port()}/v1",
                                 api_key="x", server_type="sglang", health_check=False, timeout=5)
    env = example_env.DigitsTwoTurnEnv(env_cfg, [server_cfg])
    answer = env.tokenizer.encode("0", add_special_tokens=False)

    async def generate(input_ids, n):  # stands in for the inference server
        k = n if input_ids and isinstance(input_ids[0], int) else len(input_ids)
        return [(answer, [-0.5] * len(answer), "stop")] * k

    monkeypatch.setattr(env, "_generate", generate)
    item = {"prompt": "3>", "answer": "0"}
    group, _ = asyncio.run(env.collect_trajectories(item))
    assert group is not None and len(group["scores"]) == 2  # finite scores are posted
    monkeypatch.setattr(example_env, "digits_reward", lambda *a: math.nan)
    group, backlog = asyncio.run(env.collect_trajectories(item))
    assert group is None and backlog == []


# ------------------------------------------------------------------ the trainer's replica file


def test_the_trainer_removes_a_stale_replica_file_before_its_servers_start(tmp_path, tiny_model_dir, monkeypatch):
    """An earlier run's servers/replicas.txt would send an environment started
    now to dead servers: it is gone before the trainer starts its own."""
    from torchtitan_grpo import session
    from torchtitan_grpo.config.parse import parse_config

    cfg = parse_config(["--job.config_file", str(REPO / "train_configs" / "demo_cpu.toml"),
                        "--job.dump_folder", str(tmp_path), "--model.hf_assets_path", tiny_model_dir,
                        "--rollout.source", "atropos"])
    stale = tmp_path / "servers" / "replicas.txt"
    stale.parent.mkdir()
    stale.write_text(f"http://127.0.0.1:{free_port()}\n")
    seen = []

    class Started(Exception):
        pass

    @contextlib.contextmanager
    def servers(*args, **kwargs):
        seen.append(stale.exists())
        raise Started  # the test ends where the servers would start
        yield

    monkeypatch.setattr(session, "running_servers", servers)
    with pytest.raises(Started), session.rollout_side(cfg, tiny_model_dir, None):
        pass
    assert seen == [False]
