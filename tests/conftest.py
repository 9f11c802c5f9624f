"""Test-session settings: one intra-op thread by default.

The models in these tests are tiny; on a 2-core machine extra OpenMP threads only fight other
processes (measured: up to 10x slower). QERL_TEST_THREADS overrides.
"""

import os

import torch

torch.set_num_threads(int(os.environ.get("QERL_TEST_THREADS", "1")))
