"""``TorchThread``: the one thread that runs torch in an executor process.

It runs the model load and then every step: those the event loop hands over (gRPC's
Execute and ExecuteStream, through ``run``) and those it reads itself from the
step-socket connections it watches (``watch``, executor/step_socket.py). It waits on
one selector for both, so a step that arrives on a step socket runs in the thread
that read it and its reply leaves from there: no wake-up of another thread on its way
in or out (on a small VM each such wake-up costs ~0.07-0.2 ms, docs/executor.md).

One thread, not merely one at a time: each thread that runs parallel torch ops gets
its own OpenMP team, and with two teams on a small machine libgomp stops spinning
between parallel regions (its "throttled" mode), which slows every step.

Background work that would compete with steps for the cores (``run_when_idle``: the start's
huge-page collapse) runs here too, a piece at a time, whenever no step has arrived for
``IDLE_S``: a step waits for at most one piece, never for a thread preempting its OpenMP team.
"""
from __future__ import annotations

import asyncio
import collections
import selectors
import socket
import threading
from collections.abc import Iterator
from typing import Any, Callable, Protocol

import torch

from kvserve.logs import get_logger

log = get_logger("executor.torch_thread")

IDLE_S = 0.001  # nothing to serve for this long: run a piece of the work handed to run_when_idle


class Watched(Protocol):
    """A connection the torch thread serves whenever it is readable."""

    def fileno(self) -> int: ...

    def on_readable(self) -> bool:
        """Reads what arrived and answers it; False when the connection is finished."""

    def close(self) -> None: ...


class TorchThread:
    def __init__(self, num_threads: int | None = None):
        self._num_threads = num_threads
        self._jobs: collections.deque = collections.deque()  # (fn, args, loop, future) or None: stop
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_reader, selectors.EVENT_READ)
        self._closed = False
        self._idle_work: collections.deque[Iterator] = collections.deque()  # only the thread touches it
        self._thread = threading.Thread(target=self._serve, name="executor-torch", daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the torch thread: its result, or its exception raised here."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._submit((fn, args, loop, future))
        return await future

    def run_when_idle(self, pieces: Iterator) -> None:
        """Runs ``next(pieces)`` in the torch thread, one piece whenever nothing else is to be
        served, until it is exhausted."""
        self._submit((self._idle_work.append, (pieces,), None, None))

    def watch(self, connection: Watched) -> None:
        """From now on the torch thread serves ``connection`` itself; closes it when finished."""
        self._submit((self._selector.register, (connection, selectors.EVENT_READ, connection), None, None))

    def close(self) -> None:
        """Runs what was handed over before, closes every watched connection, ends the thread."""
        if self._closed:
            return
        self._closed = True
        self._submit(None)
        self._thread.join()
        self._wake_writer.close()

    def _submit(self, job) -> None:
        self._jobs.append(job)
        try:
            self._wake_writer.send(b"\0")
        except BlockingIOError:
            pass  # the socket is full of wake-ups the thread has yet to read

    def _serve(self) -> None:
        if self._num_threads:
            torch.set_num_threads(self._num_threads)
        try:
            while True:
                ready = self._selector.select(IDLE_S if self._idle_work else None)
                if not ready and self._idle_work:
                    self._run_idle_piece()
                elif not self._serve_ready(ready):
                    break
        finally:
            for key in list(self._selector.get_map().values()):
                if key.data is not None:
                    key.data.close()
            self._selector.close()
            self._wake_reader.close()

    def _run_idle_piece(self) -> None:
        try:
            next(self._idle_work[0])
        except StopIteration:
            self._idle_work.popleft()
        except Exception as exc:  # noqa: BLE001 — background work must not stop the thread
            log.error("idle_work_failed", error=repr(exc), exc_info=exc)
            self._idle_work.popleft()

    def _serve_ready(self, ready) -> bool:
        for key, _ in ready:
            if key.data is None:
                if not self._run_jobs():
                    return False
                continue
            connection: Watched = key.data
            try:
                keep = connection.on_readable()
            except Exception as exc:  # noqa: BLE001 — a bug in one connection must not stop the thread
                log.error("step_connection_failed", error=repr(exc), exc_info=exc)
                keep = False
            if not keep:
                self._selector.unregister(connection)
                connection.close()
        return True

    def _run_jobs(self) -> bool:
        try:
            while self._wake_reader.recv(4096):
                pass
        except BlockingIOError:
            pass
        while self._jobs:
            job = self._jobs.popleft()
            if job is None:
                return False
            fn, args, loop, future = job
            if future is not None and future.cancelled():
                continue  # its caller stopped waiting before it started
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # noqa: BLE001 — handed to the caller
                result, error = None, exc
            if future is None:
                if error is not None:
                    log.error("torch_thread_job_failed", error=repr(error), exc_info=error)
                continue
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:
                pass  # the loop is closed: nobody waits for it
        return True


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
