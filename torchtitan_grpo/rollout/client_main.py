"""The client side of the rollout client process (``client_process.py`` is
the trainer's side and says why the split and what the messages are): the
pool, the prompt ledger, the scorer and the producer, run as
``python -m torchtitan_grpo.rollout.client_main FD`` over the socket ``FD``
that the trainer's :class:`~torchtitan_grpo.rollout.client_process.SpawnedClient`
passes it."""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

from torchtitan_grpo.rollout.groups import ScoredGroup

logger = logging.getLogger("torchtitan_grpo")

HEARTBEAT_S = float(os.environ.get("GRPO_CLIENT_HEARTBEAT_S", "5"))
"""How often a client with nothing else to send says it is alive (5 s;
``GRPO_CLIENT_HEARTBEAT_S`` in the trainer's environment, which the client
inherits, sets it: tests of the silence timeout use 1 s instead of waiting
out the production interval)."""


class GroupOutbox:
    """The client's finished groups on their way to the trainer's mirror, in
    buffer order. While the trainer trains (from a hand-over to its
    publish) they are held, and go in one message at the publish; while it
    waits for groups each goes as soon as it is finished. Any thread (the
    producer's loop adds, the message loop reports takes and publishes)."""

    def __init__(self, send: Callable[[tuple], None]):
        self._send = send
        self._held: list[ScoredGroup] = []
        self._training = False
        self._lock = threading.Lock()

    def add(self, group: ScoredGroup) -> None:
        with self._lock:
            self._held.append(group)
            if not self._training:
                self._flush()

    def took(self) -> None:
        with self._lock:
            self._training = True

    def published(self) -> None:
        with self._lock:
            self._training = False
            self._flush()

    def _flush(self) -> None:
        if self._held:
            groups, self._held = self._held, []
            self._send(("groups", groups))  # under the lock: batches leave in buffer order


def main(fd: int) -> int:
    # The trainer decides when the run ends (a signal stops it at a step
    # boundary, then it closes this process), so Ctrl-C and SIGTERM to the
    # process group are its to handle; a trainer that dies closes the socket.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="[rollout] %(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stdout, force=True)
    # Imported before the spec arrives: a client spawned early does this while
    # the servers start (transformers loads its tokenizer classes on first use).
    importlib.import_module("transformers").AutoTokenizer

    from torchtitan_grpo.aio import LoopThread
    from torchtitan_grpo.fleet.pool import InferencePool
    from torchtitan_grpo.rollout.producer import build_producer

    conn = Connection(fd)
    lock = threading.Lock()

    def send(msg: tuple) -> None:
        with lock:
            conn.send(msg)

    try:
        spec, urls, pool_config, pushing = conn.recv()
    except (EOFError, OSError):  # spawned early, never used (the run stopped before)
        return 0
    loop = LoopThread("grpo-rollout-io")
    stale_joins = [False]
    try:
        pool = InferencePool(urls, pool_config)
        if pushing:
            def on_join(url: str) -> bool:
                stale = stale_joins[0]
                send(("join", url, stale))
                return stale
            pool.on_join = on_join
            pool.on_down = lambda url, reason: send(("down", url, reason))
        outbox = GroupOutbox(send)
        producer = build_producer(spec, loop, pool, on_group=outbox.add,
                                  on_error=lambda e: send(("error", f"{type(e).__name__}: {e}")))
    except Exception as e:  # noqa: BLE001  (the trainer reports it)
        send(("reply_error", f"{type(e).__name__}: {e}"))
        loop.close()
        return 1

    def took(n: int, wait_s: float) -> tuple[dict[str, float], dict]:
        outbox.took()
        return producer.take(n, wait_s)[1], producer.state_dict()

    def published(version: int) -> None:
        outbox.published()  # first: the next step's groups the trainer is about to wait for
        producer.published(version)

    handlers: dict[str, Callable[..., Any]] = {
        "ready": producer.state_dict,
        "start_pool": lambda: loop.run(pool.start()),
        "pushing": lambda: stale_joins.__setitem__(0, True),
        "start": producer.start,
        "took": took,
        "published": published,
        "events": lambda: list(pool.events),
        "mark_down": pool.mark_down,
        "retire": pool.retire,
        "eject": pool.eject,
        "readmit": pool.readmit,
        "set_adapter": pool.set_adapter,
    }
    answered = {"ready", "start_pool", "took", "events"}

    def heartbeat() -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            try:
                send(("alive",))
            except OSError:
                return
    threading.Thread(target=heartbeat, name="grpo-rollout-alive", daemon=True).start()
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                logger.warning("the trainer is gone: rollout client stopping")
                break
            kind, args = msg[0], msg[1:]
            if kind == "close":
                break
            try:
                value = handlers[kind](*args)
            except Exception as e:  # noqa: BLE001
                if kind not in answered:
                    raise
                send(("reply_error", f"{type(e).__name__}: {e}"))
                continue
            if kind in answered:
                send(("reply", value))
    finally:
        producer.close()
        try:
            loop.run(pool.close(), timeout=10)
        except Exception:  # noqa: BLE001
            pass
        loop.close()
    try:
        send(("reply", list(pool.events)))
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
