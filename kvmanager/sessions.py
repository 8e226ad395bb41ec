"""Client sessions with TTL leases.

Every sequence belongs to one session; a client that stops renewing (a crashed
gateway) loses its session, and the manager frees its sequences, so no block
leaks. Expiry is found two ways: lazily, when an expired session is used, and by
``pop_expired`` (called at the start of every call and by the server's reaper
task), which reads a heap of deadlines instead of scanning every session.
"""
from __future__ import annotations

import heapq
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.errors import NotFound


@dataclass(slots=True)
class Session:
    session_id: str
    pool_id: str
    ttl_ms: int
    client_name: str
    expires_at: float  # clock() seconds


class SessionRegistry:
    """Live sessions by id, and a heap of (deadline, id) for cheap expiry."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        # One entry per live session, holding a deadline <= its real one: a renewal
        # only moves ``expires_at``; the entry is re-pushed when it comes up early.
        self._deadlines: list[tuple[float, str]] = []

    def open(self, pool_id: str, ttl_ms: int, client_name: str) -> Session:
        session_id = secrets.token_hex(16)
        session = Session(session_id, pool_id, ttl_ms, client_name, self.clock() + ttl_ms / 1000)
        self.sessions[session_id] = session
        heapq.heappush(self._deadlines, (session.expires_at, session_id))
        return session

    def get(self, session_id: str) -> Session:
        """The live session; NotFound when unknown, closed or past its lease."""
        session = self.sessions.get(session_id)
        if session is None or session.expires_at <= self.clock():
            raise NotFound(f"session_id: unknown or expired session {session_id!r}")
        return session

    def renew(self, session: Session) -> None:
        session.expires_at = self.clock() + session.ttl_ms / 1000

    def remove(self, session_id: str) -> Session | None:
        return self.sessions.pop(session_id, None)

    def pop_expired(self) -> list[Session]:
        """Removes and returns every session whose lease has run out."""
        now = self.clock()
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, session_id = heapq.heappop(self._deadlines)
            session = self.sessions.get(session_id)
            if session is None:  # closed: its entry just goes
                continue
            if session.expires_at > now:  # renewed since the entry was pushed
                heapq.heappush(self._deadlines, (session.expires_at, session_id))
                continue
            del self.sessions[session_id]
            expired.append(session)
        return expired

    def count_for_pool(self, pool_id: str) -> int:
        return sum(1 for s in self.sessions.values() if s.pool_id == pool_id)
