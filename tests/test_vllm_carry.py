"""bench/vllm_carry.sh: the vLLM payload re-cut into pieces that fit one device call each."""

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "vllm_carry.sh"

pytestmark = pytest.mark.skipif(shutil.which("git") is None or shutil.which("split") is None,
                                reason="needs git and coreutils")


def _repo(tmp_path: Path, tracked_bytes: int, sizes=(5000, 5000, 2100)) -> tuple[Path, bytes]:
    """A git checkout with one tracked file of ``tracked_bytes`` and a fake .vllm/p1..p3 payload."""
    repo = tmp_path / "repo"
    (repo / ".vllm").mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / "big.bin").write_bytes(os.urandom(tracked_bytes))
    subprocess.run(["git", "add", "big.bin"], cwd=repo, check=True)
    payload = b""
    for i, (name, size) in enumerate(zip(["p1", "p2", "p3"], sizes)):
        d = repo / ".vllm" / name
        d.mkdir()
        chunk = os.urandom(size)
        (d / f"part_a{'abc'[i]}").write_bytes(chunk)
        payload += chunk
    (repo / ".vllm" / "p3" / "install.sh").write_text("echo install\n")
    return repo, payload


def _run(repo: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], cwd=repo, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **{k: str(v) for k, v in env.items()}})


def test_pieces_fit_the_carry_next_to_the_tracked_files_and_add_up(tmp_path):
    repo, payload = _repo(tmp_path, tracked_bytes=3000)
    proc = _run(repo, CARRY_LIMIT=8000, RESERVE=500)  # room: 8000 - 3000 - 500 = 4500 per piece
    assert proc.returncode == 0, proc.stderr
    pieces = sorted((repo / ".vllm").glob("q*/part_*"), key=lambda p: p.parent.name)
    assert [p.parent.name for p in pieces] == ["q1", "q2", "q3"]  # 12100 bytes / 4500 -> 3 pieces
    assert all(p.stat().st_size <= 4500 for p in pieces)
    assert b"".join(p.read_bytes() for p in pieces) == payload
    assert sorted(p.name for p in pieces) == [p.name for p in pieces]  # install.sh cats part_* in order
    assert (repo / ".vllm" / "q3" / "install.sh").exists() and not (repo / ".vllm" / "q1" / "install.sh").exists()
    assert hashlib.sha256(payload).hexdigest() in proc.stdout
    assert "call 3" in proc.stdout and "install.sh" in proc.stdout.splitlines()[-1]
    assert sorted(p.name for p in (repo / ".vllm").iterdir()) == ["p1", "p2", "p3", "q1", "q2", "q3"]


def test_a_smaller_room_gives_more_pieces_and_replaces_the_earlier_cut(tmp_path):
    repo, payload = _repo(tmp_path, tracked_bytes=3000)
    assert _run(repo, CARRY_LIMIT=8000, RESERVE=500).returncode == 0
    proc = _run(repo, CARRY_LIMIT=6000, RESERVE=500)  # room 2500 -> 5 pieces
    assert proc.returncode == 0, proc.stderr
    qs = sorted(p.name for p in (repo / ".vllm").glob("q*"))
    assert qs == ["q1", "q2", "q3", "q4", "q5"]
    assert b"".join((repo / ".vllm" / q).joinpath(n).read_bytes()
                    for q in qs for n in sorted(os.listdir(repo / ".vllm" / q)) if n.startswith("part_")) == payload


def test_it_refuses_to_touch_a_q_folder_with_other_files_and_when_there_is_no_room(tmp_path):
    repo, _ = _repo(tmp_path, tracked_bytes=3000)
    keep = repo / ".vllm" / "q2" / "notes.txt"
    keep.parent.mkdir()
    keep.write_text("mine")
    proc = _run(repo, CARRY_LIMIT=8000, RESERVE=500)
    assert proc.returncode == 2 and "not touched" in proc.stderr and keep.read_text() == "mine"
    assert not (repo / ".vllm" / "q1").exists()  # nothing written before the refusal
    keep.unlink()
    proc = _run(repo, CARRY_LIMIT=3200, RESERVE=500)
    assert proc.returncode == 2 and "no room" in proc.stderr


def test_it_says_what_to_run_when_the_payload_is_missing(tmp_path):
    repo, _ = _repo(tmp_path, tracked_bytes=10)
    shutil.rmtree(repo / ".vllm" / "p2")
    proc = _run(repo)
    assert proc.returncode == 2 and "vllm-wheels-h200.sh" in proc.stderr
