"""Where an NVFP4 export may be written, and how it replaces an earlier one without losing files.

Every export ends with a marker file (``EXPORT_MARKER``) listing the files it wrote. A target
directory is written only if it does not exist, is empty, or holds an earlier export whose
marker lists every file in it; the new export is written into a sibling staging directory and
swapped in, so a crash leaves the earlier export as it was. The source model's directory (and
any directory nested with it) is refused. ``RefusedToOverwrite`` names the path and what to do.

A crash can leave hidden siblings of the target: a staging directory ``.<name>.qerl-tmp-<id>``, and
between the two renames of a swap the earlier export renamed aside, ``.<name>.qerl-old-<id>``, with
no directory at the target. ``clean_leftovers`` (run by ``save_nvfp4`` before it writes) removes
those it can prove are its own: a staging directory holds a lock file (``STAGING_LOCK``, locked while
its export runs, so a live export's is left alone) or, once finished, an export marker listing
exactly its files; an earlier export aside is recognised by its marker. An earlier export aside is
renamed back to the target if the target is missing, so the next run finds it as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
import warnings
from pathlib import Path

from qerl_kit import ct_format, locks

EXPORT_MARKER = ".qerl_export.json"  # written last into every export: the files that export wrote
_MARKER_FORMAT, _MARKER_VERSION = "qerl_kit.export", 1
_CHECKPOINT, _ADAPTER = "nvfp4-checkpoint", "peft-adapter"  # the marker's "kind"
STAGING_LOCK = ".qerl-staging.lock"  # in a staging directory while its export is written
_STAGING: dict[Path, int] = {}  # staging directory -> the locked descriptor of its STAGING_LOCK


class RefusedToOverwrite(FileExistsError):
    """Writing there would delete or overwrite files this code did not write; nothing was written.

    Raised by ``save_nvfp4`` (and ``qerl_kit.experiments.run_grid``); the message names the path,
    what is in the way and what to do. A command line should print it and exit with status 2.
    """


# ---- where an export may go ---------------------------------------------------------------------
def _real(path: str | os.PathLike) -> Path:
    """The absolute path with every symlink resolved (the path need not exist)."""
    return Path(os.path.realpath(os.path.abspath(os.fspath(path))))


def _entries(root: Path) -> list[str]:
    """Everything under ``root`` as sorted relative posix paths: files, symlinks (not followed)
    and empty directories (with a trailing '/')."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        if not dirnames and not filenames and Path(dirpath) != root:
            found.append(rel.as_posix() + "/")  # an empty directory
        for d in list(dirnames):
            if os.path.islink(os.path.join(dirpath, d)):
                found.append((rel / d).as_posix())
                dirnames.remove(d)
        found += [(rel / f).as_posix() for f in filenames]
    return sorted(found)


def _few(names, n: int = 5) -> str:
    """The first ``n`` names and how many more (for messages)."""
    names = list(names)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def load_marker(marker: Path):
    """A marker file's JSON, or None if it is missing, a link, or not readable JSON (shared with the
    experiment grid's marker, qerl_kit.grid_dir)."""
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        return json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _read_marker(root: Path, kind: str) -> list[str] | None:
    """The files listed by our marker in ``root`` (an earlier export of this ``kind``), else None."""
    data = load_marker(root / EXPORT_MARKER)
    if not isinstance(data, dict) or data.get("format") != _MARKER_FORMAT or data.get("kind") != kind:
        return None
    if data.get("version") != _MARKER_VERSION:
        raise RefusedToOverwrite(f"{root} holds an export written by another version of qerl_kit "
                                 f"({EXPORT_MARKER} version {data.get('version')!r}, this one reads "
                                 f"{_MARKER_VERSION}); nothing was written. Choose another directory or "
                                 "remove that one yourself.")
    files = data.get("files")
    if not isinstance(files, list) or not all(
            isinstance(f, str) and f and not f.startswith("/") and ".." not in f.split("/") for f in files):
        return None
    return files


def _earlier_export(target: Path, kind: str, what: str) -> list[str] | None:
    """None if ``target`` is absent or an empty directory; the files of our earlier export there
    if it holds one and nothing else; otherwise ``RefusedToOverwrite``."""
    if not os.path.lexists(target):
        return None
    if not target.is_dir():
        raise RefusedToOverwrite(f"{what} {target} exists and is not a directory; nothing was written. "
                                 "Choose a new or empty directory.")
    entries = _entries(target)
    if not entries:
        return None
    listed = _read_marker(target, kind)
    if listed is None:
        raise RefusedToOverwrite(
            f"{what} {target} is not empty and is not an earlier export written by save_nvfp4 (it has no "
            f"{EXPORT_MARKER}); it holds {_few(entries)}. save_nvfp4 never deletes or overwrites files it "
            "did not write, so nothing was written: choose a new or empty directory, or move those files away.")
    ours = set(listed) | {EXPORT_MARKER}
    parents = {p.as_posix() + "/" for f in listed for p in Path(f).parents if p != Path(".")}
    extra = [e for e in entries if e not in ours and e not in parents]
    if extra:
        raise RefusedToOverwrite(
            f"{what} {target} holds an earlier export, but also files that export did not write: "
            f"{_few(extra)}. Replacing the export would remove them, so nothing was written: move them out "
            f"of {target}, or choose another directory.")
    return listed


def _nested(a: Path, b: Path) -> str | None:
    """How the real paths ``a`` and ``b`` overlap, or None."""
    if a == b:
        return "is"
    if a.is_relative_to(b):
        return "is inside"
    if b.is_relative_to(a):
        return "contains"
    return None


def check_export_dirs(path: str | os.PathLike, *, source_dir: str | os.PathLike | None = None,
                      adapter_dir: str | os.PathLike | None = None) -> None:
    """Raise ``RefusedToOverwrite`` (or ``FileNotFoundError`` for a missing ``source_dir``) if
    ``save_nvfp4`` would refuse these directories; writes nothing. ``save_nvfp4`` runs it itself;
    a command line can run it first, before spending minutes on loading and quantizing a model."""
    target = _real(path)
    targets = [(target, _CHECKPOINT, "the export directory")]
    if adapter_dir is not None:
        adapter = _real(adapter_dir)
        how = _nested(adapter, target)
        if how:
            raise RefusedToOverwrite(f"adapter_dir {adapter} {how} the export directory {target}; give the "
                                     "adapter a directory of its own (e.g. beside the checkpoint)")
        targets.append((adapter, _ADAPTER, "adapter_dir"))
    if source_dir is not None:
        src = _real(source_dir)
        if not src.is_dir():
            raise FileNotFoundError(f"source_dir {source_dir} is not a directory")
        for t, _, what in targets:
            how = _nested(t, src)
            if how:
                suggestion = src.parent / f"{src.name}-nvfp4"
                raise RefusedToOverwrite(
                    f"refusing to write {what} {t}: it {how} the source model directory {src} "
                    f"(source_dir), whose files would be overwritten or mixed with the export. Nothing was "
                    f"written; write the export to a separate directory, e.g. {suggestion}")
    for t, kind, what in targets:
        _earlier_export(t, kind, what)


def _staging_dir(target: Path) -> Path:
    """A new, empty sibling of ``target`` (the same filesystem, so renaming it into place is atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = target.parent / f".{target.name}.qerl-tmp-{uuid.uuid4().hex[:12]}"
        try:
            tmp.mkdir()  # not mkdtemp: its 0700 mode would hide the checkpoint from a server's user
        except FileExistsError:
            continue
        _STAGING[tmp] = locks.try_lock(tmp / STAGING_LOCK)  # says "ours, being written" to a later run
        return tmp


def _release_staging(tmp: Path) -> None:
    """Remove the staging lock of ``tmp`` (after the marker is written, or with the directory)."""
    fd = _STAGING.pop(tmp, None)
    with contextlib.suppress(OSError):
        (tmp / STAGING_LOCK).unlink()
    if fd is not None:
        locks.release(fd)


def discard_staging(tmp: Path) -> None:
    """Delete an unfinished staging directory of this process."""
    shutil.rmtree(tmp, ignore_errors=True)
    _release_staging(tmp)


def _write_marker(root: Path, kind: str) -> None:
    """The marker (written first, then the staging lock goes: at every moment one of them says
    the directory is ours)."""
    files = [e for e in _entries(root) if not e.endswith("/") and e != STAGING_LOCK]
    ct_format.write_json(root / EXPORT_MARKER, {"format": _MARKER_FORMAT, "version": _MARKER_VERSION,
                                                "kind": kind, "files": files})
    _release_staging(root)


def _only_ours(root: Path, kind: str) -> list[str] | None:
    """The files of our export in ``root`` if it holds that and nothing else, else None."""
    try:
        return _earlier_export(root, kind, "a leftover")
    except RefusedToOverwrite:
        return None


def clean_leftovers(target: str | os.PathLike, kind: str = _CHECKPOINT) -> None:
    """Remove (or put back) what a crashed export left beside ``target``; see the module docstring."""
    target = _real(target)
    if not target.parent.is_dir():
        return
    hidden = [p for p in target.parent.iterdir() if p.is_dir() and not p.is_symlink()]
    olds = sorted((p for p in hidden if p.name.startswith(f".{target.name}.qerl-old-")),
                  key=lambda p: p.stat().st_mtime, reverse=True)
    for old in olds:  # the newest first: the one to put back if the target is missing
        listed = _only_ours(old, kind)
        if listed is None:
            if not _entries(old):
                old.rmdir()
            continue  # not provably ours: left as it is
        if not os.path.lexists(target):
            os.rename(old, target)  # a crash between the swap's renames: the earlier export back in place
        else:
            _remove_listed(old, listed)
    for tmp in (p for p in hidden if p.name.startswith(f".{target.name}.qerl-tmp-")):
        if (tmp / STAGING_LOCK).is_file():
            fd = locks.try_lock(tmp / STAGING_LOCK)
            if fd is None:
                continue  # a live export is writing it
            locks.release(fd)
            shutil.rmtree(tmp, ignore_errors=True)
        elif not _entries(tmp) or _only_ours(tmp, kind) is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # a finished export never renamed into place


def _remove_listed(root: Path, listed: list[str]) -> None:
    """Delete only the listed files (and our marker) under ``root``, then its emptied directories;
    whatever else appeared there meanwhile is left, with a warning."""
    for rel in list(listed) + [EXPORT_MARKER]:
        p = root / rel
        if p.is_symlink() or p.is_file():
            p.unlink()
    dirs = sorted({p for rel in listed for p in (root / rel).parents if p.is_relative_to(root) and p != root},
                  key=lambda p: len(p.parts), reverse=True)
    for d in dirs + [root]:
        with contextlib.suppress(OSError):
            d.rmdir()
    if root.exists():
        warnings.warn(f"kept {root}: the replaced export's directory holds files it did not write "
                      f"({_few(_entries(root))})", stacklevel=3)


def _swap_in(staged: Path, target: Path, kind: str, what: str) -> None:
    """Put the finished ``staged`` directory at ``target``: a rename; an earlier export of ours
    there is renamed aside first and its listed files deleted after."""
    listed = _earlier_export(target, kind, what)  # again: something may have appeared meanwhile
    if listed is None:
        if os.path.lexists(target):
            try:
                os.replace(staged, target)  # POSIX replaces an empty directory atomically
            except OSError:
                target.rmdir()
                os.rename(staged, target)
        else:
            os.rename(staged, target)
        return
    backup = target.parent / f".{target.name}.qerl-old-{uuid.uuid4().hex[:12]}"
    os.rename(target, backup)
    try:
        os.rename(staged, target)
    except BaseException:
        os.rename(backup, target)
        raise
    _remove_listed(backup, listed)


# ---- saving -------------------------------------------------------------------------------------
