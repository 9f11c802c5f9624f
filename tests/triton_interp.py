"""Running Triton kernel tests on a machine without a GPU, in Triton's CPU interpreter.

The interpreter must be switched on (``TRITON_INTERPRET=1``) before Triton is first imported. A
test module calls ``enable()`` at its top: if Triton is not imported yet it sets the variable and
the kernels run in that process. In a full test run other modules import Triton earlier (peft ->
torch._dynamo -> triton); then the module's tests skip and one test re-runs the whole module in a
subprocess with the variable set (``rerun_in_subprocess``). With CUDA the kernels run compiled.
This module must not import Triton.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def enable() -> bool:
    """True when the kernels can run in this process (CUDA, or the interpreter switched on in time)."""
    ready = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if not torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
        ready = True
    return torch.cuda.is_available() or ready


def rerun_in_subprocess(test_file: str, timeout: int = 900) -> None:
    """Run ``test_file``'s tests with pytest in a fresh interpreter process; assert they pass."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                          cwd=Path(test_file).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def skip_unless_runnable(request, in_process: bool, runner: str) -> None:
    """Skip a kernel test that cannot run in this process (Triton was imported before ``enable()``);
    the module's subprocess test, named ``runner``, runs it (``rerun_in_subprocess``)."""
    if not in_process and request.node.name != runner:
        pytest.skip(f"Triton was imported before TRITON_INTERPRET=1 could be set: {runner} runs these tests")
