"""End to end over real processes: torchrun with 2 ranks, built-in servers on
localhost, real HTTP and real gloo weight pushes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import requests
import torch

from tests.conftest import ROOT

DEMO = os.path.join(ROOT, "train_configs", "demo_cpu.toml")
pytestmark = pytest.mark.slow


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")


def _torchrun(nproc: int, *args: str, timeout: float = 600, cwd: str = ROOT, **kw) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "grpo_train.py"), "--job.config_file", DEMO, *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=_env(), timeout=timeout, **kw)


def _metrics(dump: str) -> list[dict]:
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _steps_logged(dump: str) -> int:
    """Complete lines in metrics.jsonl (0 before the first step)."""
    try:
        with open(os.path.join(dump, "metrics.jsonl")) as f:
            return sum(line.endswith("\n") for line in f)
    except FileNotFoundError:
        return 0


def _servers_alive(model_dir: str) -> list[str]:
    """Command lines of built-in servers still running for this model dir."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()
            if "torchtitan_grpo.server" in line and model_dir in line]


def test_two_ranks_fsdp_sync_push_on_policy(tmp_path, tiny_model_dir):
    """2 trainer ranks (FSDP over gloo), 2 built-in servers, sync pushes: after
    each push the servers generate with exactly the trainer's weights, so the
    trainer's logprobs of the sampled tokens equal the servers' (fp32). The
    rollout client runs in its own process (off by default when serial): the
    serial loop stays exactly on-policy across that boundary too."""
    dump = str(tmp_path / "run")
    r = _torchrun(2, "--training.steps", "3", "--job.dump_folder", dump, "--model.hf_assets_path", tiny_model_dir,
                  "--inference.num_servers", "2", "--grpo.prompts_per_step", "4", "--grpo.group_size", "4",
                  "--weight_sync.mode", "sync", "--grpo.kl_coef", "0.01",  # + an FSDP-sharded reference
                  "--rollout.client_process", "on")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "serial (pipeline depth 0), client in its own process" in r.stdout
    rows = _metrics(dump)
    assert [m["step"] for m in rows] == [1, 2, 3]
    for m in rows:
        assert m["trainer_vs_rollout_logprob_max_abs_diff"] <= 1e-4, m
        assert m["weight_version"] == m["step"]
        assert m["push/replica0_version_lag"] == 0 and m["push/replica1_version_lag"] == 0
        assert "time/gather_slot_wait_s" in m  # the shards went through the sidecar's own gather
        assert 0 <= m["kl"] < 0.5, m  # a reference that failed to load would be far off
    assert rows[0]["kl"] <= 1e-6  # step 1: the policy still equals the reference
    assert "step    3 | reward" in r.stdout
    assert "mean reward: first 3 steps" in r.stdout
    assert os.path.isdir(os.path.join(dump, "tb")) and os.listdir(os.path.join(dump, "tb"))
    assert _servers_alive(tiny_model_dir) == []


def test_two_ranks_fsdp_async_push(tmp_path, tiny_model_dir):
    """The default mode with a sharded trainer: each step only snapshots the
    shards; the servers follow (usually within a version or two) and every
    step after the first reports the newest delivery's lags."""
    dump = str(tmp_path / "run")
    r = _torchrun(2, "--training.steps", "6", "--job.dump_folder", dump, "--model.hf_assets_path", tiny_model_dir,
                  "--inference.num_servers", "2", "--grpo.prompts_per_step", "4", "--grpo.group_size", "4",
                  "--weight_sync.mode", "async")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = _metrics(dump)
    assert [m["step"] for m in rows] == list(range(1, 7))
    # Each replica follows: it is at most a version behind at some step, and never ahead. How far behind
    # it may fall is a matter of speed (a loaded box: 3 seen), bounded by weight_sync.replica_deadline_s.
    for k in (0, 1):
        lags = [m[f"push/replica{k}_version_lag"] for m in rows[1:]]
        assert min(lags) >= 0 and min(lags) <= 1, lags
    # one optimizer step, one version, whatever the servers lag
    assert all(m["weight_version"] == m["step"] for m in rows)


def test_two_pipeline_stages_sync_push_on_policy(tmp_path, tiny_model_dir):
    """pp=2: each rank holds one stage; the sidecar sends stage 1's weights
    to rank 0, so the server gets the whole model after every step and
    generates with exactly the trainer's weights."""
    dump = str(tmp_path / "run")
    r = _torchrun(2, "--training.steps", "3", "--job.dump_folder", dump, "--model.hf_assets_path", tiny_model_dir,
                  "--parallelism.pipeline_parallel_degree", "2", "--grpo.prompts_per_step", "4",
                  "--grpo.group_size", "4", "--weight_sync.mode", "sync",
                  # distinct samples score differently: the steps change the weights whatever the seeds
                  "--rollout.reward_fn", "tests.reward_fixtures:varies_with_text")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = _metrics(dump)
    assert [m["step"] for m in rows] == [1, 2, 3]
    # the weights did change before the later rollouts (else the check below proves nothing)
    assert any(m["grad_norm"] > 0 for m in rows[:-1]), rows
    for m in rows:
        assert m["trainer_vs_rollout_logprob_max_abs_diff"] <= 1e-4, m
        assert m["push/replica0_version_lag"] == 0 and m["weight_version"] == m["step"]
        assert "time/gather_slot_wait_s" in m  # through the sidecar gather, stage 1 sent to rank 0


def test_push_puts_trainer_weights_on_server(tmp_path, tiny_model_dir):
    """After a train step and a push, every tensor the server holds (read back
    with /get_weights_by_name) equals the trainer's, and the version moved."""
    from torchtitan_grpo.aio import LoopThread
    from torchtitan_grpo.config.parse import parse_config
    from torchtitan_grpo.fleet.launcher import ServerSpec, running_servers
    from torchtitan_grpo.train.trainer import Sample, build_policy, hf_weights, init_distributed, train_step
    from torchtitan_grpo.weight_sync.pusher import Pusher, PushConfig

    cfg = parse_config(["--job.config_file", DEMO, "--model.hf_assets_path", tiny_model_dir])
    d = init_distributed()
    policy = build_policy(cfg, tiny_model_dir, d)
    before = {k: v.clone() for k, v in hf_weights(policy).items()}
    batch = [Sample([19, 31], [20, 1], [-4.0, -4.5], 1.0, 1.0, "stop", ["0"]),
             Sample([20, 31], [21, 22, 1], [-4.0, -4.5, -4.6], -1.0, 0.0, "stop", ["0"])]
    train_step(policy, batch, cfg.grpo, 1.0, 4, 2, 5, 0, d)
    after = hf_weights(policy)
    assert any(not torch.equal(before[k], after[k]) for k in after)  # the step changed something

    loop = LoopThread()
    with running_servers([ServerSpec(tiny_model_dir)], str(tmp_path), 120) as servers:
        url = servers[0].url
        pusher = Pusher(loop, [url], PushConfig(mode="sync", bucket_bytes=64 << 10), torch.device("cpu"))
        try:
            pusher.connect(initial_version=0)
            assert requests.get(url + "/model_info").json()["weight_version"] == "0"
            pusher.push(after, version=1)
            assert requests.get(url + "/model_info").json()["weight_version"] == "1"
            for name, t in after.items():
                got = requests.get(url + "/get_weights_by_name", params={"name": name, "truncate_size": 10**9})
                assert got.status_code == 200, got.text
                served = torch.tensor(got.json() if isinstance(got.json(), list) else got.json()["parameter"])
                assert torch.equal(served.reshape(t.shape).to(t.dtype), t), name
        finally:
            pusher.close()
            loop.close()


def test_server_that_fails_to_start_shows_its_log(tmp_path):
    from torchtitan_grpo.fleet.launcher import ServerSpec, ServerStartError, running_servers

    missing = str(tmp_path / "no-model-here")
    with pytest.raises(ServerStartError) as e:
        with running_servers([ServerSpec(missing)], str(tmp_path / "logs"), 60):
            pass
    msg = str(e.value)
    assert "server_0.log" in msg and "no-model-here" in msg  # the tail of the log names the problem


def test_raising_reward_scores_zero_and_ctrl_c_stops_servers(tmp_path, tiny_model_dir):
    """One run, two behaviours. A jsonl task whose reward raises on some
    samples: those score 0, the traceback is logged once, and training goes
    on. Then SIGINT to the trainer (as Ctrl-C sends it): it stops at a step
    boundary (exit 130, one line) and leaves no server behind."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{d}>", "answer": str(d)}) + "\n" for d in range(10)))
    dump = str(tmp_path / "run")
    cmd = [sys.executable, os.path.join(ROOT, "grpo_train.py"), "--job.config_file", DEMO,
           "--job.dump_folder", dump, "--model.hf_assets_path", tiny_model_dir, "--training.steps", "1000",
           "--rollout.task", "jsonl", "--rollout.dataset_path", str(data),
           "--rollout.reward_fn", "tests.reward_fixtures:sometimes_raises",
           "--grpo.prompts_per_step", "4", "--grpo.group_size", "4"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while _steps_logged(dump) < 3:
            assert p.poll() is None, p.stdout.read()[-3000:]  # the raising reward must not end the run
            assert time.monotonic() < deadline, "fewer than 3 steps within 240 s"
            time.sleep(0.2)
        assert _servers_alive(tiny_model_dir), "no server was running"
        p.send_signal(signal.SIGINT)
        out = p.communicate(timeout=120)[0]  # a hang guard: it stops at the next step boundary
    finally:
        if p.poll() is None:
            p.kill()
    # The prompts with even answers raised in every step; the failure is logged once, with its traceback.
    assert out.count("reward tests.reward_fixtures.sometimes_raises raised ZeroDivisionError") == 1, out[-3000:]
    assert out.count('raise ZeroDivisionError("deliberate failure in the reward")') == 1, out[-3000:]
    assert len(_metrics(dump)) >= 3
    assert p.returncode == 130, out[-3000:]
    assert "received SIGINT" in out and "stopped after step" in out, out[-3000:]
    deadline = time.monotonic() + 15
    while _servers_alive(tiny_model_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _servers_alive(tiny_model_dir) == []


def test_demo_learns_the_digits_task(tmp_path):
    """The README's demo, unchanged: run from a fresh working directory, it
    writes its tiny random model at its own default path (./outputs/tiny-qwen3,
    the only path grpo.tiny_model_if_missing creates), and the model learns the
    task by RL alone, from near chance (a constant output scores <= 0.15) to >= 0.8."""
    dump = str(tmp_path / "run")
    r = _torchrun(1, "--job.dump_folder", dump, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    model = tmp_path / "outputs" / "tiny-qwen3"
    assert "writing a tiny random Qwen3 model and tokenizer to ./outputs/tiny-qwen3" in r.stdout
    assert (model / "config.json").is_file() and (model / "model.safetensors").is_file()
    rows = _metrics(dump)
    first = sum(m["reward/mean"] for m in rows[:10]) / 10
    last = sum(m["reward/mean"] for m in rows[-10:]) / 10
    assert first < 0.15 and last >= 0.8, (first, last)
    assert f"mean reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}" in r.stdout
