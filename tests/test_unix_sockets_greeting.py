"""A client opening a private socket (the step socket, the allocate socket): a caller cancelled
while it opens must stay cancelled, and no connection it did not take may stay open."""
import asyncio

import grpc
import pytest

from kvserve.step_frames import reply_frame
from kvserve.unix_sockets import open_greeted, read_frame


class Refused(Exception):
    pass


class GreetingServer:
    """Answers each greeting with ``instance_id`` (after ``delay`` s) and counts connections that ended."""

    def __init__(self, instance_id: str = "inst-1", delay: float = 0.0):
        self.instance_id = instance_id
        self.delay = delay
        self.opened = 0
        self.ended = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.opened += 1
        try:
            await read_frame(reader)
            if self.delay:
                try:
                    await asyncio.wait_for(reader.read(), self.delay)  # b"" as soon as the client closes
                    return
                except asyncio.TimeoutError:
                    pass
            writer.write(reply_frame(grpc.StatusCode.OK, self.instance_id.encode()))
            await reader.read()  # until the client closes
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self.ended += 1
            writer.close()


async def _wait_until(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_caller_cancelled_at_any_moment_of_the_greeting_is_cancelled_and_its_connection_closed(short_tmp_path):
    """Cancelled after 0, 1, 2, ... loop turns: each open either hands over a connection before
    the cancel, or ends cancelled with its connection closed. asyncio.wait_for (Python 3.11) handed
    a connection to a caller already cancelled in the turn the greeting's reply arrived."""
    path = str(short_tmp_path / "s.sock")

    async def scenario():
        greeting = GreetingServer()
        server = await asyncio.start_unix_server(greeting.serve, path)
        outcomes = set()
        for turns in range(40):
            opening = asyncio.create_task(open_greeted(path, "token", "inst-1", "executor", 5.0, Refused))
            for _ in range(turns):
                await asyncio.sleep(0)
            if opening.done():
                _, writer = opening.result()
                writer.close()
                outcomes.add("opened")
                continue
            opening.cancel()
            try:
                _, writer = await opening
            except asyncio.CancelledError:
                outcomes.add("cancelled")
            else:
                writer.close()
                pytest.fail(f"cancelled after {turns} turns, yet handed a connection")
        await _wait_until(lambda: greeting.ended == greeting.opened)
        server.close()
        await server.wait_closed()
        return outcomes

    assert asyncio.run(scenario()) == {"opened", "cancelled"}


def test_a_greeting_that_does_not_come_in_time_is_a_timeout_and_closes_the_connection(short_tmp_path):
    path = str(short_tmp_path / "s.sock")

    async def scenario():
        greeting = GreetingServer(delay=30.0)
        server = await asyncio.start_unix_server(greeting.serve, path)
        with pytest.raises(asyncio.TimeoutError):
            await open_greeted(path, None, "inst-1", "executor", 0.2, Refused)
        await _wait_until(lambda: greeting.ended == greeting.opened == 1)
        server.close()

    asyncio.run(scenario())


def test_a_socket_of_another_instance_is_refused_and_closed(short_tmp_path):
    path = str(short_tmp_path / "s.sock")

    async def scenario():
        greeting = GreetingServer(instance_id="inst-2")
        server = await asyncio.start_unix_server(greeting.serve, path)
        with pytest.raises(Refused, match="kvmanager instance 'inst-2', not 'inst-1'"):
            await open_greeted(path, None, "inst-1", "kvmanager", 5.0, Refused)
        await _wait_until(lambda: greeting.ended == greeting.opened == 1)
        server.close()

    asyncio.run(scenario())
