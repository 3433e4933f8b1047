"""The rollout producer and its prompt ledger, over a scripted pool.

The pool stand-in answers each group when the test releases it (or at once),
so ordering, admission bounds and resume are checked by event order, never
by timing.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.producer_stubs import CharTokenizer
from torchtitan_grpo.aio import LoopThread
from torchtitan_grpo.fleet.pool import GenerationFailed
from torchtitan_grpo.fleet.types import Completion, SamplingParams
from torchtitan_grpo.rollout.groups import GroupScorer
from torchtitan_grpo.rollout.ledger import PromptLedger
from torchtitan_grpo.rollout.producer import ProducerStopped, RolloutProducer
from torchtitan_grpo.rollout.tasks import PromptIterator

G = 2  # group size


class ScriptedPool:
    """``generate`` records each call (the prompt text) and, for prompts in
    ``held``, waits until the test releases them."""

    def __init__(self, held: set[str] = frozenset(), fail: str | None = None):
        self.held = set(held)
        self.fail = fail
        self.calls: list[str] = []
        self.seeds: list[int | None] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        self.events: dict[str, asyncio.Event] = {}

    async def generate(self, ids, n, params: SamplingParams):
        text = "".join(chr(i) for i in ids)
        with self.lock:
            self.calls.append(text)
            self.seeds.append(params.seed)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if text == self.fail:
                raise GenerationFailed(f"generation failed for {text!r}")
            if text in self.held:
                ev = self.events.setdefault(text, asyncio.Event())
                await ev.wait()
            return [Completion([ord("a") + j], [-0.5], "stop", "0", ["0"]) for j in range(n)]
        finally:
            with self.lock:
                self.in_flight -= 1

    def metrics(self):
        return {}


def release(loop: LoopThread, pool: ScriptedPool, text: str) -> None:
    async def go():
        pool.events.setdefault(text, asyncio.Event()).set()
    loop.run(go())


def reward(prompt, completion, row):
    return float(completion == "a")  # sample 0 of each group wins: non-constant groups


def rows(n: int) -> list[dict]:
    return [{"prompt": f"p{i:03d}"} for i in range(n)]


def make(pool, depth: int, pps: int = 2, data=None, state=None, seed: int = 0, seeded_requests: bool = True):
    loop = LoopThread()
    source = PromptIterator(data or rows(40), pps, seed=0)
    ledger = PromptLedger(source)
    if state is not None:
        ledger.load_state_dict(state)
    scorer = GroupScorer(CharTokenizer(), reward, group_size=G)
    prod = RolloutProducer(loop, pool, ledger, scorer, prompts_per_step=pps, depth=depth,
                           sampling=SamplingParams(max_new_tokens=1), seed=seed, seeded_requests=seeded_requests)
    return loop, prod


def until(pred, what: str, timeout_s: float = 60.0) -> None:
    """A hang guard, not a speed check."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def prompts_of(batch) -> list[str]:
    out = []
    for s in batch.samples:
        p = "".join(chr(i) for i in s.prompt_ids)
        if not out or out[-1] != p:
            out.append(p)
    return out


def test_first_finished_first_served():
    """A held group does not hold the step: the next finished ones take its
    place, and it goes to a later step once it finishes."""
    data = rows(40)
    first = PromptIterator(data, 2, seed=0).next_batch()[0]["prompt"]  # index 0
    pool = ScriptedPool(held={first})
    loop, prod = make(pool, depth=1, data=data)
    try:
        prod.start(0)
        b1 = prod.next_batch()
        assert 0 not in b1.indices and len(b1.indices) == 2 and len(b1.samples) == 2 * G
        assert all(s.weight_versions == ["0"] for s in b1.samples)
        advantages = sorted(s.advantage for s in b1.samples)
        assert advantages[0] < 0 < advantages[-1]  # group-relative
        prod.published(1)
        b2 = prod.next_batch()
        assert 0 not in b2.indices
        release(loop, pool, first)
        later = []
        for step in range(2, 8):
            prod.published(step)
            later += prod.next_batch().indices
            if 0 in later:
                break
        assert 0 in later, "the held group never reached the trainer after it finished"
    finally:
        prod.close()
        loop.close()


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_admission_bound(depth):
    """Groups ahead of the trainer never exceed what the depth allows: while
    the trainer trains, (depth) steps' worth; between steps, (depth + 1)."""
    pps = 3
    data = rows(60)
    held = {r["prompt"] for r in data}  # nothing finishes until released
    pool = ScriptedPool(held=held)
    loop, prod = make(pool, depth=depth, pps=pps, data=data)
    try:
        prod.start(0)
        until(lambda: len(pool.calls) == (depth + 1) * pps, "admission up to the bound")
        time.sleep(0.2)  # nothing more is admitted meanwhile (a wrong bound would show here)
        assert len(pool.calls) == (depth + 1) * pps
        for p in list(pool.calls[:pps]):
            release(loop, pool, p)
        b = prod.next_batch()  # the trainer now trains: the bound is depth steps ahead
        assert len(b.indices) == pps
        time.sleep(0.2)
        assert len(pool.calls) == (depth + 1) * pps, "a group was admitted beyond the depth while training"
        prod.published(1)  # the step is done: one more step's worth may start
        until(lambda: len(pool.calls) == (depth + 2) * pps, "admission after publish")
        time.sleep(0.2)
        assert len(pool.calls) == (depth + 2) * pps
    finally:
        prod.close()
        loop.close()


def test_depth_zero_is_the_serial_loop():
    """Depth 0: a step's groups start only after the previous step's weights are published."""
    pool = ScriptedPool()
    loop, prod = make(pool, depth=0, pps=2)
    try:
        prod.start(0)
        for step in range(1, 4):
            prod.next_batch()
            time.sleep(0.1)
            assert len(pool.calls) == 2 * step, "generation started before the weights were published"
            prod.published(step)
            until(lambda: len(pool.calls) == 2 * (step + 1), "the next step's groups")
    finally:
        prod.close()
        loop.close()


@pytest.mark.parametrize("seeded", [True, False])
def test_requests_carry_a_distinct_seed_per_prompt_unless_told_not_to(seeded):
    pool = ScriptedPool()
    loop, prod = make(pool, depth=0, pps=4, seeded_requests=seeded)
    try:
        prod.start(0)
        prod.next_batch()
        prod.published(1)
        prod.next_batch()
    finally:
        prod.close()
        loop.close()
    assert len(pool.seeds) == 8
    if seeded:  # every prompt of the run its own seed, the same in a rerun
        assert all(isinstance(x, int) for x in pool.seeds) and len(set(pool.seeds)) == 8
    else:  # rollout.seeded_requests = false: the engine's own stream
        assert pool.seeds == [None] * 8


def test_failed_group_stops_the_run_with_its_error():
    data = rows(10)
    src = PromptIterator(data, 2, seed=0)
    bad = src.next_batch()[1]["prompt"]
    loop, prod = make(ScriptedPool(fail=bad), depth=1, data=data)
    try:
        prod.start(0)
        with pytest.raises(ProducerStopped, match="generation failed for"):
            for _ in range(5):
                prod.next_batch()
                prod.published(0)
    finally:
        prod.close()
        loop.close()


def test_ledger_resume_skips_handed_prompts_and_regenerates_in_flight():
    """Handed out of order; the checkpoint is taken with prompts drawn but not
    handed. A ledger restored from it draws exactly the prompts never handed
    (in stream order), then continues the stream."""
    data = rows(20)
    a = PromptLedger(PromptIterator(data, 4, seed=3))
    drawn = [a.draw() for _ in range(10)]  # indices 0..9
    handed = [1, 0, 3, 5, 6, 9]
    a.handed(handed)
    state = a.state_dict()
    assert state["first_index"] == 0 and state["handed"] == [0, 1, 3, 5, 6, 9]

    b = PromptLedger(PromptIterator(data, 4, seed=3))
    b.load_state_dict(state)
    # checkpointed again before (and while) the handed ones are drawn again: none is lost
    assert b.state_dict() == state
    again = [b.draw() for _ in range(6)]
    assert b.state_dict()["handed"][:6] == [0, 1, 3, 5, 6, 9]
    expected = [(i, r) for i, r in drawn if i not in handed]
    assert again[:4] == expected  # 2, 4, 7, 8: in flight at the checkpoint, generated again
    # then the stream goes on where it would have: indices 10, 11 with the same rows
    c = PromptLedger(PromptIterator(data, 4, seed=3))
    stream = [c.draw() for _ in range(12)]
    assert again[4:] == stream[10:12]


def test_ledger_state_forgets_what_no_resume_needs():
    a = PromptLedger(PromptIterator(rows(50), 4, seed=0))
    for _ in range(30):
        i, _ = a.draw()
        a.handed([i])
    state = a.state_dict()
    assert state["first_index"] == 28 and state["handed"] == [28, 29]
    assert len(a._batches) == 1


def test_ledger_reads_a_bare_source_state():
    """Checkpoints written before the ledger hold the source's own state."""
    src = PromptIterator(rows(10), 2, seed=0)
    src.next_batch()
    b = PromptLedger(PromptIterator(rows(10), 2, seed=0))
    b.load_state_dict(src.state_dict())
    assert b.draw()[1] == src.next_batch()[0]


def test_producer_resume_trains_every_prompt_once():
    """Steps with groups in flight and out of order, a checkpoint, a 'crash'
    (the producer is dropped with groups in flight and buffered), a resume:
    over both runs every prompt of the stream is handed over exactly once, with
    no gap."""
    data = rows(200)
    pool = ScriptedPool()
    loop, prod = make(pool, depth=2, pps=3, data=data)
    handed: list[int] = []
    try:
        prod.start(0)
        for step in range(1, 5):
            handed += prod.next_batch().indices
            prod.published(step)
        state = prod.state_dict()
        until(lambda: len(pool.calls) > len(handed), "groups ahead of the checkpoint")
        ahead = len(pool.calls) - len(handed)
        assert ahead > 0
    finally:
        prod.close()
        loop.close()
    loop2, prod2 = make(ScriptedPool(), depth=2, pps=3, data=data, state=state)
    try:
        prod2.start(4)
        for step in range(5, 9):
            handed += prod2.next_batch().indices
            prod2.published(step)
        oldest_open = prod2.state_dict()["first_index"]
    finally:
        prod2.close()
        loop2.close()
    assert len(set(handed)) == len(handed), "a prompt was trained twice across the resume"
    assert oldest_open >= 12 and set(range(oldest_open)) <= set(handed), "a prompt was lost across the resume"
