"""What every weight file the package writes gets: the mode of every other file, and a clear disk-full error.

* ``match_umask(path)``: safetensors' ``save_file`` creates its file with mode 0600, while every
  other file a run or an export writes gets ``0666 & ~umask`` (0644 under the usual umask 0022): a
  vLLM server running as another user could read the config but not the weights. After writing,
  the files are given the mode ``open()`` would have given them.
* ``disk_full(err, path)``: a write that failed because the filesystem is full, said so. torch.save
  reports a full disk as ``RuntimeError: ... unexpected pos N vs M`` and safetensors as its own error
  type, neither naming the file; ``DiskFullError`` (an ``OSError`` with errno ENOSPC) names the path
  and the free space.
* ``write_text_atomic(path, text)``: a small text file (the autotune cache) written to a sibling and
  renamed into place, so a reader or a crash never sees half of it.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_NEARLY_FULL = 1 << 20  # bytes: below this, an ambiguous write error is taken for a full disk


class DiskFullError(OSError):
    """A write ran out of space; the message names the path. ``errno`` is ENOSPC."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc), else set and reset."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def match_umask(path: str | os.PathLike) -> None:
    """Give ``path`` (a file, or every file under a directory) the mode a new file gets: 0666 & ~umask."""
    mode = 0o666 & ~_umask()
    root = Path(path)
    files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    for f in files:
        os.chmod(f, mode)


def _free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):  # the nearest existing directory tells the filesystem
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def disk_full(err: BaseException, path: str | os.PathLike) -> DiskFullError | None:
    """A ``DiskFullError`` naming ``path`` if ``err`` (raised while writing there) means the disk
    is full: errno ENOSPC/EDQUOT, a message saying so, or an I/O-looking error (torch.save's
    "unexpected pos") on a filesystem with less than 1 MiB left. None otherwise."""
    path = Path(path)
    text = str(err).lower()
    free = _free_bytes(path)
    full = (isinstance(err, OSError) and err.errno in _FULL_ERRNOS) or "no space left" in text \
        or "storagefull" in text or "quota exceeded" in text
    if not full and (isinstance(err, OSError) or "unexpected pos" in text or "write" in text):
        full = free is not None and free < _NEARLY_FULL
    if not full:
        return None
    left = f"{free} bytes free" if free is not None else "free space unknown"
    return DiskFullError(f"no space left on device while writing {path} ({left}; "
                         f"{type(err).__name__}: {str(err)[:200]})")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` all at once: into a hidden sibling, flushed to disk, then
    renamed over ``path`` (a reader sees the old file or the new one, never half of one; a crash
    leaves at most the sibling, ``.<name>.<pid>.tmp``). The file gets ``0666 & ~umask``; a full disk
    is a ``DiskFullError`` naming ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        match_umask(tmp)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        full = disk_full(err, path)
        if full is not None:
            raise full from err
        raise
