"""executor.torch_thread.TorchThread: background work runs between steps, a piece at a time."""
from __future__ import annotations

import asyncio
import time

from executor.torch_thread import TorchThread

PIECES = 100
PIECE_S = 0.02


def test_idle_work_runs_a_piece_at_a_time_and_a_job_does_not_wait_for_all_of_it():
    """The executor's start hands its huge-page collapse (seconds of madvise) to the torch thread:
    a step that arrives meanwhile runs after the current piece, not after the whole collapse."""
    thread = TorchThread(1)
    done: list[int] = []

    def pieces():
        for i in range(PIECES):
            time.sleep(PIECE_S)
            done.append(i)
            yield

    try:
        thread.run_when_idle(pieces())
        time.sleep(5 * PIECE_S)

        async def step() -> int:
            return await thread.run(lambda: len(done))

        seen = asyncio.run(step())
        assert 0 < seen < PIECES, "the job waited for every piece"
        deadline = time.monotonic() + 60
        while len(done) < PIECES and time.monotonic() < deadline:
            time.sleep(0.05)
        assert done == list(range(PIECES)), "the idle work did not run to its end"
    finally:
        thread.close()


def test_failing_idle_work_is_dropped_and_the_thread_serves_on():
    thread = TorchThread(1)

    def broken():
        yield
        raise RuntimeError("madvise failed")

    try:
        thread.run_when_idle(broken())
        time.sleep(0.05)

        async def step() -> str:
            return await thread.run(lambda: "served")

        assert asyncio.run(step()) == "served"
    finally:
        thread.close()
