"""asyncio helpers for the long-lived tasks of every service: a deadline that never loses a cancellation."""
from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")


async def wait_within(awaitable: Awaitable[T], timeout: float | None) -> T:
    """``asyncio.wait_for`` without its Python 3.10/3.11 flaw: when the caller is cancelled in the
    same loop iteration as the awaited thing finishes, ``wait_for`` returns the result and the
    cancellation is lost — a step loop told to stop then runs on, and whoever awaits its end hangs.
    Here a cancelled caller is always cancelled (the awaited thing is cancelled too);
    ``asyncio.TimeoutError`` when the time runs out."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        task.add_done_callback(_consume_outcome)  # no one will read it: asyncio must not log it as lost
        raise
    if not done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise asyncio.TimeoutError
    return task.result()


def _consume_outcome(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
