"""One background thread that runs a batch function over queued items (group commit); the
batch function returns a future, so a batch may finish (e.g. its fsync) while the next one
is being prepared."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvpilot.errors import KvpilotError

T = TypeVar("T")
R = TypeVar("R")


@dataclass(slots=True)
class _Job(Generic[T]):
    items: Sequence[T]
    future: Future[Any]
    single: bool


class BatchWriter(Generic[T, R]):
    """Runs ``process`` on a dedicated thread, over batches of submitted items.

    Jobs run in submission order. Every job queued while a batch is in progress joins the next
    batch (up to ``max_batch`` items; a single job is never split), so many small submissions
    share one fsync and one index commit. ``process`` returns a future of one result per item,
    in order, and may return before that future is done (the thread goes on to the next
    batch); if it raises or its future fails, every future of that batch gets the exception.
    A job whose future was cancelled before its batch started is skipped. ``close`` runs every
    job already queued and waits until every batch's future is done.
    """

    def __init__(
        self, process: Callable[[list[T]], Future[list[R]]], *, name: str, max_batch: int = 256
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._process = process
        self._max_batch = max_batch
        self._queue: queue.SimpleQueue[_Job[T] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False
        self._unfinished: set[Future[list[R]]] = set()  # batches processed, jobs not resolved
        self._finished = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Items submitted and not finished yet."""
        return self._pending

    def submit(self, items: Sequence[T]) -> Future[list[R]]:
        return self._enqueue(items, single=False)

    def submit_one(self, item: T) -> Future[R]:
        return self._enqueue((item,), single=True)

    def close(self) -> None:
        """Finishes every queued job, then stops the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join()
        with self._finished:  # every batch's jobs resolved (its future's waiters are told first)
            self._finished.wait_for(lambda: not self._unfinished)

    def _enqueue(self, items: Sequence[T], *, single: bool) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise KvpilotError(f"{self._thread.name} is closed; no more writes are accepted")
            self._pending += len(items)
            self._queue.put(_Job(items, future, single))
        return future

    def _run(self) -> None:
        stop = False
        while not stop:
            job = self._queue.get()
            if job is None:
                return
            batch = [job]
            size = len(job.items)
            while size < self._max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
                size += len(nxt.items)
            self._run_batch(batch)

    def _run_batch(self, batch: list[_Job[T]]) -> None:
        live = [job for job in batch if job.future.set_running_or_notify_cancel()]
        items = [item for job in live for item in job.items]
        try:
            results = self._process(items) if live else _done([])
        except BaseException as exc:
            results = Future()
            results.set_exception(exc)
        with self._lock:
            self._unfinished.add(results)
        results.add_done_callback(lambda done: self._finish(batch, live, done))

    def _finish(self, batch: list[_Job[T]], live: list[_Job[T]], done: Future[list[R]]) -> None:
        error = done.exception()
        with self._lock:
            self._pending -= sum(len(job.items) for job in batch)
        try:
            if error is not None:
                for job in live:
                    job.future.set_exception(error)
                return
            results = done.result()
            start = 0
            for job in live:
                chunk = results[start : start + len(job.items)]
                start += len(job.items)
                job.future.set_result(chunk[0] if job.single else chunk)
        finally:
            with self._finished:
                self._unfinished.discard(done)
                self._finished.notify_all()


def _done(value: list[R]) -> Future[list[R]]:
    future: Future[list[R]] = Future()
    future.set_result(value)
    return future
