"""The engine loop in its own thread, and a thread-safe way in and out of it.

Only the engine thread touches the `Engine`. Everything else hands it a command (a function
of the engine) through a queue guarded by a condition variable; the thread runs pending
commands between steps, steps while there is work, and sleeps on the condition otherwise.
Outputs go back to each request's asyncio queue with ``loop.call_soon_threadsafe``, one
call per step and event loop.

A request's stream is registered by the same command that adds the request, so no step can
produce an output before someone is listening for it.

Faults stay local. A command that raises fails only its caller. A step that raises fails the
requests that were in flight (each gets a `EngineFault`, a 500 in the OpenAI shape or an SSE
error event), they are aborted, and the loop goes on. Anything else that escapes the loop is
caught by its supervisor (`_run`), logged with its traceback, the in-flight requests are
failed the same way and the loop restarts, up to `MAX_RESTARTS` within `RESTART_WINDOW_S`;
past that the engine stops and `/health` says why, so a process supervisor restarts us.
Every pass of the loop (idle ones included, at least every `HEARTBEAT_S`) records a
heartbeat: `/health` is a liveness check of the loop, not of the thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

from kvpilot.engine import Engine, RequestOutput
from kvpilot.server.protocol import ApiError

log = logging.getLogger("kvpilot.server")

T = TypeVar("T")
Info = TypeVar("Info")

HEARTBEAT_S = 1.0  # the idle loop wakes at least this often, so its heartbeat stays fresh
MAX_RESTARTS = 5  # loop restarts allowed within RESTART_WINDOW_S before the engine stops
RESTART_WINDOW_S = 60.0


class EngineStopped(ApiError):
    def __init__(self, reason: str) -> None:
        super().__init__(503, f"the engine is not running: {reason}", type="server_error")


class EngineFault(ApiError):
    """The engine failed while it ran this request: the request is aborted, others go on."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(
            500,
            f"the engine failed while running this request ({type(exc).__name__}: {exc}); "
            "it was aborted and the server carries on: retry it",
            type="server_error",
            code="engine_fault",
        )


class RequestStream:
    """The outputs of one request, as the event loop sees them.

    Each item is a cumulative snapshot, so a slow reader skips to the latest one.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.last: RequestOutput | None = None

    async def next(self, timeout: float | None = None) -> RequestOutput | None:
        """The latest snapshot; None if nothing came within ``timeout`` seconds."""
        try:
            item = await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            return None
        while not self.queue.empty() and not isinstance(item, BaseException):
            item = self.queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.last = item
        self.finished = item.finished
        return item


class _Command(Generic[T]):
    __slots__ = ("fn", "future")

    def __init__(self, fn: Callable[[Engine], T]) -> None:
        self.fn = fn
        self.future: Future[T] = Future()

    def run(self, engine: Engine) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.future.set_result(self.fn(engine))
        except BaseException as exc:
            self.future.set_exception(exc)


class AsyncEngine:
    """Owns an `Engine` and the thread that steps it."""

    def __init__(
        self,
        engine: Engine,
        *,
        on_iteration: Callable[[Engine], None] | None = None,
        on_abort: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        # Called on the engine thread after every iteration that ran commands or a step.
        self.on_iteration = on_iteration
        # Called on the engine thread when a running request is aborted for its client.
        self.on_abort = on_abort
        self.error: BaseException | None = None
        self.faults = 0  # steps that raised (their requests failed, the loop went on)
        self.restarts = 0  # times the supervisor restarted the loop
        self.heartbeat = time.monotonic()  # when the loop last went round
        self._restart_times: deque[float] = deque(maxlen=MAX_RESTARTS)
        self._cond = threading.Condition()
        self._commands: deque[_Command[object]] = deque()
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvpilot-engine", daemon=True)

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread, then close the engine (its copiers and disk tier)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the engine thread did not stop within %.0f s; not closing it", timeout)
            return
        self.engine.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stopping

    def heartbeat_age_s(self) -> float:
        """Seconds since the loop last went round (its liveness)."""
        return time.monotonic() - self.heartbeat

    # -- the way in -------------------------------------------------------------------

    def call_soon(self, fn: Callable[[Engine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the engine thread between steps; a future of its result."""
        command = _Command(fn)
        with self._cond:
            if not self.running:
                raise EngineStopped(self.stop_reason())
            self._commands.append(command)  # type: ignore[arg-type]
            self._cond.notify()
        return command.future

    async def call(self, fn: Callable[[Engine], T]) -> T:
        return await asyncio.wrap_future(self.call_soon(fn))

    def call_blocking(self, fn: Callable[[Engine], T], timeout: float | None = None) -> T:
        """For callers outside any event loop (tests, the CLI)."""
        return self.call_soon(fn).result(timeout)

    async def submit(self, add: Callable[[Engine], tuple[str, Info]]) -> tuple[RequestStream, Info]:
        """Run ``add`` (which adds one request and returns its id) and stream that request."""
        loop = asyncio.get_running_loop()

        def run(engine: Engine) -> tuple[RequestStream, Info]:
            request_id, info = add(engine)
            stream = RequestStream(request_id, loop)
            self._streams[request_id] = stream
            return stream, info

        return await self.call(run)

    def abort_soon(self, request_id: str) -> None:
        """Abort a request if it is still running (safe from any thread, never blocks)."""
        with contextlib.suppress(EngineStopped):
            self.call_soon(lambda engine: self._abort(engine, request_id))

    def _abort(self, engine: Engine, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if request_id in engine.requests:
            engine.abort(request_id)
            log.info("request %s aborted: its client went away", request_id)
            if self.on_abort is not None:
                self.on_abort()
        with contextlib.suppress(KeyError):
            engine.pop_output(request_id)

    # -- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        """The supervisor: run the loop; if it dies, fail what was in flight and restart it."""
        while True:
            try:
                self._loop()
                break
            except Exception as exc:
                log.exception("the engine loop died; failing its in-flight requests")
                self._fail_in_flight(exc)
                now = time.monotonic()
                self._restart_times.append(now)
                full = len(self._restart_times) == MAX_RESTARTS
                if full and now - self._restart_times[0] < RESTART_WINDOW_S:
                    log.error(
                        "the engine loop died %d times within %.0f s; the engine stops",
                        MAX_RESTARTS,
                        RESTART_WINDOW_S,
                    )
                    self.error = exc
                    break
                self.restarts += 1
                log.warning("restarting the engine loop (restart %d)", self.restarts)
        self._drain(EngineStopped(self.stop_reason()))

    def _loop(self) -> None:
        engine = self.engine
        while True:
            self.heartbeat = time.monotonic()
            with self._cond:
                while not (self._commands or self._stopping or _has_work(engine)):
                    self._cond.wait(_idle_wait_s(engine))
                    self.heartbeat = time.monotonic()
                if self._stopping:
                    return
                commands = list(self._commands)
                self._commands.clear()
            for command in commands:
                command.run(engine)
            if commands:
                self._collect_finished(engine)
            if _has_work(engine):
                try:
                    outputs = engine.step()
                except Exception as exc:
                    log.exception("an engine step failed; its requests are aborted")
                    self.faults += 1
                    self._fail_in_flight(exc)
                    continue
                self._dispatch(outputs)
            if self.on_iteration is not None:
                try:
                    self.on_iteration(engine)
                except Exception:
                    log.exception("on_iteration hook failed")

    def _fail_in_flight(self, exc: BaseException) -> None:
        """Every request in the engine is aborted; its client gets an `EngineFault`."""
        engine = self.engine
        error = EngineFault(exc)
        for request_id in list(engine.requests):
            try:
                engine.abort(request_id)
            except Exception:
                log.exception("aborting request %s after a fault failed", request_id)
                engine.requests.pop(request_id, None)
            with contextlib.suppress(KeyError):
                engine.pop_output(request_id)
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, object]]] = {}
        for stream in self._streams.values():
            batches.setdefault(stream.loop, []).append((stream, error))
        self._streams.clear()
        self._send(batches)

    def stop_reason(self) -> str:
        if self.error is not None:
            return f"a step failed with {type(self.error).__name__}: {self.error}"
        return "the server is shutting down" if self._stopping else "it was never started"

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, object]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
                self.engine.pop_output(output.request_id)
            batches.setdefault(stream.loop, []).append((stream, output))
        self._send(batches)

    def _collect_finished(self, engine: Engine) -> None:
        """Deliver requests that commands finished (a closed session aborts its turn)."""
        done = [rid for rid in self._streams if rid not in engine.requests]
        self._dispatch([engine.get_output(rid) for rid in done])

    def _drain(self, error: BaseException) -> None:
        with self._cond:
            commands = list(self._commands)
            self._commands.clear()
        for command in commands:
            if command.future.set_running_or_notify_cancel():
                command.future.set_exception(error)
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, object]]] = {}
        for stream in self._streams.values():
            batches.setdefault(stream.loop, []).append((stream, error))
        self._streams.clear()
        self._send(batches)

    @staticmethod
    def _send(batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, object]]]) -> None:
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                loop.call_soon_threadsafe(_deliver, items)


def _has_work(engine: Engine) -> bool:
    """Requests to run, tier copies to finish, or a pause timer (prefetch, lease) due.

    Copies and timers advance only in ``engine.step``, so an engine with no requests still
    steps while paused sessions' KV is moving or about to be prefetched.
    """
    if engine.has_unfinished() or engine.offload.busy():
        return True
    at = engine.offload.next_event_at()
    return at is not None and at <= engine.clock.now()


def _idle_wait_s(engine: Engine) -> float:
    """How long the idle engine thread may sleep: until the next pause timer, a command, or
    its next heartbeat, whichever comes first."""
    at = engine.offload.next_event_at()
    if at is None:
        return HEARTBEAT_S
    return min(HEARTBEAT_S, max(0.0, at - engine.clock.now()))


def _deliver(items: list[tuple[RequestStream, object]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)  # type: ignore[arg-type]
