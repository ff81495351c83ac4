"""The threads a Redis Cluster batch is fanned out on: one node's share each, at once.

Rules this module keeps:

* The threads are started with the pool (daemon threads) and serve until :meth:`close`.
  Nothing here goes through :mod:`concurrent.futures`: its executors refuse new work once
  the interpreter starts shutting down ("cannot schedule new futures after interpreter
  shutdown"), which is exactly when an engine's last Redis writes are flushed (vLLM tears
  an in-process engine down at interpreter exit). Daemon threads keep running through the
  exit hooks, so a flush from one still reaches every master.
* :meth:`map` runs ``fn`` on each item and returns the results in order; an exception in
  ``fn`` is re-raised to the caller (the first one, after every item has finished). On a
  closed pool, :meth:`map` runs the items one after another in the caller's thread: slower,
  never refused.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

from offload_tiers.thread_names import name_current_thread


class _Batch:
    """The results of one :meth:`NodePool.map` call, and a count of what is left."""

    def __init__(self, n: int) -> None:
        self.results: list[Any] = [None] * n
        self.errors: list[BaseException | None] = [None] * n
        self.left = n
        self.done = threading.Condition()

    def finish(self, i: int, result: Any, error: BaseException | None) -> None:
        with self.done:
            self.results[i], self.errors[i] = result, error
            self.left -= 1
            if not self.left:
                self.done.notify_all()


class NodePool:
    """``threads`` daemon threads that run a batch's per-node exchanges at once."""

    def __init__(self, threads: int, name: str = "kvtier-redis-node") -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._tasks: queue.SimpleQueue[tuple[Callable[[Any], Any], Any, int, _Batch] | None] = \
            queue.SimpleQueue()
        self._closed = False
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        """``[fn(item) for item in items]``, the items run at once on the pool's threads."""
        work = list(items)
        if self._closed:
            return [fn(item) for item in work]
        batch = _Batch(len(work))
        for i, item in enumerate(work):
            self._tasks.put((fn, item, i, batch))
        with batch.done:
            batch.done.wait_for(lambda: batch.left == 0)
        for error in batch.errors:
            if error is not None:
                raise error
        return batch.results

    def close(self) -> None:
        """Stop the threads once the batches handed over so far are done (not waited for:
        one may be stuck on a node that stopped answering until its socket times out)."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._tasks.put(None)

    def _serve(self) -> None:
        name_current_thread()
        while (task := self._tasks.get()) is not None:
            fn, item, i, batch = task
            try:
                result, error = fn(item), None
            except BaseException as exc:  # handed to the caller of map()
                result, error = None, exc
            batch.finish(i, result, error)
