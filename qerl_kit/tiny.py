"""The tiny model the project ships: a Qwen2 causal LM trained on ``qerl_kit.tasks.arith``.

``load_tiny()`` returns ``(model, tokenizer)`` loaded from ``TINY_DIR`` (``qerl_kit/assets/tiny-arith``)
through ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``, offline and
with remote code off, exactly as a hub model would be; ``load_tiny(quantize="nvfp4")`` also
converts every linear layer but ``lm_head`` with ``qerl_kit.quantize.quantize_model``.

- Tokenizer: byte level without merges, built with the ``tokenizers`` library (``build_tokenizer``):
  one token per byte (every ASCII character, so every digit, is its own token), 256 of them, plus
  ``<|pad|>``, ``<|unk|>``, ``<|end|>`` (end of a turn, the EOS) and the role markers
  ``<|system|>``, ``<|user|>``, ``<|assistant|>``. No BOS. It uses Qwen2's pre-tokenizer because
  transformers 5 loads any ``qwen2`` checkpoint's tokenizer as ``Qwen2Tokenizer``, which rebuilds that
  pipeline from the vocabulary; a plain character vocabulary would lose spaces and newlines there.
  Its chat template is a minimal
  ChatML-like ``<|user|>\\n{content}<|end|>\\n<|assistant|>\\n``; ``qerl_kit.data.build_prompt``
  works with it, with or without the GSM8K instruction suffix (the model was trained on both).
- Model: ``Qwen2ForCausalLM`` (``tiny_config``): hidden 256, 4 layers, 4 query and 2 key/value heads
  of 64, MLP 768, tied embeddings, about 3.2 M parameters stored in bf16. Every projection has an
  input width divisible by 64, so all 28 of them quantize to NVFP4 (blocks of 16).
- Calibration (measured numbers in ``docs/tiny-model.md``): after NVFP4 quantization its greedy
  accuracy on the held-out split is 25% (level 1 right, levels 2-4 stop one step early), while a
  sample at temperature 1 is right 55% of the time and 8 samples include a right one for 99% of
  the problems: the gap RL closes.

Its accuracy (greedy or sampled, pass@k, by level) is measured with ``qerl_kit.evaluate.evaluate_task``
on the arithmetic Task: ``evaluate_task(make_task(), model, tok)``, ``result.by("level")``; the prompts it
answers are the task's (``qerl_kit.tasks.arith.PROMPT_SUFFIX``). This module sits in the model layer
and imports nothing of the tasks above it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["TINY_DIR", "SPECIAL_TOKENS", "CHAT_TEMPLATE", "build_tokenizer",
           "tiny_config", "load_tiny"]

TINY_DIR = Path(__file__).resolve().parent / "assets" / "tiny-arith"

PAD, UNK, EOS = "<|pad|>", "<|unk|>", "<|end|>"
ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, UNK, EOS) + ROLES
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer rebuilds exactly this pipeline).
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255 (" " -> "Ġ", "\\n" -> "Ċ"), in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def build_tokenizer():
    """The byte-level, merge-free tokenizer as a transformers fast tokenizer (left padding).

    It is Qwen2's pipeline (NFC, Qwen2 split, byte-level) with a vocabulary of the 6 special tokens
    and the 256 byte symbols and no merges, so every byte (every ASCII character, every digit) is
    one token. transformers 5 loads any ``qwen2`` checkpoint's tokenizer with ``Qwen2Tokenizer``,
    which rebuilds this pipeline from the vocabulary and merges: both give the same ids.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(_byte_symbols()))}
    assert len(vocab) == len(SPECIAL_TOKENS) + 256
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], dropout=None, unk_token=None,
                                continuing_subword_prefix="", end_of_word_suffix="",
                                fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, unk_token=UNK, eos_token=EOS,
                                  additional_special_tokens=list(ROLES), padding_side="left",
                                  clean_up_tokenization_spaces=False, model_max_length=512)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_config(tokenizer, **overrides):
    """The ``Qwen2Config`` of the shipped model (keyword overrides for experiments)."""
    from transformers import Qwen2Config

    spec = dict(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
                tie_word_embeddings=True, use_cache=True,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=None)
    spec.update(overrides)
    return Qwen2Config(**spec)


def load_tiny(path: str | os.PathLike | None = None, quantize: str | None = None,
              dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu"):
    """``(model, tokenizer)`` from the packaged directory (or ``path``), offline, remote code off.

    ``dtype`` is the compute dtype the bf16 weights are cast to (float32 by default, exact everywhere);
    ``quantize`` ("nvfp4", "mxfp4", "nf4") converts every linear layer but ``lm_head`` in place, and
    the quantization report is left on ``model.quant_report``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(path or TINY_DIR)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                 use_safetensors=True, trust_remote_code=False)
    model = model.to(device).eval()
    from qerl_kit.finite import check_weights

    check_weights(model, path)  # ``path`` may be any directory, not only the packaged one
    if quantize:
        from qerl_kit.quantize import quantize_model

        model.quant_report = quantize_model(model, fmt=quantize)
    return model, tok
