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
    from torchtitan_grpo.config import parse_config

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
    from torchtitan_grpo.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"checkpoint\.enable: 'maybe' is not a boolean"):
        parse_config(["--job.config_file", DEMO, "--checkpoint.enable", "maybe"])
    # a non-boolean key's value is left to the parser
    assert parse_config(["--job.config_file", DEMO, "--rollout.task", "digits"]).rollout.task == "digits"


# 2. The API key of a started server is not on its command line (ps shows it to everyone)

def test_started_server_gets_its_api_key_from_the_environment_not_argv(tmp_path, monkeypatch):
    from torchtitan_grpo.inference import launcher, server

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
    assert keyed_cmd[1:3] == ["-m", "torchtitan_grpo.inference.server"]
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
    from torchtitan_grpo.inference.pool import NoHealthyReplica
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
    lines = [r.getMessage() for r in caplog.records if "rollout producer stopped" in r.getMessage()]
    assert lines == ["rollout producer stopped: RuntimeError: another failure",
                     "rollout producer stopped: NoHealthyReplica: every inference replica is gone for good: "
                     "http://x down"], lines
