"""The repository's promises about itself: README commands, CI, environment.yml vs pyproject."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_readme_quick_start_has_exactly_two_commands():
    assert _quick_start_commands() == ["./run demo", "./run test"]


def test_ci_calls_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in ci.splitlines() if line.strip() and not line.startswith("#")]
    assert "./run test" in commands
    assert "set -euo pipefail" in commands  # a failing test fails CI


def _names(reqs) -> set[str]:
    return {re.split(r"[<>=!\[ ]", r.strip(), maxsplit=1)[0].lower() for r in reqs}


def test_environment_yml_agrees_with_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = {r for r in project["dependencies"]}
    for extra in ("dev", "notebook", "rewards"):
        wanted |= set(extras[extra])
    wanted |= {r for r in extras["gpu"] if r.startswith("humming-kernels")}  # the NVFP4 GEMMs on a GPU
    env = (ROOT / "environment.yml").read_text()
    pip_section = env.split("- pip:", 1)[1]
    pip_reqs = {m.group(1).strip() for m in re.finditer(r"^\s+- ([A-Za-z][^\n]*)$", pip_section, re.M)}
    assert _names(pip_reqs) == _names(wanted)
    # same version floors where both name a package
    floors = {re.split(r"[<>=]", r)[0].lower(): r for r in wanted}
    for req in pip_reqs:
        assert floors[_names([req]).pop()] == req


def test_torch_is_not_pinned_to_a_cuda_build():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_req = [r for r in project["dependencies"] if r.startswith("torch")]
    assert torch_req == ["torch>=2.4"]  # 2.13.0 (CPU, on disk) satisfies it; GPUs get CUDA builds
    run = (ROOT / "run").read_text()
    assert 'pip install -q "torch==2.13.0"' in run and "nvidia-smi" in run


def _run_test_command(tmp_path, *args) -> str:
    """What ``./run test ARGS`` executes, through a stand-in venv whose python prints its arguments
    (the install stamp is current, so nothing is installed)."""
    import hashlib
    import os
    import subprocess

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    python = venv / "bin" / "python"
    python.write_text('#!/bin/sh\necho "$@"\n')
    python.chmod(0o755)
    stamp = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (ROOT / "run").read_bytes()).hexdigest()[:16]
    (venv / ".qerl-test").write_text(stamp + "\n")
    env = {**os.environ, "QERL_VENV": str(venv), "QERL_NO_APT": "1"}
    done = subprocess.run(["bash", str(ROOT / "run"), "test", *args], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_run_test_leaves_the_slow_tests_to_run_test_all(tmp_path):
    """CI's ``./run test`` deselects the tests marked slow; ``./run test --all`` runs every test."""
    assert _run_test_command(tmp_path) == "-m pytest -m not slow"
    assert _run_test_command(tmp_path, "-x", "tests/test_demo.py") == "-m pytest -m not slow -x tests/test_demo.py"
    assert _run_test_command(tmp_path, "--all") == "-m pytest"
    assert _run_test_command(tmp_path, "--all", "-k", "demo") == "-m pytest -k demo"
