"""Real engines the trainer starts itself (``inference.backend`` vllm or
sglang with no ``inference.urls``): their command lines and environments,
the start-up checks, and on CPU a whole run against a stand-in for vLLM's
server module (tests/fake_engines) that takes only vLLM's flags and runs the
built-in server as its engine child, killed -9 mid-run and restarted."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from torchtitan_grpo.config.checks import ConfigError
from torchtitan_grpo.config.parse import parse_config
from torchtitan_grpo.fleet.engine_commands import EngineLaunch, server_command
from torchtitan_grpo.fleet.launcher import ServerSpec

DEMO = os.path.join(ROOT, "train_configs", "demo_cpu.toml")
FAKES = os.path.join(ROOT, "tests", "fake_engines")


def _spec(engine: str, device: str = "cuda:1", transfer: str = "ipc", key: str = "") -> ServerSpec:
    return ServerSpec("/models/m", device=device, dtype="bfloat16", seed=7, api_key=key, engine=engine,
                      launch=EngineLaunch(gpu_memory_utilization=0.3, max_model_len=4096, served_model_name="m",
                                          weight_transfer=transfer, args=("--enforce-eager",)))


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vllm_command_line_and_environment():
    argv, env = server_command(_spec("vllm", key="secret"), 8001)
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert (_flag(argv, "--model"), _flag(argv, "--port"), _flag(argv, "--dtype"), _flag(argv, "--seed")) == \
        ("/models/m", "8001", "bfloat16", "7")
    assert (_flag(argv, "--gpu-memory-utilization"), _flag(argv, "--max-model-len"),
            _flag(argv, "--served-model-name")) == ("0.3", "4096", "m")
    assert json.loads(_flag(argv, "--weight-transfer-config")) == {"backend": "ipc"}
    assert _flag(argv, "--logprobs-mode") == "processed_logprobs"  # the sampled distribution's, as the loss needs
    assert argv[-1] == "--enforce-eager" and "secret" not in argv  # the key travels in the environment
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
                   "VLLM_API_KEY": "secret", "CUDA_VISIBLE_DEVICES": "1", "VLLM_HOST_IP": "127.0.0.1"}
    argv, env = server_command(_spec("vllm", device="cuda", transfer="nccl"), 8001)
    assert json.loads(_flag(argv, "--weight-transfer-config")) == {"backend": "nccl"}
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in env and "CUDA_VISIBLE_DEVICES" not in env
    argv, _ = server_command(_spec("vllm", transfer=""), 8001)  # weight_sync.mode off: no transfer engine
    assert "--weight-transfer-config" not in argv
    assert "--use-fp64-gumbel" not in argv


def test_a_launched_vllm_samples_with_fp64_noise_unless_told_not_to(monkeypatch, tiny_model_dir):
    from torchtitan_grpo.session import engine_launch

    monkeypatch.syspath_prepend(FAKES)  # vLLM importable, as the start-up checks ask

    def argv_of(*overrides: str) -> list[str]:
        cfg = parse_config(_args("--model.hf_assets_path", tiny_model_dir, *overrides))
        spec = ServerSpec(tiny_model_dir, device="cuda:0", engine="vllm", launch=engine_launch(cfg, tiny_model_dir))
        return server_command(spec, 8001)[0]

    assert argv_of().count("--use-fp64-gumbel") == 1  # the default: runs 128 and 130-132 (docs/GPU_RUNS.md)
    assert "--use-fp64-gumbel" not in argv_of("--inference.vllm_fp64_sampler", "false")
    # Given in engine_args as well: passed once.
    assert argv_of("--inference.engine_args=--use-fp64-gumbel").count("--use-fp64-gumbel") == 1


def test_sglang_command_line_and_a_cpu_device_refused():
    argv, env = server_command(_spec("sglang", device="cuda:2"), 9001)
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert (_flag(argv, "--model-path"), _flag(argv, "--random-seed"), _flag(argv, "--mem-fraction-static"),
            _flag(argv, "--context-length")) == ("/models/m", "7", "0.3", "4096")
    assert env == {"CUDA_VISIBLE_DEVICES": "2"}
    with pytest.raises(ValueError, match="needs a GPU"):
        server_command(_spec("vllm", device="cpu"), 8001)


def test_a_launched_engine_that_fails_to_start_is_one_line_naming_its_first_error(tmp_path, monkeypatch,
                                                                                 tiny_model_dir):
    """The root cause, not the wrapper's "see root cause above" that a real
    vLLM's log ends on, and where the log is."""
    from torchtitan_grpo.fleet.launcher import ServerStartError, running_servers

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([FAKES, ROOT]))
    monkeypatch.setenv("FAKE_VLLM_FAIL", "ray")
    spec = ServerSpec(tiny_model_dir, device="cuda", engine="vllm", launch=EngineLaunch(weight_transfer="ipc"))
    with pytest.raises(ServerStartError) as e:
        with running_servers([spec], str(tmp_path / "logs"), 60):
            pass
    summary = e.value.summary
    assert "\n" not in summary and "(vllm) exited with code 1" in summary, summary
    assert "ModuleNotFoundError: No module named 'ray'" in summary and "server_0.log" in summary, summary
    assert "Engine core initialization failed" in str(e.value)  # the tail keeps the rest


def _args(*extra: str) -> list[str]:
    return ["--job.config_file", DEMO, "--inference.backend", "vllm", "--inference.server_device", "cuda",
            "--weight_sync.transport", "ipc", *extra]


def test_start_up_checks_of_a_launched_engine(monkeypatch, tiny_model_dir):
    base = ["--model.hf_assets_path", tiny_model_dir]
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != FAKES])
    with pytest.raises(ConfigError, match=r"inference\.backend .*'vllm' package is not importable"):
        parse_config(_args(*base))
    monkeypatch.syspath_prepend(FAKES)
    parse_config(_args(*base))  # importable, on a GPU, a transport vLLM has
    with pytest.raises(ConfigError, match=r"inference\.server_device .*needs a GPU"):
        parse_config(_args(*base, "--inference.server_device", "cpu"))
    with pytest.raises(ConfigError, match=r"weight_sync\.transport = 'gloo'.*one of \('nccl', 'ipc'\)"):
        parse_config(_args(*base, "--weight_sync.transport", "gloo"))


@pytest.mark.slow
def test_a_run_against_a_launched_vllm_that_is_killed_mid_run(tmp_path, tiny_model_dir):
    """grpo_train starts the "vLLM" itself (the stand-in), trains over vLLM's
    protocol with the IPC push, and when the server is killed -9 its engine
    child is swept so the restart can take the port; every step trains."""
    dump, record = str(tmp_path / "run"), tmp_path / "record"
    record.mkdir()
    steps = 30  # the kill lands at step 3: most of the run needs the restarted server
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FAKE_VLLM_RECORD=str(record),
               PYTHONPATH=os.pathsep.join([FAKES, ROOT]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(ROOT, "grpo_train.py"), *_args("--model.hf_assets_path", tiny_model_dir),
           "--job.dump_folder", dump, "--training.steps", str(steps), "--inference.gpu_memory_utilization", "0.3",
           "--inference.engine_args=--enforce-eager"]
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        metrics = os.path.join(dump, "metrics.jsonl")
        deadline = time.monotonic() + 300  # hang guards, never speed checks
        while not (os.path.exists(metrics) and len(open(metrics).readlines()) >= 3):
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        (first,) = [json.load(open(f)) for f in glob.glob(str(record / "argv.*.json"))]
        server_pid = int(glob.glob(str(record / "argv.*.json"))[0].rsplit(".", 2)[1])
        os.kill(server_pid, signal.SIGKILL)  # its engine child keeps the port until swept
        p.wait(600)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    out = log.read_text()
    assert p.returncode == 0, out[-4000:]
    argv = first["argv"]
    assert json.loads(_flag(argv, "--weight-transfer-config")) == {"backend": "ipc"}
    assert _flag(argv, "--served-model-name") == os.path.basename(tiny_model_dir) and "--enforce-eager" in argv
    assert _flag(argv, "--gpu-memory-utilization") == "0.3"
    # torchrun's agent-store variable would make vLLM's own one-rank group wait for a store nobody hosts
    assert first["torchrun_env"] == [], first["torchrun_env"]
    rows = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
    assert [m["step"] for m in rows] == list(range(1, steps + 1))
    assert len(glob.glob(str(record / "argv.*.json"))) == 2, out[-4000:]  # started, then restarted once
    with pytest.raises(ProcessLookupError):
        os.kill(first["child"], 0)  # the first engine child did not outlive its server
    assert "caught up at version" in out.split(" exited: ", 1)[1], out[-4000:]  # after its exit: sent the newest
