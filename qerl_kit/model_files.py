"""A model directory's files, checked before anything slow: its config.json, tokenizer and weights.

``read_model_config`` reads config.json (a positive int for every size key), ``check_tokenizer_files``
asks for a tokenizer vocabulary, ``check_weight_files`` opens every safetensors header, and
``is_nvfp4_checkpoint`` tells a compressed-tensors export (``qerl_kit.export``) from a plain model. A
problem is a ``ModelSourceError`` naming the file (and key). ``qerl_kit.models`` (which loads models)
and ``qerl_kit.export`` (which loads its exports) both use them; ``qerl_kit.models`` names them too.
"""

from __future__ import annotations

import os
from pathlib import Path

from qerl_kit.config_types import short_repr


class ModelSourceError(FileNotFoundError, ValueError):
    """A model name that names nothing loadable (a missing path, a mistyped preset, a file that is not
    .gguf, a hub id that cannot be fetched). A FileNotFoundError (``qerl`` prints it as one line) and a
    ValueError (a bad argument)."""


# A model directory's tokenizer is read from one of these (tokenizer_config.json alone holds no vocabulary).
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
# config.json keys that size the model: each must be a positive int where present (-1 is no size).
_SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings")


def read_model_config(path: str | os.PathLike) -> dict:
    """A model directory's config.json as a dict; a missing file, bad JSON, a non-object or a size key
    (``vocab_size`` ...) that is not a positive int is a ``ModelSourceError`` naming the file (and key)."""
    import json

    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelSourceError(f"{short_repr(str(file), 300)} is missing: {short_repr(str(path), 300)} is not a "
                               "model directory") from None
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise ModelSourceError(f"{short_repr(str(file), 300)} is not valid JSON ({str(err)[:120]})") from None
    if not isinstance(raw, dict):
        raise ModelSourceError(f"{short_repr(str(file), 300)} must hold a JSON object; got {type(raw).__name__}")
    for key in _SIZE_KEYS:
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ModelSourceError(f"{short_repr(str(file), 300)}: {key} must be a positive int; got {short_repr(value)}")
    return raw


def check_tokenizer_files(path: str | os.PathLike) -> None:
    """A model directory must hold its tokenizer (one of ``TOKENIZER_VOCAB_FILES``): without one,
    transformers makes up a tokenizer that encodes every prompt to no tokens."""
    if not any((Path(path) / name).is_file() for name in TOKENIZER_VOCAB_FILES):
        raise ModelSourceError(f"model {short_repr(str(path), 300)}: the directory has no tokenizer (none of "
                               f"{', '.join(TOKENIZER_VOCAB_FILES)}); copy the tokenizer files of the model it "
                               "came from into it")


def check_weight_files(path: str | os.PathLike) -> None:
    """Every ``*.safetensors`` file of a model directory opens (its header is whole): a truncated
    file is a ``ModelSourceError`` naming it, not safetensors' message without a path."""
    from safetensors import safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error type
            raise ModelSourceError(f"{short_repr(str(file), 300)} cannot be read ({type(err).__name__}: {str(err)[:200]}): "
                                   "the file is damaged or truncated") from err


def is_nvfp4_checkpoint(config: dict) -> bool:
    """Whether a config.json (``read_model_config``) is a compressed-tensors checkpoint, which
    ``qerl_kit.export.load_nvfp4`` loads (``save_nvfp4`` and ``qerl quantize --out`` write them)."""
    qcfg = config.get("quantization_config")
    return isinstance(qcfg, dict) and qcfg.get("quant_method") == "compressed-tensors"
