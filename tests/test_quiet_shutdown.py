"""torchrun stops a worker by signalling its whole process group (and a
terminal's Ctrl-C reaches the foreground group): the servers and the rollout
client the trainer starts live in sessions of their own, so that signal
reaches only the trainer, which then stops them itself (issue 37: they
"exited", were restarted and ejected while the run was stopping)."""

import os
import signal

from torchtitan_grpo.inference.launcher import ServerSpec, _spawn, stop_process
from torchtitan_grpo.rollout.client_process import SpawnedClient


def test_a_started_server_is_out_of_the_trainers_process_group(tmp_path, tiny_model_dir):
    proc, _ = _spawn(ServerSpec(tiny_model_dir), str(tmp_path / "server.log"))
    try:
        assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)
        # what torchrun does to the worker's group does not reach it
        old = signal.signal(signal.SIGUSR1, lambda *a: None)
        try:
            os.killpg(os.getpgid(0), signal.SIGUSR1)
        finally:
            signal.signal(signal.SIGUSR1, old)
        assert proc.poll() is None
    finally:
        stop_process(proc)


def test_the_rollout_client_process_is_out_of_the_trainers_process_group():
    client = SpawnedClient.spawn()
    try:
        assert os.getpgid(client.proc.pid) == client.proc.pid != os.getpgid(0)
    finally:
        client.close()
