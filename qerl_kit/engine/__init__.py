"""Our GPU decode path, under ``qerl_kit.rollout.StaticEngine``: the model's modules run with a
static KV cache (``decoder``), the fused decode step (``fast``) and on-device sampling (``sampler``).

Nothing here knows about rollouts, prompts or engines; ``qerl_kit.rollout.static`` drives it.
See docs/rollout.md for how a call runs and for measured speed.
"""

from qerl_kit.engine.decoder import Decoder, KVCache, unsupported_layout
from qerl_kit.engine.sampler import process_logits, sample

__all__ = ["Decoder", "KVCache", "unsupported_layout", "process_logits", "sample"]
