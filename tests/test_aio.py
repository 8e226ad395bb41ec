"""Loops and connections wait with a deadline; stopping them must always stop them."""
import asyncio
from pathlib import Path

import pytest

from kvserve.aio import wait_within


def test_a_cancel_arriving_as_the_wait_ends_is_not_lost():
    """asyncio.wait_for (3.10/3.11) returns the result here and the cancelled loop runs on: a gateway
    told to drop an executor kept stepping it and never handed its requests to another (seen in CI)."""
    async def scenario():
        finished = asyncio.get_running_loop().create_future()
        waiter = asyncio.create_task(wait_within(finished, 5.0))
        await asyncio.sleep(0)
        finished.set_result("step output")
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(scenario())


def test_the_deadline_cancels_what_it_waited_for():
    async def scenario():
        never = asyncio.get_running_loop().create_future()
        with pytest.raises(asyncio.TimeoutError):
            await wait_within(never, 0.01)
        assert never.cancelled()

    asyncio.run(scenario())


def test_the_result_or_error_comes_back():
    async def failing():
        raise ValueError("refused")

    async def scenario():
        assert await wait_within(asyncio.sleep(0, result=7), 1.0) == 7
        assert await wait_within(asyncio.sleep(0, result=8), None) == 8
        with pytest.raises(ValueError, match="refused"):
            await wait_within(failing(), 1.0)

    asyncio.run(scenario())


def test_no_service_waits_with_asyncio_wait_for():
    """Each service's waits go through wait_within: asyncio.wait_for's lost cancellation hung a
    backend's stop in CI (the allocate socket's call) and could hand a connection to a caller
    already gone (the sockets' greetings)."""
    root = Path(__file__).resolve().parents[1]
    offenders = [f"{path.relative_to(root)}:{n}"
                 for package in ("gateway", "executor", "kvmanager", "kvserve")
                 for path in sorted((root / package).rglob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if "asyncio.wait_for(" in line and not line.lstrip().startswith(("#", '"', "``"))]
    assert offenders == []
