"""One mirror a file: a running mirror holds an exclusive lock on ``{file}.lock`` beside its
SQLite file, so that a second one (a second `cdc-platform mirror`, or `mirror verify
--against-source` wanting to run one) is told at once that the file has its mirror, instead
of both following the stream into it. The readers (`mirror status`, `mirror verify`, the
fleet reporter) take no lock: they read on read-only connections.

``flock`` on a file of its own, never a lock on the database file itself: SQLite holds POSIX
locks there, which a process loses when it closes any descriptor of that file. The lock goes
with the process (killed: released); the file holds the holder's pid, for the message.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from cdc_platform.mirror.errors import MirrorError


class MirrorRunning(MirrorError):
    """Another mirror runs on this file (its pid when known)."""

    def __init__(self, path: Path, pid: int | None) -> None:
        holder = f"pid {pid}" if pid else "another process"
        super().__init__(f"{path}: a mirror runs on this file already ({holder}, holding "
                         f"{lock_path(path)})")
        self.pid = pid


def lock_path(path: str | Path) -> Path:
    """Beside the file it resolves to: a symlink to it, or another path to it, takes the
    same lock."""
    return Path(f"{os.path.realpath(path)}.lock")


@contextlib.contextmanager
def holding(path: str | Path) -> Iterator[None]:
    """Hold the mirror lock of the SQLite file ``path`` (:class:`MirrorRunning`: another
    process, or another mirror of this one, holds it)."""
    try:
        fd = os.open(lock_path(path), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise MirrorError(f"{path}: cannot open its lock file ({exc})") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MirrorRunning(Path(path), _pid(fd)) from None
        except OSError as exc:  # (a filesystem without flock: ENOLCK, EACCES)
            raise MirrorError(f"{path}: cannot lock {lock_path(path)} ({exc})") from exc
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip())
    return None
