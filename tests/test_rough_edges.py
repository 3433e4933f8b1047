"""What a new user sees under the README's own command (issue 37): boolean
keys given a value, the API key kept off server command lines, one log line
per failure, the stop line naming its checkpoint, the summary after a
resume, empty error reasons and the replica state log."""

import asyncio
import os

import pytest

from tests.conftest import ROOT

DEMO = os.path.join(ROOT, "train_configs", "demo_cpu.toml")


# 1. --section.key true|false for boolean keys (tyro takes only --key / --no-key)

def test_bool_keys_take_a_value_like_every_other_key():
    from torchtitan_grpo.config.parse import parse_config

    cfg = parse_config(["--job.config_file", DEMO, "--checkpoint.enable", "true", "--grpo.scale_rewards", "false",
                        "--metrics.enable-tensorboard=no", "--training.dataloader.pin_memory", "1",
                        "--eval.at_start=FALSE"])
    assert cfg.checkpoint.enable is True  # TorchTitan's key
    assert cfg.grpo.scale_rewards is False  # ours
    assert cfg.metrics.enable_tensorboard is False  # dashes and "=value"
    assert cfg.training.dataloader.pin_memory is True  # nested two deep
    assert cfg.eval.at_start is False  # a module with string annotations
    # the flag alone is still tyro's form, and a key after it is not taken as its value
    cfg = parse_config(["--job.config_file", DEMO, "--checkpoint.enable", "--checkpoint.interval", "3",
                        "--grpo.no-scale-rewards"])
    assert cfg.checkpoint.enable is True and cfg.checkpoint.interval == 3 and cfg.grpo.scale_rewards is False


def test_bool_key_with_a_non_boolean_value_names_the_key():
    from torchtitan_grpo.config.checks import ConfigError
    from torchtitan_grpo.config.parse import parse_config

    with pytest.raises(ConfigError, match=r"checkpoint\.enable: 'maybe' is not a boolean"):
        parse_config(["--job.config_file", DEMO, "--checkpoint.enable", "maybe"])
    # a non-boolean key's value is left to the parser
    assert parse_config(["--job.config_file", DEMO, "--rollout.task", "digits"]).rollout.task == "digits"


# 2. The API key of a started server is not on its command line (ps shows it to everyone)

def test_started_server_gets_its_api_key_from_the_environment_not_argv(tmp_path, monkeypatch):
    from torchtitan_grpo.fleet import launcher
    from torchtitan_grpo.server import app as server

    launched = []

    class FakePopen:
        def __init__(self, cmd, env, **kw):
            launched.append((cmd, env))

    monkeypatch.setattr(launcher.subprocess, "Popen", FakePopen)
    monkeypatch.setenv(launcher.API_KEY_ENV, "from-the-users-shell")
    launcher._spawn(launcher.ServerSpec("/some/model", api_key="s3cret-key"), str(tmp_path / "a.log"), port=1)
    launcher._spawn(launcher.ServerSpec("/some/model"), str(tmp_path / "b.log"), port=2)
    (keyed_cmd, keyed_env), (open_cmd, open_env) = launched
    assert not any("s3cret-key" in a for a in keyed_cmd) and "--api-key" not in keyed_cmd
    assert "s3cret-key" not in (tmp_path / "a.log").read_text()
    assert launcher.API_KEY_ENV not in open_env  # no key set: the shell's must not lock the server

    # the server, given exactly that command line and environment, requires the key
    assert keyed_cmd[1:3] == ["-m", "torchtitan_grpo.server"]
    monkeypatch.setattr(server.os, "environ", keyed_env)
    assert server.parse_args(keyed_cmd[3:]).api_key == "s3cret-key"
    monkeypatch.setattr(server.os, "environ", open_env)
    assert server.parse_args(open_cmd[3:]).api_key is None
    # the flag still wins over the environment
    monkeypatch.setattr(server.os, "environ", keyed_env)
    assert server.parse_args([*keyed_cmd[3:], "--api-key", "flag"]).api_key == "flag"


# 3. The fleet gone: one log line per distinct failure, not one per group in flight

def test_groups_failing_alike_are_logged_once(caplog):
    from tests.test_producer import make, until
    from torchtitan_grpo.fleet.pool import NoHealthyReplica
    from torchtitan_grpo.rollout.producer import ProducerStopped

    class GonePool:
        """Holds every group until the test opens the gate, then fails them all."""

        def __init__(self):
            self.calls = 0
            self.gate = None

        async def generate(self, ids, n, params):
            self.calls += 1
            call = self.calls
            self.gate = self.gate or asyncio.Event()
            await self.gate.wait()
            if call == 1:
                raise RuntimeError("another failure")  # distinct: logged too
            raise NoHealthyReplica("every inference replica is gone for good: http://x down")

        def metrics(self):
            return {}

    pool = GonePool()
    loop, prod = make(pool, depth=3, pps=4)  # 16 groups in flight at once
    with caplog.at_level("ERROR", logger="torchtitan_grpo"):
        prod.start(0)
        until(lambda: pool.calls == 16, "16 groups in flight")

        async def open_gate():
            pool.gate.set()
        loop.run(open_gate())
        with pytest.raises(ProducerStopped, match="another failure"):  # the first error is the one raised
            prod.next_batch()
        prod.close()
        loop.close()
    # the first error is the trainer's to say (its stop line); the later distinct one is logged once
    lines = [r.getMessage() for r in caplog.records if "rollout producer stopped" in r.getMessage()]
    assert lines == ["rollout producer stopped: NoHealthyReplica: every inference replica is gone for good: "
                     "http://x down"], lines


# 5. After a resume the summary's "first 10 steps" are the run's, not this process's

def test_summary_after_a_resume_covers_the_runs_first_steps(tmp_path, caplog):
    import json
    from types import SimpleNamespace

    from torchtitan_grpo.metrics import MetricLogger
    from torchtitan_grpo.session import RolloutSide

    # steps 1-6 logged before a stop (reward 0.0 each), evaluations among them, checkpoint at 4
    rows = [{"step": 0, "eval/pass@1": 0.5}]
    rows += [{"step": s, "reward/mean": 0.0, "loss": 0.1} for s in range(1, 7)]
    rows.insert(3, {"step": 2, "eval/pass@1": 0.9, "eval/mean_reward": 0.9})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = MetricLogger(str(tmp_path), enable_tensorboard=False, resume_step=4)
    for s in range(5, 15):  # the resumed process: steps 5-14, reward 1.0 each
        log.log(s, {"reward/mean": 1.0})
    log.close()
    side = RolloutSide(rollouts=SimpleNamespace(pool=SimpleNamespace(events=[])), pusher=None, log=log, pad_id=0)
    with caplog.at_level("INFO", logger="torchtitan_grpo"):
        out = side.summary()
    assert out["reward_first10"] == pytest.approx(0.6)  # steps 1-4 (0.0) and 5-10 (1.0); no eval row
    assert out["reward_last10"] == 1.0 and out["steps"] == 10
    assert ("mean reward: first 10 steps 0.600, last 10 steps 1.000 (run resumed at step 4; earlier steps read "
            "from metrics.jsonl)") in caplog.text


# 3, 4, 5 and 7 over real processes (the stop line naming an interval save,
# torchrun's Root Cause carrying it, the fleet's loss said once, the summary
# after a resume): tests/test_faults.py's
# test_sigterm_saves_resume_and_the_only_server_gone_for_good, whose chain of
# trainer starts these checks share.


# 6. An exception without a message still names itself; a readmitted replica's log says where it goes

def test_empty_exception_messages_name_their_type(caplog):
    from types import SimpleNamespace

    from torchtitan_grpo.reasons import reason, typed_reason
    from torchtitan_grpo.weight_sync.transport import Transport

    assert reason(asyncio.TimeoutError()) == "TimeoutError" and reason(ValueError("bad")) == "bad"
    assert typed_reason(ConnectionResetError()) == "ConnectionResetError"
    assert typed_reason(ValueError("bad")) == "ValueError: bad"

    async def post(r, path, body, timeout):
        raise asyncio.TimeoutError()  # aiohttp's timeouts carry no message

    with caplog.at_level("WARNING"):
        asyncio.run(Transport.unpause(SimpleNamespace(post=post), SimpleNamespace(url="http://r"),
                                      "/continue_generation", None))
    assert "continue_generation on http://r failed: TimeoutError" in caplog.text, caplog.text


def test_readmitted_replica_logs_the_state_it_leaves_and_enters(caplog):
    from torchtitan_grpo.fleet.pool import PoolConfig
    from torchtitan_grpo.fleet.replicas import ReplicaSet

    fleet = ReplicaSet(["http://a", "http://b"], PoolConfig())
    a, b = fleet.replicas
    a.down = True  # a restarted server caught up on weights before its health check passed
    with caplog.at_level("WARNING"):
        fleet.eject("http://a")
        fleet.eject("http://b")
        fleet.readmit("http://a")
        fleet.readmit("http://b")
    assert ("inference replica http://a readmitted (holds the newest weights): catching-up -> down (routed again "
            "once it passes its health check)") in caplog.text, caplog.text
    assert "inference replica http://b readmitted (holds the newest weights): catching-up -> healthy\n" in caplog.text
