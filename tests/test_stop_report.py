"""What a run that stops says (issue 48): the stop reason once, from the
trainer's stop line, and an end-of-run table of replica events that is true
for a server that never comes back. In-process, no servers."""

from __future__ import annotations

import logging

import pytest

from tests.test_producer import ScriptedPool, make, rows
from torchtitan_grpo.fleet.launcher import ReplicaEvent
from torchtitan_grpo.fleet.pool import PoolConfig
from torchtitan_grpo.fleet.replicas import ReplicaSet
from torchtitan_grpo.rollout.producer import ProducerStopped
from torchtitan_grpo.rollout.tasks import PromptIterator
from torchtitan_grpo.session import _replica_events, causal_order


def test_the_producers_stop_reason_is_left_to_the_trainers_stop_line(caplog):
    """The failure that stops the run reaches the trainer (its stop line says
    it); the producer does not log it as well."""
    data = rows(10)
    bad = PromptIterator(data, 2, seed=0).next_batch()[1]["prompt"]
    loop, prod = make(ScriptedPool(fail=bad), depth=1, data=data)
    try:
        prod.start(0)
        with caplog.at_level(logging.INFO, logger="torchtitan_grpo"):
            with pytest.raises(ProducerStopped, match=f"generation failed for '{bad}'"):
                for _ in range(5):
                    prod.next_batch()
                    prod.published(0)
    finally:
        prod.close()
        loop.close()
    assert not [r for r in caplog.records if bad in r.getMessage()], caplog.text


class _Pool:
    def __init__(self):
        self.calls = []

    def mark_down(self, url, reason):
        self.calls.append(("down", url, reason))

    def retire(self, url, reason):
        self.calls.append(("retire", url, reason))


@pytest.mark.parametrize("max_restarts,detail,reason", [
    (0, "restarts off (inference.server_max_restarts = 0)", "exited; inference.server_max_restarts = 0 allows no restart"),
    (3, "after 3 restart attempt(s)", "exited; given up after 3 restart attempt(s): inference.server_max_restarts = 3"),
])
def test_a_server_given_up_is_retired_with_a_reason_that_reads_right(max_restarts, detail, reason):
    """Not "given up after restarts (after 0 restart attempt(s))" when restarts are off."""
    pool = _Pool()
    _replica_events(pool, max_restarts)(ReplicaEvent(1.0, "http://a", "gave_up", detail))
    assert pool.calls == [("retire", "http://a", reason)]


def test_the_events_table_puts_restarted_before_readmitted():
    """The pool can see a restarted server healthy and caught up before the
    launcher's watcher records "restarted": the table keeps the causal order."""
    url = "http://a"
    events = [ReplicaEvent(1.0, url, "exited", "pid 1 killed by SIGKILL"), ReplicaEvent(1.1, url, "down", "x"),
              ReplicaEvent(1.2, url, "ejected", "its weights are out of date"),
              ReplicaEvent(3.0, url, "back", "passed its health check"),
              ReplicaEvent(3.1, url, "readmitted", "holds the newest weights"),
              ReplicaEvent(3.4, url, "restarted", "pid 2, attempt 1/3"),
              ReplicaEvent(5.0, url, "down", "y"), ReplicaEvent(6.0, url, "back", "passed its health check")]
    kinds = [e.kind for e in causal_order(events)]
    assert kinds == ["exited", "down", "ejected", "restarted", "back", "readmitted", "down", "back"]


def test_an_ejected_replica_that_never_comes_back_is_not_said_to_be_catching_up():
    fleet = ReplicaSet(["http://a"], PoolConfig())
    fleet.eject("http://a")
    ((_, url, kind, detail),) = fleet.events
    assert (url, kind) == ("http://a", "ejected") and "catching up" not in detail
