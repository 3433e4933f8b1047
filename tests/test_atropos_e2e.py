"""rollout.source = "atropos" end to end, every part a real process: atroposlib's
trajectory API (uvicorn), the trainer under torchrun with its built-in server,
and examples/atropos/digits_env.py sampling from that server and posting
scored two-turn groups. The trainer pulls them, trains, pushes the weights
back to the server the environment samples from, and the reward rises.
Also here: the batch conversion against a plain per-token reference, and the
prefetch of the next batch against the real API. Waits are hang guards,
never speed checks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.server_procs import free_port

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "train_configs" / "demo_cpu.toml"

# 16 groups of 16 two-turn trajectories per step at the demo's learning rate:
# the reward goes from ~0.01 (first ten steps) to 0.64-0.85 (last ten of 100)
# in four recorded runs (80 steps gave 0.25-0.36: too close); the check asks
# for a rise of 0.3.
STEPS, PROMPTS, GROUP = 100, 16, 16
RISE = 0.3


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def _spawn(cmd: list[str], log: Path, **env) -> subprocess.Popen:
    """In a session of its own, so that killpg takes its children too (the trainer's servers)."""
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env={**_env(), **env},
                                start_new_session=True)


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break  # the group is gone
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        try:  # the leader exited; its children may linger a moment
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)


def _tail(path: Path, n: int = 3000) -> str:
    return f"--- {path.name} ---\n" + (path.read_text(errors="replace")[-n:] if path.exists() else "(none)")


def _start_api(log: Path) -> tuple[subprocess.Popen, str]:
    pytest.importorskip("atroposlib")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _spawn([sys.executable, "-m", "uvicorn", "atroposlib.api.server:app", "--host", "127.0.0.1",
                   "--port", str(port), "--log-level", "warning"], log)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/status", timeout=2):
                return proc, url
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.2)
    _kill(proc)
    raise AssertionError("Atropos API did not start\n" + _tail(log))


def _trainer_cmd(dump: Path, model_dir: str, atropos_url: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            str(REPO / "grpo_train.py"), "--job.config_file", str(DEMO), "--job.dump_folder", str(dump),
            "--model.hf_assets_path", model_dir, "--rollout.source", "atropos", "--rollout.atropos_url", atropos_url,
            "--weight_sync.mode", "async", *extra]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


@pytest.mark.slow
def test_digits_env_through_atropos_learns(tmp_path, tiny_model_dir, unreachable_run):
    # unreachable_run: the other test's trainer, started now so that it runs beside this one
    dump = tmp_path / "run"
    dump.mkdir()
    logs = {k: tmp_path / f"{k}.log" for k in ("api", "trainer", "env")}
    api = trainer = env = None
    try:
        api, api_url = _start_api(logs["api"])
        trainer = _spawn(_trainer_cmd(dump, tiny_model_dir, api_url, "--training.steps", str(STEPS),
                                      "--grpo.prompts_per_step", str(PROMPTS), "--grpo.group_size", str(GROUP)),
                         logs["trainer"])
        # The trainer lists the servers it launched; the environment samples from them.
        replicas = dump / "servers" / "replicas.txt"
        deadline = time.monotonic() + 240
        while not (replicas.exists() and replicas.read_text().strip()):
            assert trainer.poll() is None, "the trainer exited before its servers were up\n" + _tail(logs["trainer"])
            assert time.monotonic() < deadline, "no replicas.txt\n" + _tail(logs["trainer"])
            time.sleep(0.5)
        env = _spawn([sys.executable, str(REPO / "examples" / "atropos" / "digits_env.py"), "serve",
                      "--env.tokenizer_name", tiny_model_dir, "--env.replica_file", str(replicas),
                      "--env.rollout_server_url", api_url, "--env.group_size", str(GROUP)],
                     logs["env"], DIGITS_MODEL=tiny_model_dir)
        deadline = time.monotonic() + 900
        while trainer.poll() is None:
            assert time.monotonic() < deadline, "the trainer hung\n" + _tail(logs["trainer"]) + _tail(logs["env"])
            # Atropos's env manager stops on its own, exit 0, once the API's step
            # plus the batches it already queued pass total_steps: near the end
            # it may leave before the trainer has trained (and shut down) the
            # last of them. Only a failure is an error; an early clean exit that
            # starved the trainer shows as the hang above.
            if env.poll() not in (None, 0):
                raise AssertionError(f"the environment exited with {env.returncode}\n" + _tail(logs["env"]))
            time.sleep(1.0)
        out = logs["trainer"].read_text(errors="replace")
        assert trainer.returncode == 0, _tail(logs["trainer"]) + _tail(logs["env"])
        assert env.poll() in (None, 0), f"the environment exited with {env.returncode}\n" + _tail(logs["env"])
    finally:
        for p in (env, trainer, api):
            _kill(p)

    assert "registered with Atropos at " + api_url in out
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == list(range(1, STEPS + 1))
    for m in rows:
        # every step is one Atropos batch of whole groups from the environment, none dropped
        assert m["atropos/groups"] == PROMPTS and m["atropos/dropped_groups"] == 0, m
        assert m["offpolicy/kept_samples"] == PROMPTS * GROUP, m
        # two turns: the model's tokens are a part of each sequence (prompt and reply are not trained)
        assert 2 <= m["rollout/completion_len"] <= 4 < m["rollout/sequence_len"], m
        assert m["weight_version"] == m["step"]
        assert m["atropos/step"] == m["step"]
    rewards = [m["reward/mean"] for m in rows]
    first, last = _mean(rewards[:10]), _mean(rewards[-10:])
    print(f"mean reward over {STEPS} steps: first 10 {first:.3f}, last 10 {last:.3f}")
    # The environment samples from the server the trainer pushes to: the
    # reward rises only if the trained weights reach it.
    assert last > first + RISE, f"mean reward first 10 steps {first:.3f}, last 10 {last:.3f}: {rewards}"
    assert max(m["push/replica0_version_lag"] for m in rows[1:]) <= 2


@dataclass
class UnreachableRun:
    """A trainer whose rollout.atropos_url nobody listens at, and what was seen
    the moment it exited (a thread watches it)."""

    url: str
    log: Path
    proc: subprocess.Popen
    done: threading.Event = field(default_factory=threading.Event)
    returncode: int | None = None
    out: str = ""
    server_pids: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)
    """Servers still running 10 s after the trainer exited (before any clean-up)."""

    def watch(self) -> None:
        try:
            self.returncode = self.proc.wait(timeout=300)  # a hang guard
        except subprocess.TimeoutExpired:
            return  # returncode None: the test reports the hang
        finally:
            self.out = self.log.read_text(errors="replace")
            self.done.set()
        self.server_pids = [int(p) for p in re.findall(r"inference server http://\S+ ready \(pid (\d+),", self.out)]
        self.left = [pid for pid in self.server_pids if _alive(pid)]


@pytest.fixture(scope="module")
def unreachable_run(tmp_path_factory, tiny_model_dir):
    """Started once per module, beside the learning run (it is mostly start-up
    and a 5 s wait, which the two runs share on the machine's cores)."""
    tmp = tmp_path_factory.mktemp("unreachable")
    url = f"http://127.0.0.1:{free_port()}"
    log = tmp / "trainer.log"
    proc = _spawn(_trainer_cmd(tmp / "run", tiny_model_dir, url, "--rollout.atropos_startup_timeout_s", "5",
                               "--training.steps", "3", "--grpo.prompts_per_step", "2", "--grpo.group_size", "2"),
                  log)
    run = UnreachableRun(url, log, proc)
    watcher = threading.Thread(target=run.watch, daemon=True)
    watcher.start()
    try:
        yield run
    finally:
        _kill(proc)
        watcher.join(timeout=30)


@pytest.mark.slow
def test_unreachable_atropos_stops_in_one_line(unreachable_run):
    """Nobody listens at rollout.atropos_url: after the startup timeout the run
    stops with one line naming the key and the URL, exit status non-zero, and
    its server is gone."""
    run = unreachable_run
    assert run.done.wait(timeout=400), "the watcher never finished"
    assert run.returncode is not None, "the trainer hung on an unreachable Atropos API\n" + _tail(run.log)
    assert run.returncode != 0, _tail(run.log)
    # the trainer's own line (torchrun's failure report repeats it from the error file the trainer writes)
    lines = [line for line in run.out.splitlines() if "stopped after step 0 of 3" in line and line.startswith("[rank0]")]
    assert len(lines) == 1, _tail(run.log)
    assert "rollout.atropos_url" in lines[0] and run.url in lines[0], lines[0]
    # the worker's own output has no traceback (torchrun's report of the exit status follows the line)
    assert "Traceback" not in run.out.split(lines[0])[0], _tail(run.log)
    assert len(run.server_pids) == 1 and not run.left, f"servers {run.server_pids}, still running: {run.left}"


def _alive(pid: int, wait_s: float = 10.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return False  # exited, not reaped yet
        except (FileNotFoundError, ProcessLookupError):
            return False
        time.sleep(0.2)
    return True


# ------------------------------------------------------------------ conversion and prefetch


def _reference_convert(group: dict) -> list[tuple]:
    """What convert_group must give for a well-formed group, token by token:
    (prompt, completion, rollout logprobs, loss mask or None) per sequence."""
    out = []
    for toks, masks, lps in zip(group["tokens"], group["masks"], group["inference_logprobs"]):
        trained = [j for j in range(1, len(toks)) if masks[j] != -100]
        first, end = trained[0], trained[-1] + 1
        mask = [1.0 if masks[j] != -100 else 0.0 for j in range(first, end)]
        lp = [min(lps[j], 0.0) if masks[j] != -100 else 0.0 for j in range(first, end)]
        out.append((toks[:first], toks[first:end], lp, None if all(mask) else mask))
    return out


def _random_group(rng, n: int) -> dict:
    """n multi-turn trajectories of random lengths: prompt, then model / environment spans."""
    g = {"tokens": [], "masks": [], "scores": [], "inference_logprobs": [], "overrides": []}
    for _ in range(n):
        toks, masks, lps = [], [], []
        for span in range(rng.randint(2, 6)):
            model = span % 2 == 1
            for _ in range(rng.randint(1, 5)):
                t = rng.randrange(2, 97)
                toks.append(t)
                masks.append(t if model else -100)
                lps.append(-rng.random() * 3 if model else 1.0)
        g["tokens"].append(toks)
        g["masks"].append(masks)
        g["inference_logprobs"].append(lps)
        g["scores"].append(float(rng.random() < 0.5))
        g["overrides"].append({"finish_reason": rng.choice(["stop", "length"])})
    return g


def test_batch_conversion_matches_a_per_token_reference():
    """convert_groups works on the batch's concatenated sequences; with groups
    of several sizes and lengths, malformed ones between them, every sample
    equals the per-token reference and every malformed group gets its kind."""
    import random

    from torchtitan_grpo.rollout.atropos_groups import Malformed, convert_group, convert_groups

    rng = random.Random(0)
    groups = [_random_group(rng, rng.choice([1, 2, 4, 16])) for _ in range(40)]
    bad = {3: "all_masked", 11: "no_logprobs", 17: "bad_value", 29: "shape", 30: "too_long", 35: "bad_value"}
    groups[3]["masks"][-1] = [-100] * len(groups[3]["masks"][-1])
    groups[11]["inference_logprobs"][0] = [1.0] * len(groups[11]["tokens"][0])
    groups[17]["tokens"][-1][-1] = 500  # outside the vocabulary
    groups[29]["masks"][0].append(-100)
    groups[30]["tokens"][0] = groups[30]["tokens"][0] * 40
    groups[30]["masks"][0] = groups[30]["masks"][0] * 40
    groups[30]["inference_logprobs"][0] = groups[30]["inference_logprobs"][0] * 40
    groups[35]["scores"][0] = float("inf")
    results = convert_groups(groups, max_len=256, vocab_size=128)
    assert len(results) == len(groups)
    for k, (g, c) in enumerate(zip(groups, results)):
        if k in bad:
            assert isinstance(c, Malformed) and c.kind == bad[k], (k, c)
            with pytest.raises(Malformed) as e:  # one group alone: the same verdict
                convert_group(g, max_len=256, vocab_size=128)
            assert e.value.kind == bad[k]
            continue
        assert not isinstance(c, Malformed), (k, c)
        got = [(s.prompt_ids, s.completion_ids, s.rollout_logprobs, s.loss_mask) for s in c.samples]
        assert got == _reference_convert(g), k
        assert c.samples == convert_group(g, max_len=256, vocab_size=128).samples
        assert c.trained_tokens == sum(m != -100 for ms in g["masks"] for m in ms[1:])
        assert c.truncated == sum(o["finish_reason"] == "length" for o in g["overrides"])


def test_next_batch_is_prefetched_while_the_trainer_trains(tmp_path):
    """With two batches' groups queued, the second is pulled and converted on
    the prefetch thread after the first is handed out: next_batch returns it
    without waiting on the pull (atropos/exposed_s is 0), and it is exactly
    what the groups say. Nothing is prefetched after the last step."""
    pytest.importorskip("atroposlib")
    from tests.test_atropos import AtroposAPI, make_source, multi_turn_group, own_advantage_group, wait_until
    from torchtitan_grpo.rollout.atropos_groups import convert_group

    api = AtroposAPI(free_port(), tmp_path / "api.log")
    api.start()
    try:
        src = make_source(api.url, batch_size=2, num_steps=2)
        api.call("POST", "/register", {"wandb_group": "", "wandb_project": "", "batch_size": 2, "max_token_len": 64,
                                        "checkpoint_dir": "", "save_checkpoint_interval": -1, "starting_step": 0,
                                        "num_steps": 2})
        for g in (multi_turn_group(), own_advantage_group()):
            api.post_group(g)
        first = src.next_batch()
        assert first.metrics["atropos/prefetched"] == 0.0 and first.metrics["atropos/exposed_s"] > 0
        wait_until(lambda: src._prefetch is not None and src._prefetch.done.is_set(), what="the prefetch")
        assert api.call("GET", "/status")["current_step"] == 2  # Atropos handed out the second batch already
        second = src.next_batch()
        assert second.metrics["atropos/prefetched"] == 1.0 and second.metrics["atropos/exposed_s"] == 0.0
        # (atroposlib builds both batches on the first /batch and hands out the newer first)
        expected = [convert_group(g).samples for g in (multi_turn_group(), own_advantage_group())]
        assert [first.samples, second.samples] in (expected, expected[::-1])
        assert second.indices == [1] and src.step == 2 == src.state_dict()["step"]
        assert src._prefetch is None  # step 2 of 2: nothing more is pulled
        src.close()
    finally:
        api.stop()
