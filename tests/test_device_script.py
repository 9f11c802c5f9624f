"""bench/device.sh, the one device script: every command its header lists is one of its case arms
and back, and an unknown command is refused with status 2, naming where the list is."""
import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "device.sh"


def header_commands(text: str) -> set[str]:
    """Commands named in the header: comment lines '#   name ARGS   what it does'."""
    head = text.split("set -uo pipefail", 1)[0]
    return {m.group(1) for m in re.finditer(r"^#   ([a-z0-9][a-z0-9-]*)(?: |$)", head, re.M)} - {"mkdir", "python3"}


def case_commands(text: str) -> set[str]:
    body = text.split('case "$cmd" in', 1)[1]
    return {m.group(1) for m in re.finditer(r"^([a-z0-9][a-z0-9-]*)\)", body, re.M)}


def test_header_lists_exactly_the_commands():
    text = SCRIPT.read_text()
    cases = case_commands(text)
    assert {"engine7b", "vllm", "grpo-engines", "cdgrid", "model-piece", "real-eval"} <= cases
    assert header_commands(text) == cases


def test_unknown_command_is_refused(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "no-such-command"], cwd=tmp_path, capture_output=True,
                          text=True, env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode == 2
    assert "unknown command no-such-command" in proc.stderr and "bench/device.sh" in proc.stderr


def test_out_is_required(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "engine7b"], cwd=tmp_path, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode != 0 and "OUT" in proc.stderr
