"""Advisory file locks that a crashed process never leaves stuck: ``flock`` on a lock file.

``try_lock(path)`` takes an exclusive ``flock`` on ``path`` (created if missing) without waiting
and writes this process's id into it; it returns the open file descriptor (the lock lasts while it
is open: until ``release`` or the process ends, a crash included, since the OS drops the locks of a
dead process) or None when another open lock holds it. ``holder(path)`` is the id written by the
holder, for messages. flock locks belong to the open file, so a second ``try_lock`` of the same
file in the same process is refused too. Where ``fcntl`` does not exist (Windows) locking is a
no-op that always succeeds.
"""

from __future__ import annotations

import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None


def try_lock(path: str | os.PathLike) -> int | None:
    """An open, exclusively locked descriptor of ``path``, or None if another holder has it."""
    fd = os.open(os.fspath(path), os.O_RDWR | os.O_CREAT, 0o666)
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):
            os.close(fd)
            return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def release(fd: int) -> None:
    os.close(fd)  # closing drops the flock


def holder(path: str | os.PathLike) -> str:
    """The process id the holder wrote (or '?' if unreadable)."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return "?"
    return text[:20] if text.isdigit() else "?"
