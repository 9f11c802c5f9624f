"""The static engine: ``StaticEngine``, our GPU rollout backend, and the decode path it drives.

* ``engine``: ``StaticEngine`` (the rollout interface: batches, prefill, the decode loop, CUDA
  graphs, live-row compaction); ``state``: the buffers one batch shape decodes on;
* ``decoder``: the model's own modules run with a static KV cache (``Decoder``, ``KVCache``);
* ``fast``: the fused decode step (``FusedPlan``), on the engine's own concatenated weights;
* ``fused``: its elementwise kernels with their references (``fused_kernels``: the Triton code);
* ``sampler``: sampling on the device (``process_logits``, ``sample``).

The engine leaves the model it is given as it found it: it reads the model's tensors and never
writes to them (tests/test_engine.py proves it on the state dict, buffers and module attributes).
See docs/rollout.md for how a call runs and for measured speed.
"""

from qerl_kit.rollout.static.decoder import Decoder, KVCache, unsupported_layout
from qerl_kit.rollout.static.engine import StaticEngine
from qerl_kit.rollout.static.sampler import process_logits, sample

__all__ = ["StaticEngine", "Decoder", "KVCache", "unsupported_layout", "process_logits", "sample"]
