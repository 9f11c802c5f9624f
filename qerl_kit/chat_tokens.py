"""The token a tokenizer's chat template ends an assistant turn with, read off the template itself.

``chat_stop_ids(tokenizer)`` is a stop id of every rollout engine (``qerl_kit.rollout.base.special_ids``)
and is added to a loaded model's generation config (``qerl_kit.gguf_model.add_turn_end``), so a
chat model stops at its turn end rather than writing the next turn. It needs only the tokenizer: it
sits in the model layer, below both users.
"""

from __future__ import annotations

from typing import Any


def chat_stop_ids(tokenizer: Any) -> list[int]:
    """The special token that ends an assistant turn in the tokenizer's chat template (``<|im_end|>``
    in Qwen's ChatML, ``<|eot_id|>`` in Llama 3), as a one-element list; [] without a template or
    when the turn ends in plain text. Read off the template itself: an assistant message is
    rendered and the first token after its content is taken if it is a special token."""
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        return []
    marker = "qerl-turn-marker"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}],
                                             tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render this pair has no turn end to read
        return []
    if not isinstance(text, str) or marker not in text:
        return []
    tail = text.split(marker, 1)[1]
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= {int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {})}
    return [int(ids[0])] if ids and int(ids[0]) in special else []
