"""One asyncio event loop on a background thread.

The trainer is synchronous (torch), while the inference pool and the weight
push control plane are asyncio (aiohttp). Running the loop on its own thread
lets HTTP traffic progress while the trainer computes, and lets the trainer
hand work over with ``submit`` (returns a concurrent Future) or ``run``
(waits for the result).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


class LoopThread:
    """A daemon thread running one event loop until ``close``."""

    def __init__(self, name: str = "grpo-io") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        if self.loop.is_closed():
            return

        async def _drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(_drain(), timeout=10)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


class DaemonExecutor(concurrent.futures.Executor):
    """A one-thread executor whose thread never blocks interpreter exit.

    The sidecar's blocking calls (a gloo rendezvous, a broadcast to a replica
    that died) can hang until their timeout; ThreadPoolExecutor threads are
    joined at exit, so one such call would hold the whole process. Work is
    abandoned, not waited for, once ``shutdown`` is called.
    """

    def __init__(self, name: str = "grpo-sender") -> None:
        import queue

        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        threading.Thread(target=self._work, name=name, daemon=True).start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:
                fut.set_exception(e)

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("executor is shut down")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((fut, fn, args, kwargs))
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._closed = True
        self._queue.put(None)  # the thread ends after its current call (if that ever returns)
