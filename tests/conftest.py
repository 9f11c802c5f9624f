"""Test-session settings: one intra-op thread by default; Triton tile choices kept in the session.

The models in these tests are tiny; on a 2-core machine extra OpenMP threads only fight other
processes (measured: up to 10x slower). QERL_TEST_THREADS overrides. The Triton kernels' tile
choices (qerl_kit.kernels.tuning) go to a file of this session, not the user's
~/.cache/qerl_kit/autotune.json, unless QERL_AUTOTUNE_CACHE names one.
"""

import os
import tempfile

import pytest
import torch

torch.set_num_threads(int(os.environ.get("QERL_TEST_THREADS", "1")))
os.environ.setdefault("QERL_AUTOTUNE_CACHE", os.path.join(tempfile.mkdtemp(prefix="qerl-autotune-"), "autotune.json"))


@pytest.fixture
def one_thread():
    """One intra-op thread for a test even if something before it changed the count (the demo and
    the notebooks set their own); restored afterwards. Modules use it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
