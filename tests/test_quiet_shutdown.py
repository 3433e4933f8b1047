"""torchrun stops a worker by signalling its whole process group (and a
terminal's Ctrl-C reaches the foreground group): the servers and the rollout
client the trainer starts live in sessions of their own, so that signal
reaches only the trainer, which then stops them itself (issue 37: they
"exited", were restarted and ejected while the run was stopping)."""

import os

from torchtitan_grpo.fleet.launcher import ServerSpec, _spawn, stop_process
from torchtitan_grpo.rollout.client_process import SpawnedClient


def test_a_started_server_is_out_of_the_trainers_process_group(tmp_path, tiny_model_dir):
    proc, _ = _spawn(ServerSpec(tiny_model_dir), str(tmp_path / "server.log"))
    try:
        # a session and process group of its own: torchrun's os.killpg of the worker's group
        # (and a terminal's Ctrl-C) cannot reach it (no signal is sent here: this
        # process's group is pytest's, and CI's shell's)
        assert os.getsid(proc.pid) == os.getpgid(proc.pid) == proc.pid
        assert os.getpgid(proc.pid) != os.getpgid(0)
    finally:
        stop_process(proc)


def test_the_rollout_client_process_is_out_of_the_trainers_process_group():
    client = SpawnedClient.spawn()
    try:
        assert os.getsid(client.proc.pid) == os.getpgid(client.proc.pid) == client.proc.pid != os.getpgid(0)
    finally:
        client.close()
