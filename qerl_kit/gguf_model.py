"""Real models from llama.cpp GGUF files: checked, then dequantized to a dense Hugging Face model.

``load_gguf("qwen2.5-coder-0.5b-instruct.gguf")`` returns ``(model, tokenizer)``: a normal
``transformers`` causal LM with ``nn.Linear`` layers in ``dtype`` (bf16 by default: GGUF's
Q4_K/Q5_0/Q6_K/Q8_0 blocks dequantized by ``transformers`` through the ``gguf`` package), the
file's tokenizer and chat template, and its head tied or untied as in the file (tied when the file
has no ``output.weight``). qerl_kit then quantizes it to its own format like any other model.

Before anything heavy, ``check_gguf_header`` (milliseconds) and then ``inspect_gguf`` (the whole
header and tensor table, seconds) refuse, naming the file:
a missing path, a file that is not GGUF (magic bytes), a truncated or damaged file (a tensor ends
past the end of the file, or the header does not parse), and an architecture the rollout engine and
the quantizer were not built for (``SUPPORTED_ARCHITECTURES``).

The generation config's stop ids also get the chat template's turn end (``<|im_end|>`` for Qwen's
ChatML), so a chat completion stops at the end of its turn whatever the file calls its EOS.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["GGUFError", "GGUFInfo", "SUPPORTED_ARCHITECTURES", "check_gguf_header", "inspect_gguf", "load_gguf",
           "is_gguf_path"]

# Architectures whose transformers classes qerl_kit's engine, quantizer and AQN were built and
# tested on (qerl_kit.models presets); transformers reads more, which we would not run correctly.
SUPPORTED_ARCHITECTURES = ("qwen2", "qwen3", "llama")
_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """A GGUF file that cannot be loaded: the message names the file and what is supported."""


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    architecture: str
    name: str
    tensors: int
    tied_head: bool             # no output.weight: the head shares token_embd.weight
    tensor_types: dict          # GGML type name -> count (F32, Q4_K, ...)
    size_bytes: int


def is_gguf_path(name: str | os.PathLike) -> bool:
    """Whether ``name`` is meant as a GGUF file (its suffix), existing or not."""
    return str(name).lower().endswith(".gguf")


# GGUF value types (gguf-py's GGUFValueType): fixed sizes of the scalar ones; 8 = string, 9 = array
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def check_gguf_header(path: str | os.PathLike) -> str:
    """The file's architecture, read from its first key/value pairs in milliseconds (a full
    ``inspect_gguf`` parses the whole vocabulary: seconds); the same errors as ``inspect_gguf`` for a
    missing file, a file that is not GGUF and an unsupported architecture. Truncation inside the
    tensor data is found by ``inspect_gguf`` when the model loads."""
    import struct

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    if not path.is_file():
        raise GGUFError(f"{str(path)!r} is not a file; a GGUF model is one .gguf file")
    with open(path, "rb") as f:
        def take(n: int) -> bytes:
            data = f.read(n)
            if len(data) != n:
                raise GGUFError(f"{str(path)!r}: truncated or damaged GGUF file (its header ends early)")
            return data

        magic = f.read(4)
        if magic != _MAGIC:
            raise GGUFError(f"{str(path)!r} is not a GGUF file (it starts with {magic!r}, not {_MAGIC!r})")
        _version, _tensors, kv_count = struct.unpack("<IQQ", take(20))

        def skip(kind: int) -> None:
            if kind in _SCALAR_SIZES:
                take(_SCALAR_SIZES[kind])
            elif kind == 8:
                take(struct.unpack("<Q", take(8))[0])
            elif kind == 9:
                inner, count = struct.unpack("<IQ", take(12))
                if inner in _SCALAR_SIZES:
                    take(_SCALAR_SIZES[inner] * count)
                else:
                    for _ in range(count):
                        skip(inner)
            else:
                raise GGUFError(f"{str(path)!r}: damaged GGUF header (value type {kind})")

        for _ in range(min(kv_count, 64)):  # general.architecture comes first in llama.cpp's files
            key = take(struct.unpack("<Q", take(8))[0]).decode("utf-8", "replace")
            kind = struct.unpack("<I", take(4))[0]
            if key == "general.architecture" and kind == 8:
                arch = take(struct.unpack("<Q", take(8))[0]).decode("utf-8", "replace")
                if arch not in SUPPORTED_ARCHITECTURES:
                    raise GGUFError(f"{str(path)!r}: architecture {arch!r} is not supported; qerl_kit runs "
                                    f"{', '.join(SUPPORTED_ARCHITECTURES)}")
                return arch
            skip(kind)
    raise GGUFError(f"{str(path)!r}: the GGUF header names no general.architecture")


def inspect_gguf(path: str | os.PathLike) -> GGUFInfo:
    """The header of a GGUF file, checked (see the module docstring); ``GGUFError`` names the file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    if not path.is_file():
        raise GGUFError(f"{str(path)!r} is not a file; a GGUF model is one .gguf file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != _MAGIC:
        raise GGUFError(f"{str(path)!r} is not a GGUF file (it starts with {magic!r}, not {_MAGIC!r})")
    try:
        import gguf
    except ImportError as e:  # a declared dependency; only a broken install gets here
        raise ImportError("reading .gguf files needs the `gguf` package: `pip install gguf`") from e
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - the reader raises many kinds on a damaged header
        raise GGUFError(f"{str(path)!r}: truncated or damaged GGUF file ({type(e).__name__}: {e})"[:500]) from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise GGUFError(f"{str(path)!r}: truncated GGUF file: its tensors end at byte {end:,} but the file has "
                        f"{size:,} bytes (copy it again and check its sha256)")
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{str(path)!r}: architecture {arch!r} is not supported; qerl_kit runs "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return GGUFInfo(path=path, architecture=arch, name=str(_field(reader, "general.name", default=path.stem)),
                    tensors=len(names), tied_head="output.weight" not in names, tensor_types=types,
                    size_bytes=size)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is not None:
            return default
        raise GGUFError(f"{reader.data.filename if hasattr(reader.data, 'filename') else 'GGUF file'}: "
                        f"header has no {key!r}")
    return field.contents()


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, device: str | torch.device | None = None):
    """``(model, tokenizer)`` from a GGUF file: checked by ``inspect_gguf``, dequantized to ``dtype``."""
    import warnings

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    info = inspect_gguf(path)
    folder, name = str(info.path.parent), info.path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its float32 advice is about keeping GGUF blocks; we dequantize
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype, trust_remote_code=False,
                                                         **_dequantize_kwargs(name))
    finally:
        hf_logging.set_verbosity(verbosity)
    _as_plain_dense(model, info)
    if info.tied_head and model.get_output_embeddings() is not None:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    add_turn_end(model, tokenizer)
    if device is not None:
        model = model.to(device)
    model.gguf_info = info
    return model.eval(), tokenizer


def _dequantize_kwargs(name: str) -> dict:
    """Ask transformers for a dense model: newer releases (>= 5.2x) can keep GGUF blocks packed in
    their own layers when a kernel is installed; qerl_kit quantizes dense layers itself."""
    try:
        from transformers import GgufConfig
    except ImportError:  # older releases always dequantize
        return {}
    return {"quantization_config": GgufConfig(gguf_file=name, dequantize=True)}


def _as_plain_dense(model, info: GGUFInfo) -> None:
    """Check that every weight was dequantized, and drop the GGUF quantizer transformers attaches
    (it marks the model unserializable and "quantized", which it no longer is)."""
    packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()})
    if packed:
        raise GGUFError(f"{str(info.path)!r}: transformers kept GGUF layers {packed} packed; qerl_kit needs the "
                        "weights dequantized (upgrade or downgrade transformers, or convert the file first)")
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    for obj in (model, model.config):
        if "quantization_config" in getattr(obj, "__dict__", {}):
            del obj.__dict__["quantization_config"]
    if "is_quantized" in model.__dict__:
        model.is_quantized = False


def add_turn_end(model, tokenizer) -> list[int]:
    """Add the chat template's turn-end token to ``model.generation_config.eos_token_id``; returns
    the ids now there (see ``qerl_kit.rollout.base.chat_stop_ids``)."""
    from qerl_kit.rollout.base import chat_stop_ids

    config = getattr(model, "generation_config", None)
    if config is None:
        return []
    eos = config.eos_token_id
    ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    eos_tok = getattr(tokenizer, "eos_token_id", None)
    for extra in ([eos_tok] if eos_tok is not None else []) + chat_stop_ids(tokenizer):
        if int(extra) not in ids:
            ids.append(int(extra))
    config.eos_token_id = ids[0] if len(ids) == 1 else ids
    return ids
