"""An experiment grid's output directory: what the grid may write there, and what it refuses.

A grid records every file it writes in a marker (``GRID_MARKER``) before writing it, so a later
grid in the same directory resumes and replaces only its own files. A directory that is neither
empty, nor marked, nor laid out like a grid (an older grid, or scripts/grid_parallel.sh's output)
is refused, and so are the project's committed results (``bench/results/`` and ``lab/results/``)
unless asked (``allow_results``): committed results are never rewritten by a default run.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from qerl_kit.export_dirs import RefusedToOverwrite, _few, load_marker

GRID_MARKER = ".qerl_grid.json"  # in every output directory: the files the grid wrote there
_GRID_FORMAT, _GRID_VERSION = "qerl_kit.experiments grid", 1
GRID_OUTPUTS = ("metrics.csv", "summary.csv")  # run_grid's, beside runs/
CLI_OUTPUTS = ("curves.png", "curves_smoothed.png", "summary.png", "table.md", "command.json")  # main's
_RUN_FILE = re.compile(r"[A-Za-z0-9._-]+_seed\d+_(metrics|summary)\.csv(\.tmp)?")
_ROOT = Path(__file__).resolve().parents[1]  # the project's checkout (site-packages when installed)
_COMMITTED_RESULTS = (_ROOT / "bench" / "results", _ROOT / "lab" / "results")  # the committed results, in a checkout


def _refused(message: str):
    return RefusedToOverwrite(message)


class _GridDir:
    """A grid's output directory and the files in it that the grid wrote (``GRID_MARKER`` lists them).

    ``inspect`` only reads; ``create`` makes the directory and writes the marker; ``claim(rel)``
    records a file in the marker before it is written, and refuses if something the grid did not
    write is already there. Files of others in a grid directory are left alone.
    """

    def __init__(self, root: Path, files: set[str]):
        self.root, self.files = root, files

    @classmethod
    def inspect(cls, output_dir: str | os.PathLike, allow_results: bool = False) -> "_GridDir":
        root = Path(output_dir)
        real = Path(os.path.realpath(root))
        for committed in _COMMITTED_RESULTS if not allow_results else ():
            results = Path(os.path.realpath(committed))
            if results.is_dir() and (real == results or real.is_relative_to(results)):
                raise _refused(f"output_dir {root} is inside the project's committed results ({results}); "
                               "nothing was written. Write the grid under runs/ (the default, runs/experiments) "
                               "and copy what should be committed, or pass allow_results=True (--allow-results) "
                               "to write a new grid there on purpose.")
        if os.path.lexists(root) and not root.is_dir():
            raise _refused(f"output_dir {root} exists and is not a directory; nothing was written")
        if not root.is_dir() or not any(root.iterdir()):
            return cls(root, set())
        files = cls._marker_files(root)
        return cls(root, files if files is not None else cls._adopt(root))

    @staticmethod
    def _marker_files(root: Path) -> set[str] | None:
        marker = root / GRID_MARKER
        if marker.is_symlink() or not marker.is_file():
            return None
        data = load_marker(marker)
        if not isinstance(data, dict) or data.get("format") != _GRID_FORMAT or data.get("version") != _GRID_VERSION \
                or not isinstance(data.get("files"), list) or not all(isinstance(f, str) for f in data["files"]):
            raise _refused(f"{marker} is not a marker this version of qerl_kit reads (format {_GRID_FORMAT!r}, "
                           f"version {_GRID_VERSION}); nothing was written. Use another output_dir.")
        return set(data["files"])

    @staticmethod
    def _adopt(root: Path) -> set[str]:
        """A grid made before the marker existed, or scripts/grid_parallel.sh's OUT_DIR (runs/ with the
        parts' run CSVs copied in, parts/, logs): recognised by holding nothing else; its grid files
        are taken as the grid's. Anything else is refused."""
        entries = sorted(root.iterdir())
        runs = root / "runs"
        odd = [e.name + ("/" if e.is_dir() else "") for e in entries
               if not ((e.name in GRID_OUTPUTS + CLI_OUTPUTS or e.name.endswith(".log")) and e.is_file()
                       and not e.is_symlink() or e.name in ("runs", "parts") and e.is_dir() and not e.is_symlink())]
        if runs.is_dir() and not runs.is_symlink():
            odd += [f"runs/{e.name}" for e in sorted(runs.iterdir())
                    if not (e.name == ".work" and e.is_dir() and not e.is_symlink()
                            or _RUN_FILE.fullmatch(e.name) and e.is_file() and not e.is_symlink())]
        if odd or not runs.is_dir():
            names = odd or [e.name + ("/" if e.is_dir() else "") for e in entries]
            raise _refused(
                f"output_dir {root} is not empty and is not a grid written by run_grid (no {GRID_MARKER}"
                f"{'' if odd else ', and no runs/ directory of finished runs'}): it holds {_few(names, 8)}. run_grid "
                "never overwrites or deletes files it did not write, so nothing was written: choose a new or "
                "empty output_dir, or move those files away.")
        return {n for n in GRID_OUTPUTS + CLI_OUTPUTS if (root / n).is_file()} | \
            {f"runs/{e.name}" for e in runs.iterdir() if _RUN_FILE.fullmatch(e.name)}

    def check(self, *rels: str) -> None:
        """Refuse (before any work) if a file the grid would write is there and not the grid's."""
        for rel in rels:
            path = self.root / rel
            if os.path.lexists(path) and (rel not in self.files or path.is_symlink() or not path.is_file()):
                raise _refused(f"{path} is in the way: the grid would write {rel} in {self.root}, but that "
                               f"{'file' if path.is_file() else 'entry'} was not written by it ({GRID_MARKER} "
                               "does not list it); nothing was overwritten. Move it away or use another output_dir.")

    def create(self) -> "_GridDir":
        self.root.mkdir(parents=True, exist_ok=True)
        self._save()
        return self

    def claim(self, rel: str) -> Path:
        """The path to write ``rel`` at, recorded in the marker first (so a crash keeps it the grid's)."""
        self.check(rel)
        if rel not in self.files:
            self.files.add(rel)
            self._save()
        return self.root / rel

    def _save(self) -> None:
        tmp = self.root / (GRID_MARKER + ".tmp")
        tmp.write_text(json.dumps({"format": _GRID_FORMAT, "version": _GRID_VERSION, "files": sorted(self.files)},
                                  indent=2) + "\n", encoding="utf-8")
        tmp.replace(self.root / GRID_MARKER)
