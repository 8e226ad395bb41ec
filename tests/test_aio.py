"""Loops and connections wait with a deadline; stopping them must always stop them."""
import asyncio

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
