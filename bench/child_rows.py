"""What a benchmark's child processes leave behind: their rows (JSON Lines) and, when one dies before
writing its row, the line of its log that says why. Standard library only: the parents that read these
(bench_step, bench_trl_step, bench_memory) import no torch before their children start."""

from __future__ import annotations

import json
from pathlib import Path


def read_rows(path: Path) -> list[dict]:
    """The rows of a JSON Lines file, [] when it does not exist (no child wrote one)."""
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def crash_line(log_path: Path) -> str:
    """The last line of a dead child's log that mentions an error (else its last line), at most 300
    characters: the ``error`` of the row written in its place."""
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    last = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
    return last.strip()[:300]
