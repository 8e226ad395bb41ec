"""Private Unix sockets for same-host fast paths (the executor's step socket, kvmanager's
allocate socket): where they live, how a dead owner's are cleared, and reading frames.

``auto`` puts a socket in a fresh directory only this user can enter (mkdtemp, mode 0700),
the socket itself mode 0600; the directories of processes killed before they could remove
theirs are removed at the next ``auto`` start in the same parent.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvserve.aio import wait_within
from kvserve.errors import StartupError
from kvserve.logs import get_logger
from kvserve.step_frames import HEADER, frame, frame_length, split_reply

log = get_logger("kvserve.unix_sockets")

# A directory of ``auto``'s this old with no listener is a dead process's: a live one binds its
# socket right after making the directory.
DEAD_DIR_AGE_S = 60.0


@dataclass(frozen=True)
class SocketPlace:
    """Where one kind of socket goes: ``auto`` makes ``<parent>/<dir_prefix>XXXXXXXX/<name>``."""

    what: str  # "the step socket", in errors
    dir_prefix: str  # e.g. "kvserve-executor-"
    name: str  # e.g. "steps.sock"

    def resolve(self, where: str, parent: Path | None = None) -> tuple[Path, Path | None] | None:
        """``where``: ``off`` (None), ``auto`` (a fresh private directory under ``parent``, by
        default the temp directory) or a path. Returns (socket path, the directory made for it)."""
        if where == "off":
            return None
        if where != "auto":
            return Path(where), None
        parent = Path(parent or tempfile.gettempdir())
        removed = remove_dead_socket_dirs(parent, self.dir_prefix, self.name)
        if removed:
            log.info("socket_dirs_removed", socket=self.name, parent=str(parent), count=removed)
        try:
            owned = Path(tempfile.mkdtemp(prefix=self.dir_prefix, dir=parent))  # mode 0700
        except OSError as exc:
            raise StartupError(f"cannot make {self.what}'s directory under {parent}: {exc.strerror or exc}") from exc
        return owned / self.name, owned

    def listen(self, path: Path, backlog: int = 16) -> socket.socket:
        """A non-blocking listener at ``path`` (mode 0600); a stale socket there is replaced,
        anything else is a ``StartupError``."""
        self._clear_stale(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(path))
            os.chmod(path, 0o600)
            listener.listen(backlog)
        except OSError as exc:
            listener.close()
            raise StartupError(f"cannot listen on {self.what} {path}: {exc.strerror or exc}") from exc
        listener.setblocking(False)
        return listener

    def _clear_stale(self, path: Path) -> None:
        """A socket file nobody listens on (a process that died) is removed; anything else stops the start."""
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise StartupError(f"cannot listen on {self.what} {path}: a file that is not a socket is there")
        if someone_listens(path):
            raise StartupError(f"cannot listen on {self.what} {path}: another process listens there")
        path.unlink(missing_ok=True)


def remove_socket(path: Path | None, owned_dir: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)
    if owned_dir is not None:
        shutil.rmtree(owned_dir, ignore_errors=True)


def someone_listens(path: Path) -> bool:
    """Whether a process accepts connections on the socket at ``path``. Only "no such socket" and
    "refused" say no: a listener too busy to answer within a second still counts as there."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
        return False
    except OSError:
        return True
    finally:
        probe.close()
    return True


def remove_dead_socket_dirs(parent: Path, dir_prefix: str, name: str) -> int:
    """Removes the directories ``auto`` made under ``parent`` for processes that are gone without
    removing theirs (SIGKILL, OOM; in a volume shared by several they would pile up): this user's,
    older than DEAD_DIR_AGE_S (never one a process is starting in), whose socket is missing or
    refused. Another live process's directory stays. Returns how many went."""
    now = time.time()
    removed = 0
    for entry in parent.glob(dir_prefix + "*"):
        try:
            info = entry.lstat()
        except OSError:
            continue
        if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
                or now - info.st_mtime < DEAD_DIR_AGE_S or someone_listens(entry / name)):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed += not entry.exists()
    return removed


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """One frame's payload; ``asyncio.IncompleteReadError`` at EOF, ``FrameTooLarge`` past the limit."""
    length = frame_length(await reader.readexactly(HEADER.size))
    return await reader.readexactly(length)


async def open_greeted(path: str, service_token: str | None, instance_id: str, owner: str, timeout: float,
                       refused: type[Exception]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client's connection whose greeting passed: its token out, the answering process's instance
    id back, all within ``timeout``. Raises ``refused`` when the socket refuses the token or is not
    ``owner`` instance ``instance_id``'s; ``OSError``, ``asyncio.TimeoutError``,
    ``asyncio.IncompleteReadError`` or ``FrameTooLarge`` otherwise. A caller cancelled meanwhile is
    cancelled (never handed a connection as ``asyncio.wait_for`` would on Python 3.11), and the
    connection is closed whenever it is not returned."""
    opening = asyncio.ensure_future(_connect_and_greet(path, service_token, instance_id, owner, refused))
    try:
        return await wait_within(opening, timeout)
    except BaseException:
        opening.add_done_callback(_close_unreturned)
        raise


async def _connect_and_greet(path: str, service_token: str | None, instance_id: str, owner: str,
                             refused: type[Exception]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        writer.write(frame((service_token or "").encode()))
        status, payload = split_reply(await read_frame(reader))
        answer = payload.decode(errors="replace")
        if status is not grpc.StatusCode.OK:
            raise refused(f"{status.name}: {answer}")
        if answer != instance_id:
            raise refused(f"it belongs to {owner} instance {answer!r}, not {instance_id!r}")
    except BaseException:
        writer.close()
        raise
    return reader, writer


def _close_unreturned(opening: asyncio.Future) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result()[1].close()
