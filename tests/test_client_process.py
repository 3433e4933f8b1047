"""The rollout client in a process of its own (rollout/client_process.py),
against a real built-in server: groups, metrics and the ledger cross the
process boundary intact; the pool's control surface reaches the client's pool
and its events come back; a client that dies or cannot start stops the run
with its reason. Waits are hang guards, never speed checks."""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time

import pytest

from torchtitan_grpo.fleet.pool import PoolConfig
from torchtitan_grpo.fleet.types import SamplingParams
from torchtitan_grpo.rollout.client_main import GroupOutbox
from torchtitan_grpo.rollout.client_process import RolloutProcess, SpawnedClient
from torchtitan_grpo.rollout.groups import ScoredGroup
from torchtitan_grpo.rollout.ledger import PromptLedger
from torchtitan_grpo.rollout.producer import ProducerSpec, ProducerStopped
from torchtitan_grpo.train.sample import Sample
from torchtitan_grpo.rollout.tasks import DigitsPrompts

PPS, G = 2, 2
HANG_S = 120.0


def spec(model_dir: str, **kw) -> ProducerSpec:
    return ProducerSpec(**{
        "hf_dir": model_dir, "task": "digits", "dataset_path": "", "prompt_key": "prompt", "reward_fn": "",
        "prompts_per_step": PPS, "group_size": G, "seed": 3, "depth": 1,
        "sampling": SamplingParams(max_new_tokens=4, temperature=1.0), "scale_rewards": True,
        "filter_constant_groups": False, "reward_timeout_s": 10.0, "use_chat_template": False, **kw})


@pytest.fixture(scope="module")
def server(generating_server):
    """The session's generate-only server (conftest): nothing here pushes weights to it or pauses it."""
    return generating_server


@pytest.fixture
def fast_heartbeat(monkeypatch):
    """The clients these tests spawn say they are alive every 1 s instead of
    5 s (client_main.HEARTBEAT_S, from the environment they inherit), so a
    silence timeout of 8 s leaves a live client 7 s of slack, as 12 s did
    with 5 s heartbeats, without waiting out the production interval."""
    monkeypatch.setenv("GRPO_CLIENT_HEARTBEAT_S", "1")


def wait_until(cond, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"hang guard: {what}")
        time.sleep(0.05)


def hang_guard(seconds: float, stop: threading.Event) -> None:
    """Set ``stop`` after ``seconds`` on a daemon timer: one left pending when
    its test ends must not hold the interpreter's exit (up to HANG_S)."""
    timer = threading.Timer(seconds, stop.set)
    timer.daemon = True
    timer.start()


def stop_with_an_empty_mirror(client: RolloutProcess) -> None:
    """SIGSTOP the client and drop what it had mirrored: the trainer's next
    wait is for groups the stopped client owes. Groups it sent just before
    the stop (the outbox flushes at a publish) may still be on their way
    through the socket: the mirror is emptied once nothing has arrived for
    3 s, so none lands after it."""
    os.kill(client._proc.pid, signal.SIGSTOP)
    wait_until(lambda: time.monotonic() - client._last_heard >= 3, "the stopped client kept sending")
    with client._cond:
        client._buffer.clear()


def test_groups_metrics_and_ledger_cross_the_process_boundary(model_dir, server):
    client = RolloutProcess(spec(model_dir), [server], PoolConfig(), pushing=False)
    try:
        client.pool.start()
        client.start(0)
        handed: list[int] = []
        for step in range(1, 4):
            batch = client.next_batch()
            assert len(batch.samples) == PPS * G and len(batch.indices) == PPS
            assert all(len(s.completion_ids) == len(s.rollout_logprobs) > 0 for s in batch.samples)
            # each group's advantages sum to zero (scored in the client, per group)
            for k in range(PPS):
                assert abs(sum(s.advantage for s in batch.samples[k * G:(k + 1) * G])) < 1e-5
            assert "pool/requests" not in batch.metrics  # the client's reply is read at published()
            client.published(step)
            assert batch.metrics["pool/requests"] >= PPS * step
            assert {"reward/mean", "rollout/group_latency_s", "rollout/buffered_groups", "time/wait_s"} <= set(batch.metrics)
            handed += batch.indices
            # the checkpoint's ledger state: a fresh ledger resumed from it never draws a handed prompt
            ledger = PromptLedger(DigitsPrompts(PPS, 3))
            ledger.load_state_dict(client.state_dict())
            again = [ledger.draw()[0] for _ in range(2 * PPS)]
            assert not set(again) & set(handed), (again, handed)
            assert min(again) == min(set(range(max(handed) + 2 * PPS)) - set(handed))
        assert len(set(handed)) == len(handed) == 3 * PPS
    finally:
        client.close()
    assert client._proc.returncode == 0
    assert client._error is None  # its exit after close is expected, not an error
    assert isinstance(client.pool.events, list)  # the last list, from the close reply


def test_pool_control_and_down_reports_cross_both_ways(model_dir, server):
    dead = "http://127.0.0.1:9"  # nothing listens: connection refused
    client = RolloutProcess(spec(model_dir), [server, dead], PoolConfig(), pushing=True)
    downs: list[str] = []
    client.pool.on_down = lambda url, reason: downs.append(url)
    try:
        client.pool.start()
        client.start(0)
        client.next_batch()  # the live replica serves; the dead one is found out and reported
        client.published(1)
        wait_until(lambda: dead in downs, "the client's pool reporting the dead replica down")
        client.pool.eject(server)
        wait_until(lambda: any(e[1] == server and e[2] == "ejected" for e in client.pool.events),
                   "eject reaching the client's pool")
        client.pool.readmit(server)
        wait_until(lambda: any(e[1] == server and e[2] == "readmitted" for e in client.pool.events),
                   "readmit reaching the client's pool")
        assert client.next_batch() is not None  # routed again after the readmit
        client.published(2)
    finally:
        client.close()


def test_replica_file_joins_reach_the_pusher_hook(model_dir, server, tmp_path):
    replicas = tmp_path / "replicas.txt"
    replicas.write_text(server + "\n")
    client = RolloutProcess(spec(model_dir), [], PoolConfig(replica_file=str(replicas)), pushing=True)
    joined: list[str] = []
    # The pusher's answer: True = "holds stale weights, route only after readmit".
    client.pool.on_join = lambda url: joined.append(url) or True
    try:
        client.pool.start()
        wait_until(lambda: joined == [server], "the join reaching the trainer's hook")
        # The client assumed fresh (before pushing()); the hook said stale: it is ejected there.
        wait_until(lambda: any(e[1] == server and e[2] == "ejected" for e in client.pool.events),
                   "the stale joiner being ejected in the client")
    finally:
        client.close()


def test_a_killed_client_stops_the_next_batch_with_its_reason(model_dir, server):
    client = RolloutProcess(spec(model_dir), [server], PoolConfig(), pushing=False)
    try:
        client.pool.start()
        client.start(0)
        client.next_batch()
        client.published(1)
        os.kill(client._proc.pid, signal.SIGKILL)
        stop = threading.Event()
        hang_guard(HANG_S, stop)
        with pytest.raises(ProducerStopped, match="SIGKILL"):
            for _ in range(4):  # groups already mirrored here may still make a batch or two
                batch = client.next_batch(stop)
                assert batch is not None, "hang guard: next_batch never reported the dead client"
                client.published(2)  # never raises: the loss is reported by next_batch
        stop.set()
    finally:
        client.close()


def test_a_killed_client_is_restarted_and_no_prompt_is_handed_twice(model_dir, server):
    """SIGKILL with a batch taken whose hand-over the client never
    answered: a new client starts from the ledger's state, its pool is told
    what the old one was (a retired replica stays retired), batches go on,
    no prompt index is handed twice, and the checkpoint's state counts every
    batch. Past max_restarts the next loss stops the run."""
    dead = "http://127.0.0.1:9"
    client = RolloutProcess(spec(model_dir), [server, dead], PoolConfig(), pushing=False, max_restarts=1)
    try:
        client.pool.start()
        client.pool.retire(dead, "gone before the restart")
        client.start(0)
        handed: list[int] = []
        for step in range(1, 3):
            handed += client.next_batch().indices
            client.published(step)
        wait_until(lambda: len(client._buffer) >= PPS, "the next step's groups mirrored in the trainer")
        first = client._proc.pid
        os.kill(first, signal.SIGSTOP)
        handed += client.next_batch().indices  # taken from the mirror: its "took" is never answered
        os.kill(first, signal.SIGKILL)
        client.published(3)  # never raises
        for step in range(4, 7):
            batch = client.next_batch()
            assert batch is not None and len(batch.indices) == PPS
            handed += batch.indices
            client.published(step)
        assert client.restarts == 1 and client._proc.pid != first
        assert len(handed) == len(set(handed)), f"a prompt handed twice across the restart: {handed}"
        state = client.state_dict()
        assert set(handed) <= set(state["handed"]) | set(range(int(state["first_index"])))
        events = client.pool.events  # the restarted client's pool
        assert any(kind == "retired" and url == dead for _, url, kind, _ in events), events
        os.kill(client._proc.pid, signal.SIGKILL)
        with pytest.raises(ProducerStopped, match="SIGKILL"):
            for step in range(7, 11):  # groups already mirrored may still make a batch or two
                client.next_batch()
                client.published(step)
        assert client.restarts == 1
    finally:
        client.close()


def test_a_checkpoint_is_exact_when_the_client_stops_answering(model_dir, server):
    """A batch taken from the mirror while the client is stopped (SIGSTOP):
    its hand-over never gets the client's reply, yet the checkpoint's ledger
    state counts it, and the run then stops naming the silent client."""
    client = RolloutProcess(spec(model_dir), [server], PoolConfig(), pushing=False, reply_timeout_s=3)
    try:
        client.pool.start()
        client.start(0)
        client.next_batch()
        client.published(1)
        before = client.state_dict()
        wait_until(lambda: len(client._buffer) >= PPS, "the next step's groups mirrored in the trainer")
        os.kill(client._proc.pid, signal.SIGSTOP)
        batch = client.next_batch()
        after = client.state_dict()  # the reply times out: the last state plus this batch
        assert after["first_index"] == before["first_index"]
        assert set(batch.indices) <= set(after["handed"]) and not set(batch.indices) & set(before["handed"])
        assert set(before["handed"]) <= set(after["handed"])
        with pytest.raises(ProducerStopped, match="did not answer 'took'"):
            client.next_batch()
    finally:
        os.kill(client._proc.pid, signal.SIGKILL)
        client.close()


def test_a_stopped_client_is_found_out_while_the_trainer_waits(model_dir, server, fast_heartbeat):
    """SIGSTOP while the trainer waits for groups: silent past
    silent_timeout_s, the wait ends with the reason (heartbeats keep a
    live client that has nothing to send from looking silent)."""
    client = RolloutProcess(spec(model_dir), [server], PoolConfig(), pushing=False, silent_timeout_s=8)
    try:
        client.pool.start()
        stop = threading.Event()
        hang_guard(10, stop)
        # not started: no group comes for 10 s (past silent_timeout_s), only heartbeats, and they keep the
        # client alive
        assert client.next_batch(stop) is None
        client.start(0)
        client.next_batch()
        client.published(1)
        stop_with_an_empty_mirror(client)
        with pytest.raises(ProducerStopped, match="silent for"):
            client.next_batch()
    finally:
        os.kill(client._proc.pid, signal.SIGKILL)
        client.close()


def test_a_stopped_client_is_replaced_while_the_trainer_waits(model_dir, server, fast_heartbeat):
    """SIGSTOP, and the mirror emptied: silent past silent_timeout_s, the
    client is killed and a new one started; the wait ends with a batch of
    prompts never handed before."""
    client = RolloutProcess(spec(model_dir), [server], PoolConfig(), pushing=False, silent_timeout_s=8,
                            max_restarts=1)
    try:
        client.pool.start()
        client.start(0)
        handed = client.next_batch().indices
        client.published(1)
        stopped = client._proc
        stop_with_an_empty_mirror(client)
        stop = threading.Event()
        hang_guard(HANG_S, stop)
        batch = client.next_batch(stop)
        stop.set()
        assert batch is not None, "hang guard: no batch after the restart"
        assert client.restarts == 1 and stopped.returncode == -signal.SIGKILL
        assert not set(batch.indices) & set(handed)
    finally:
        client.close()


def test_a_client_that_cannot_start_names_the_reason(model_dir, tmp_path, caplog):
    """... at once: the client has exited, so closing it does not wait for a
    reply to its close (that wait ran to its 30 s timeout)."""
    missing = str(tmp_path / "no-such-prompts.jsonl")
    with pytest.raises(ProducerStopped, match="could not start.*no-such-prompts"):
        RolloutProcess(spec(model_dir, task="jsonl", dataset_path=missing, reward_fn=""),
                       ["http://127.0.0.1:9"], PoolConfig(), pushing=False)
    assert "did not answer" not in caplog.text


def test_a_client_spawned_ahead_and_never_used_exits_cleanly():
    """rollout_side spawns the client before the servers start; if the run
    stops before it is used, closing the socket ends it (exit 0, no hang)."""
    spawned = SpawnedClient.spawn()
    spawned.close()
    assert spawned.proc.returncode == 0


def test_the_outbox_holds_groups_while_the_trainer_trains_and_keeps_their_order():
    """Waiting for groups, the trainer gets each as soon as it is finished;
    training (a hand-over to its publish), it gets none until the publish,
    then all held in one message; every group once, in buffer order."""
    sent: list[tuple] = []
    box = GroupOutbox(sent.append)
    groups = [ScoredGroup(i, [], [0.0], 1, 0, True) for i in range(7)]
    box.add(groups[0])
    box.add(groups[1])
    assert sent == [("groups", groups[0:1]), ("groups", groups[1:2])]
    box.took()
    for g in groups[2:5]:
        box.add(g)
    assert len(sent) == 2  # nothing while the step trains
    box.published()
    assert sent[2] == ("groups", groups[2:5])
    box.published()  # nothing held: nothing sent
    box.add(groups[5])
    assert sent[3] == ("groups", groups[5:6])
    box.took()
    box.add(groups[6])
    box.published()
    assert [g.index for _, batch in sent for g in batch] == list(range(7))


def test_a_group_crosses_the_pipe_whole():
    """Groups are pickled with their samples as tuples of fields (cheaper to
    unpickle on the trainer's side): every field of every sample, each
    group field, and the prompt shared by a group's samples come back."""
    prompt = [5, 17, 9]
    samples = [Sample(prompt, [10 + j, 1], [-0.5 * j, -0.01], 0.25 * j, float(j), "stop" if j else "length",
                      ["3", "4"], loss_mask=[1.0, 0.0] if j else None,
                      version_spans=[("3", 0, 1), ("4", 1, 2)] if j else None) for j in range(3)]
    group = ScoredGroup(7, samples, [s.reward for s in samples], 6, 1, False, replica="http://a:1", started=1.5,
                        finished=2.5, admitted_version=3, versions=["3", "4"])
    back = pickle.loads(pickle.dumps(("groups", [group]), protocol=pickle.HIGHEST_PROTOCOL))[1][0]
    assert back == group and all(type(s) is Sample for s in back.samples)
    assert back.samples[0].prompt_ids is back.samples[2].prompt_ids  # one list, as sent
