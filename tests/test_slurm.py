"""scripts/slurm/grpo.sbatch under a real SLURM (slurmctld + slurmd + munge on
this machine): real sbatch jobs that start the built-in inference server as a
job step, wait for its /health, run torchrun with the server's URL, and tear
everything down, on success, when a server dies, and on scancel.

SLURM comes from scripts/slurm/local_cluster.sh: if no controller answers,
the fixture installs slurm-wlm and munge with apt-get (root only) and starts
a one-node cluster. The tests skip only where that is impossible (not root,
or no sbatch and no apt-get, or apt-get cannot fetch the packages); a
cluster that was installed but does not start is a failure.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from tests.conftest import ROOT

SBATCH = os.path.join(ROOT, "scripts", "slurm", "grpo.sbatch")
CLUSTER = os.path.join(ROOT, "scripts", "slurm", "local_cluster.sh")
STEP = os.path.join(ROOT, "scripts", "slurm", "step.sh")
CONFIG = "tests/slurm/tiny_cpu.toml"  # relative to ROOT, the submit directory
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
                "DEADLINE"}


def _run(cmd, timeout=120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _slurm_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    try:
        r = _run(["sinfo", "-h", "-o", "%t"], timeout=20)
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0 and any(s.strip(" *~#") in ("idle", "mix", "alloc", "comp") for s in r.stdout.split())


def _unavailable(why: str) -> None:
    """Skip where SLURM cannot be had, but never silently in CI: .ci/run
    installs it, so a CI run without it is a failure."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but no SLURM: {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def slurm():
    """A SLURM controller with an idle node: the one running here, or a
    one-node cluster installed and started by local_cluster.sh."""
    if _slurm_answers():
        return
    if os.geteuid() != 0:
        _unavailable("no SLURM controller answers and not root: cannot start one (scripts/slurm/local_cluster.sh)")
    if shutil.which("sbatch") is None:
        if shutil.which("apt-get") is None:
            _unavailable("SLURM is not installed and there is no apt-get to install it")
        r = _run(["bash", CLUSTER, "install"], timeout=900)
        if r.returncode != 0:
            _unavailable(f"could not install slurm-wlm/munge with apt-get:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    r = _run(["bash", CLUSTER, "start"], timeout=180)
    assert r.returncode == 0, f"SLURM is installed but did not start:\n{r.stdout}{r.stderr}"
    assert _slurm_answers(), _run(["sinfo"]).stdout


def _env(**extra) -> dict:
    env = dict(os.environ, GRPO_PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    for k in [k for k in env if k.startswith(("SLURM_", "GRPO_"))]:
        if k not in ("GRPO_PYTHON",):
            del env[k]
    env.update(extra)
    return env


def _submit(tmp_path, *args: str, env: dict | None = None) -> tuple[str, str]:
    """sbatch the script from the repository root; returns (job id, output file)."""
    out = str(tmp_path / "job-%j.out")
    r = _run(["sbatch", "--parsable", "--time=10", f"--output={out}", SBATCH, *args], cwd=ROOT, env=env or _env())
    assert r.returncode == 0, r.stdout + r.stderr
    job = r.stdout.strip().split(";")[0]
    return job, out.replace("%j", job)


def _job_state(job: str) -> tuple[str, str]:
    r = _run(["scontrol", "show", "job", "-o", job], timeout=30)
    state = re.search(r"JobState=(\S+)", r.stdout)
    code = re.search(r"ExitCode=(\S+)", r.stdout)
    if state:
        return state.group(1), code.group(1) if code else ""
    r = _run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State,ExitCode"], timeout=30)  # job record already gone
    state, _, code = (r.stdout.strip().splitlines() or ["UNKNOWN|"])[0].partition("|")
    return state.split()[0] if state else "UNKNOWN", code


def _wait(job: str, timeout: float = 420) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state, code = _job_state(job)
        if state in FINAL_STATES:
            return state, code
        time.sleep(0.5)
    _run(["scancel", job])
    pytest.fail(f"job {job} did not finish within {timeout:.0f}s (last state {state})")


def _wait_for_text(path: str, text: str, job: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and text in open(path, errors="replace").read():
            return
        if _job_state(job)[0] in FINAL_STATES:
            break
        time.sleep(0.5)
    _run(["scancel", job])
    pytest.fail(f"{text!r} never appeared in the job's output:\n{_read(path)[-3000:]}")


def _read(path: str) -> str:
    return open(path, errors="replace").read() if os.path.exists(path) else "(no output file)"


def _procs(*needles: str) -> list[tuple[int, str]]:
    """(pid, command line) of processes (not srun or bash wrappers) whose command line holds every needle."""
    out = _run(["ps", "-ww", "-eo", "pid=,args="]).stdout
    found = []
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        prog = os.path.basename(args.split()[0]) if args.split() else ""
        if prog.startswith("python") and all(n in args for n in needles):
            found.append((int(pid), args))
    return found


def _gone(*needles: str, timeout: float = 30) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout
    while (left := _procs(*needles)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


pytestmark = pytest.mark.slow


@dataclass
class Job:
    job: str
    out: str
    """The job's output file."""
    dump: str
    model: str
    """Its own copy of the tiny model: its server processes are told apart by it."""


# The five jobs below, in the order they are submitted: the one-node cluster
# (2 CPUs, one per job) runs two at a time, so the jobs that end by themselves
# go first; the two that train until their test stops them would otherwise
# hold both slots.
JOBS = {  # name: (grpo_train overrides, extra environment)
    "two_steps": (("--training.steps", "2"), {}),
    "failing_start": ((), {"GRPO_SERVER_ARGS": "--max-batch-size 0"}),
    "trainer_failure": (("--grpo.group_size", "1"), {}),
    "server_dying": (("--training.steps", "100000"), {}),
    "scancel": (("--training.steps", "100000"), {}),
}
JOB_WAIT_S = 900  # a hang guard: a job may queue behind two others on a busy 2-core box


@pytest.fixture(scope="module")
def jobs(slurm, tiny_model_dir, tmp_path_factory):
    """Every job of the tests below, submitted at once so that SLURM runs
    them side by side; each test checks (or acts on) its own. Jobs still
    running when the module ends are cancelled."""
    submitted: dict[str, Job] = {}
    try:
        for name, (args, extra_env) in JOBS.items():
            base = tmp_path_factory.mktemp(f"slurm_{name}")
            model = str(shutil.copytree(tiny_model_dir, base / "tiny-qwen3"))
            dump = str(base / "run")
            job, out = _submit(base, CONFIG, *args, "--job.dump_folder", dump, "--model.hf_assets_path", model,
                               env=_env(**extra_env))
            submitted[name] = Job(job, out, dump, model)
        yield submitted
    finally:
        for j in submitted.values():
            if _job_state(j.job)[0] not in FINAL_STATES:
                _run(["scancel", j.job])


def test_sbatch_builtin_server_two_steps(jobs):
    """The whole job: one built-in server started as a step and healthy,
    torchrun trains 2 steps against it with sync weight pushes, the server is
    stopped cleanly, the job ends COMPLETED. The model is written before (a
    missing path given on the command line is a config error, not a new
    model; only the demo's own default path is created)."""
    j = jobs["two_steps"]
    state, code = _wait(j.job, JOB_WAIT_S)
    log = _read(j.out)
    assert (state, code) == ("COMPLETED", "0:0"), log[-4000:]
    assert "wrote the tiny demo model" not in log
    assert re.search(r"server http://\S+:\d+ healthy", log), log
    assert "--inference.urls http://" in log
    assert "step    1 | reward" in log and "step    2 | reward" in log, log
    assert "trainer finished" in log
    assert "stopping 1 inference server(s)" in log and "inference servers stopped" in log
    assert log.rstrip().endswith("grpo.sbatch: exit code 0"), log[-2000:]
    with open(os.path.join(j.dump, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [m["step"] for m in rows] == [1, 2]
    assert all(m["weight_version"] == m["step"] for m in rows)
    folder = os.path.join(j.dump, f"slurm-{j.job}")
    server_logs = [os.path.join(folder, n) for n in os.listdir(folder)]
    assert len(server_logs) == 1
    server_log = _read(server_logs[0])
    assert "ready http://0.0.0.0:" in server_log and "shutting down" in server_log, server_log[-2000:]
    assert _gone("torchtitan_grpo.server", j.model) == []
    assert _gone("grpo_train.py", j.dump) == []


def test_server_dying_mid_run_fails_the_job_with_its_log_tail(jobs):
    """SIGKILL the server while the trainer runs: the job FAILS, prints the end
    of that server's log, and stops the trainer."""
    j = jobs["server_dying"]
    _wait_for_text(j.out, "step    2 | reward", j.job, JOB_WAIT_S)
    servers = _procs("torchtitan_grpo.server", j.model, "--port")
    assert len(servers) == 1, servers
    os.kill(servers[0][0], signal.SIGKILL)
    state, _ = _wait(j.job, JOB_WAIT_S)
    log = _read(j.out)
    assert state == "FAILED", log[-4000:]
    assert re.search(r"error: inference server 0@\S+ exited with code \d+ while the trainer was running; "
                     r"last lines of \S+server_0_\S+\.log:", log), log[-4000:]
    assert "ready http://0.0.0.0:" in log  # the tail of the server's log
    assert "stopping the trainer" in log and "inference servers stopped" in log
    assert _gone("grpo_train.py", j.dump) == []


def test_server_failing_at_start_up_fails_the_job_before_training(jobs):
    j = jobs["failing_start"]
    state, _ = _wait(j.job, JOB_WAIT_S)
    log = _read(j.out)
    assert state == "FAILED", log[-4000:]
    assert "exited with code 2 during start-up" in log and "--max-batch-size must be >= 1" in log, log[-4000:]
    assert "starting the trainer" not in log


def test_trainer_failure_fails_the_job_and_stops_the_servers(jobs):
    j = jobs["trainer_failure"]
    state, code = _wait(j.job, JOB_WAIT_S)
    log = _read(j.out)
    assert (state, code) == ("FAILED", "1:0"), log[-4000:]
    assert "config key grpo.group_size = 1" in log  # the trainer's own message
    assert "trainer failed with exit code 1" in log and "inference servers stopped" in log, log[-3000:]
    assert _gone("torchtitan_grpo.server", j.model) == []


def test_scancel_stops_trainer_and_servers(jobs):
    j = jobs["scancel"]
    _wait_for_text(j.out, "step    1 | reward", j.job, JOB_WAIT_S)
    assert _run(["scancel", j.job]).returncode == 0
    state, _ = _wait(j.job, JOB_WAIT_S)
    assert state == "CANCELLED"
    assert _gone("grpo_train.py", j.dump) == []
    assert _gone("torchtitan_grpo.server", j.model) == []
    log = _read(j.out)
    assert "got SIGTERM" in log and "inference servers stopped" in log, log[-3000:]


# ----------------------------------------------------------------------------
# The plan for layouts this machine cannot run (several nodes, GPUs, SGLang,
# vLLM): --dry-run prints the exact step commands and starts nothing.


def _dry_run(nodelist: str, gpus: int, *args: str) -> str:
    env = _env(SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=nodelist, GRPO_GPUS_PER_NODE=str(gpus),
               SLURM_SUBMIT_DIR=ROOT)
    r = _run(["bash", SBATCH, "--dry-run", *args], cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _line(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_dry_run_vllm_on_a_dedicated_node(slurm, tmp_path):
    out = _dry_run("gpu[1-3]", 8, "--backend", "vllm", CONFIG, "--model.hf_assets_path", str(tmp_path / "m"),
                   "--weight_sync.transport", "nccl")
    servers = _line(out, "grpo.sbatch: dry-run: server ")
    assert len(servers) == 8  # one per GPU of the first node
    for k, line in enumerate(servers):
        assert "--nodelist=gpu1 " in line and f"step.sh {k} 1 " in line  # GPU k of the node
        assert "env VLLM_SERVER_DEV_MODE=1 vllm serve" in line
        assert """--weight-transfer-config '{"backend":"nccl"}'""" in line
    (trainer,) = _line(out, "grpo.sbatch: dry-run: trainer: ")
    assert "--nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=gpu2,gpu3 " in trainer
    assert "step.sh 0 8 " in trainer and "--nnodes=2 --nproc_per_node=8 --node_rank @NODE_RANK@ --master_addr=gpu2 " in trainer
    urls = re.search(r"--inference.urls (\S+)", trainer).group(1).split(",")
    assert urls == [f"http://gpu1:{int(urls[0].rsplit(':', 1)[1]) + k}" for k in range(8)]
    assert "--inference.backend vllm" in trainer and "--weight_sync.master_address gpu2" in trainer
    assert not os.path.exists(tmp_path / "m")  # a dry run writes no model


def test_dry_run_sglang_sharing_one_node(slurm, tmp_path):
    out = _dry_run("g1", 8, "--backend", "sglang", "--gpus-per-server", "2", CONFIG,
                   "--model.hf_assets_path", str(tmp_path / "m"), "--weight_sync.transport", "nccl")
    (server,) = _line(out, "grpo.sbatch: dry-run: server ")
    assert "step.sh 6 2 " in server  # the last two GPUs
    assert "-m sglang.launch_server --model-path" in server and "--tp-size 2" in server
    (trainer,) = _line(out, "grpo.sbatch: dry-run: trainer: ")
    assert "step.sh 0 6 " in trainer and "--nproc_per_node=6" in trainer
    assert "--weight_sync.master_address" not in trainer  # same node: the config's loopback address works


def test_dry_run_refuses_a_layout_without_trainer_gpus(slurm):
    env = _env(SLURM_JOB_ID="4243", SLURM_JOB_NODELIST="g1", GRPO_GPUS_PER_NODE="2", SLURM_SUBMIT_DIR=ROOT)
    r = _run(["bash", SBATCH, "--dry-run", "--servers-per-node", "2", CONFIG], cwd=ROOT, env=env)
    assert r.returncode == 1 and "leave none of the 2 GPUs for the trainer" in r.stderr, r.stdout + r.stderr


# ----------------------------------------------------------------------------
# Pieces that need no SLURM.


def test_step_wrapper_slices_gpus_and_sets_node_rank():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="4,5,6,7", SLURM_PROCID="3")
    r = _run(["bash", STEP, "1", "2", "bash", "-c", 'echo "$CUDA_VISIBLE_DEVICES $1"', "_", "@NODE_RANK@"], env=env)
    assert r.returncode == 0 and r.stdout.strip() == "5,6 3", r.stdout + r.stderr
    r = _run(["bash", STEP, "3", "2", "true"], env=env)
    assert r.returncode == 1 and "needs GPUs 3..4 but sees 4 (4 5 6 7)" in r.stderr
    r = _run(["bash", STEP, "0", "0", "bash", "-c", 'echo "${CUDA_VISIBLE_DEVICES-unset}"'], env=env)
    assert r.stdout.strip() == "4,5,6,7"  # CPU steps leave the environment alone


def test_inference_urls_override_is_a_comma_separated_list():
    """How grpo.sbatch hands the URLs over: TorchTitan's ConfigManager parses a
    list[str] override as one comma-separated value (two values is an error)."""
    from torchtitan_grpo.config.checks import ConfigError
    from torchtitan_grpo.config.parse import parse_config

    demo = os.path.join(ROOT, "train_configs", "demo_cpu.toml")
    cfg = parse_config(["--job.config_file", demo, "--inference.urls", "http://n1:30000,http://n2:30001"])
    assert cfg.inference.urls == ["http://n1:30000", "http://n2:30001"]
    with pytest.raises(ConfigError, match="http://n2:30001"):  # the stray second value, named in one line
        parse_config(["--job.config_file", demo, "--inference.urls", "http://n1:30000", "http://n2:30001"])


def test_a_mistyped_model_path_fails_the_job_before_anything_starts(tmp_path):
    """The config says grpo.tiny_model_if_missing, but the path the user gave
    does not exist: the job dies naming the key, and nothing is written there
    (only the demo's own path gets the tiny model). Needs no SLURM: the check
    runs before the first srun."""
    typo = tmp_path / "tiny-qwn3"
    env = _env(SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node1", SLURM_SUBMIT_DIR=ROOT)
    r = _run(["bash", SBATCH, CONFIG, "--model.hf_assets_path", str(typo)], cwd=ROOT, env=env)
    assert r.returncode != 0
    assert "model.hf_assets_path" in r.stderr + r.stdout and "never at a path given to it" in r.stderr + r.stdout
    assert not typo.exists()
