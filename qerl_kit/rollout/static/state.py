"""The buffers one batch shape decodes on, and the CUDA graphs captured on them.

``DecodeState`` holds, for one (rows, prompt width, completion length) shape, the KV cache, the
tokens and positions fed at the next step, the device counters (cache slot, output column), the
per-row stop state and the output buffers. ``StaticEngine`` keeps one and reuses it while the shape
stays; ``front(rows)`` is a view of its first rows (live-row compaction decodes on it, with its own
graphs); ``release()`` drops the graphs now, outside any capture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from qerl_kit.rollout.static.decoder import KVCache

__all__ = ["DecodeState"]


@dataclass
class DecodeState:
    """Buffers for one (rows, prompt width, completion length) shape; graphs captured on them."""

    cache: KVCache
    tok: Tensor        # [R] the token fed at the next step
    pos: Tensor        # [R] its position id
    slot: Tensor       # [1] the cache column it is written to
    step: Tensor       # [1] the output column of the token sampled next
    done: Tensor       # [R] bool: row has emitted a stop token
    key_bias: Tensor   # [R, L] additive attention bias: 0 on keys a row may attend to, -inf elsewhere
    out_tok: Tensor    # [R, C]
    out_lp: Tensor     # [R, C] float32
    stop: Tensor       # [S] stop ids (at least one entry; -1 when there is none)
    stop_at: Tensor    # [R] long: a row's forced length (stop_after), a large value otherwise
    graphs: dict = field(default_factory=dict)
    forced: bool = False  # whether this call forces lengths (a Python flag: part of the graph key)
    pool: Any = None   # the memory pool this state's graphs share; it dies with them
    root: Any = None   # for a view: the state whose first rows it is (and whose pool its graphs use)
    views: dict = field(default_factory=dict)  # rows -> the view of this state's first rows

    def front(self, rows: int) -> "DecodeState":
        """The state of the first ``rows`` rows: views of these buffers (no copy), its own graphs."""
        if rows == self.tok.shape[0]:
            return self
        if rows not in self.views:
            self.views[rows] = DecodeState(
                cache=self.cache.front(rows),
                tok=self.tok[:rows], pos=self.pos[:rows], slot=self.slot, step=self.step, done=self.done[:rows],
                key_bias=self.key_bias[:rows], out_tok=self.out_tok[:rows], out_lp=self.out_lp[:rows], stop=self.stop,
                stop_at=self.stop_at[:rows], root=self)
        self.views[rows].forced = self.forced
        return self.views[rows]

    def release(self) -> None:
        """Drop this state's graphs and views now. A view points back at its root (``root``), so a
        dropped state is a reference cycle that only Python's cyclic GC frees, at a moment of its
        choosing; when that moment fell inside a later graph capture, destroying the old graphs
        there invalidated the capture (Trainer.evaluate() after 11-13 GRPO steps, issue #42)."""
        for view in self.views.values():
            view.graphs.clear()
            view.root = None
        self.views.clear()
        self.graphs.clear()
        self.pool = None

    def snapshot(self) -> dict[str, Tensor]:
        return {k: getattr(self, k).clone() for k in ("tok", "pos", "slot", "step", "done", "key_bias")}

    def load(self, snap: dict[str, Tensor]) -> None:
        for k, v in snap.items():
            getattr(self, k).copy_(v)
