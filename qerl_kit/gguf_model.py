"""Real models from llama.cpp GGUF files: checked, then dequantized to a dense Hugging Face model.

``load_gguf("qwen2.5-coder-0.5b-instruct.gguf")`` returns ``(model, tokenizer)``: a normal
``transformers`` causal LM with ``nn.Linear`` layers in ``dtype`` (bf16 by default: GGUF's
Q4_K/Q5_0/Q6_K/Q8_0 blocks dequantized by ``transformers`` through the ``gguf`` package), the
file's tokenizer and chat template, and its head tied or untied as in the file (tied when the file
has no ``output.weight``). qerl_kit then quantizes it to its own format like any other model.

Before anything heavy, ``check_gguf_header`` (the first header fields, milliseconds) and then
``inspect_gguf`` (the whole header and tensor table, under a second) refuse, naming the file:
a missing path, a file that is not GGUF (magic bytes), a truncated or damaged file (a tensor ends
past the end of the file, or the header does not parse), and an architecture the rollout engine and
the quantizer were not built for (``SUPPORTED_ARCHITECTURES``).

The generation config's stop ids also get the chat template's turn end (``<|im_end|>`` for Qwen's
ChatML), so a chat completion stops at the end of its turn whatever the file calls its EOS.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from qerl_kit.finite import check_weights

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
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_WANTED = ("general.architecture", "general.name", "general.alignment")


def check_gguf_header(path: str | os.PathLike) -> str:
    """The file's architecture, read from its first key/value pairs in milliseconds; the errors of
    ``inspect_gguf`` for a missing file, a file that is not GGUF and an unsupported architecture
    (truncation inside the tensor data is found by ``inspect_gguf`` when the model loads)."""
    return _scan(Path(path), full=False)


def inspect_gguf(path: str | os.PathLike) -> GGUFInfo:
    """The whole header and tensor table of a GGUF file, checked (see the module docstring): a
    fraction of a second, skipping the vocabulary instead of decoding it; ``GGUFError`` names the file."""
    return _scan(Path(path), full=True)


class _Reader:
    """Reads a GGUF header from an open file: every read past the end of the file is a ``GGUFError``
    naming it as truncated or damaged."""

    def __init__(self, f, path: Path, size: int):
        self.f, self.size = f, size
        self.damaged = f"{str(path)!r}: truncated or damaged GGUF file"

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise GGUFError(f"{self.damaged} (its header ends at byte {self.f.tell():,}; copy it again and check "
                            "its sha256)")
        return data

    def unpack(self, fmt: str):
        import struct

        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt)))[0]

    def string(self) -> str:
        return self.take(self.unpack("Q")).decode("utf-8", "replace")

    def skip(self, n: int) -> None:
        if self.f.tell() + n > self.size:
            raise GGUFError(f"{self.damaged} (its header runs past the end of the file)")
        self.f.seek(n, 1)

    def value(self, kind: int, keep: bool):
        """A key's value of GGUF value type ``kind``: decoded if ``keep``, else skipped (None)."""
        if kind in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[kind]) if keep else self.skip(_SCALAR_SIZES[kind])
        if kind == 8:
            n = self.unpack("Q")
            return self.take(n).decode("utf-8", "replace") if keep else self.skip(n)
        if kind == 9:
            inner, count = self.unpack("I"), self.unpack("Q")
            if inner in _SCALAR_SIZES:
                return self.skip(_SCALAR_SIZES[inner] * count)
            for _ in range(count):
                self.value(inner, False)
            return None
        raise GGUFError(f"{self.damaged} (value type {kind})")


def _scan(path: Path, full: bool):
    """The architecture (``full=False``: the header's first keys only) or the whole checked ``GGUFInfo``."""
    if not path.exists():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    if not path.is_file():
        raise GGUFError(f"{str(path)!r} is not a file; a GGUF model is one .gguf file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != _MAGIC:
            raise GGUFError(f"{str(path)!r} is not a GGUF file (it starts with {magic!r}, not {_MAGIC!r})")
        reader = _Reader(f, path, size)
        reader.unpack("I")  # the format version: every version qerl_kit reads lays the header out alike
        n_tensors, n_kv = reader.unpack("Q"), reader.unpack("Q")
        meta = _read_meta(reader, path, n_kv, full)
        if not full:
            return meta["general.architecture"]
        tensors, types, end = _read_tensor_table(reader, n_tensors)
        align = meta.get("general.alignment") or 32
        data_start = -(-f.tell() // align) * align
    if data_start + end > size:
        raise GGUFError(f"{str(path)!r}: truncated GGUF file: its tensors end at byte {data_start + end:,} but the "
                        f"file has {size:,} bytes (copy it again and check its sha256)")
    return GGUFInfo(path=path, architecture=meta["general.architecture"], name=str(meta.get("general.name") or path.stem),
                    tensors=len(tensors), tied_head="output.weight" not in tensors, tensor_types=types, size_bytes=size)


def _read_meta(reader: _Reader, path: Path, n_kv: int, full: bool) -> dict:
    """The header's ``_WANTED`` keys (the others skipped), with a supported architecture; without
    ``full`` it stops at the architecture key."""
    meta: dict = {}
    for _ in range(n_kv):
        key = reader.string()
        kind = reader.unpack("I")
        meta[key] = reader.value(kind, key in _WANTED)
        if key == "general.architecture":
            _check_architecture(path, meta[key])
            if not full:
                return meta
    if "general.architecture" not in meta:
        raise GGUFError(f"{str(path)!r}: the GGUF header names no general.architecture")
    return meta


def _read_tensor_table(reader: _Reader, n_tensors: int) -> tuple[list[str], dict, int]:
    """(tensor names, GGML type name -> count, the end of the last tensor's data from the data start)."""
    import gguf

    tensors, types, end = [], {}, 0
    for _ in range(n_tensors):
        name = reader.string()
        dims = [reader.unpack("Q") for _ in range(reader.unpack("I"))]
        kind, offset = reader.unpack("I"), reader.unpack("Q")
        try:
            qtype = gguf.GGMLQuantizationType(kind)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFError(f"{reader.damaged} (tensor {name!r} has unknown type {kind})") from None
        elements = 1
        for d in dims:
            elements *= d
        tensors.append(name)
        types[qtype.name] = types.get(qtype.name, 0) + 1
        end = max(end, offset + elements // block * type_size)
    return tensors, types, end


def _check_architecture(path: Path, arch) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{str(path)!r}: architecture {arch!r} is not supported; qerl_kit runs "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, device: str | torch.device | None = None):
    """``(model, tokenizer)`` from a GGUF file: checked by ``inspect_gguf``, dequantized to ``dtype``,
    its weights finite (``finite.check_weights``: a NaN/inf tensor is named here, not seen later as
    empty completions)."""
    import warnings

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    info = inspect_gguf(path)
    folder, name = str(info.path.parent), info.path.name
    with one_parse():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its float32 advice is about keeping GGUF blocks; we dequantize
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype,
                                                             trust_remote_code=False, **_dequantize_kwargs(name))
        finally:
            hf_logging.set_verbosity(verbosity)
    _as_plain_dense(model, info)
    check_weights(model, str(info.path))
    if info.tied_head and model.get_output_embeddings() is not None:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    add_turn_end(model, tokenizer)
    if device is not None:
        model = model.to(device)
    model.gguf_info = info
    return model.eval(), tokenizer


@contextlib.contextmanager
def one_parse():
    """Inside the block ``gguf.GGUFReader(path)`` parses each file once: transformers builds a reader anew
    for the tokenizer, the config and the weights (three parses of the header and its vocabulary, about
    half of the real 0.5B's load on the CPU), and gets the first one again. Readers are read-only views
    of the file (a memmap), so sharing one changes nothing they return."""
    import gguf

    plain, readers = gguf.GGUFReader, {}

    class SharedReader(plain):
        def __new__(cls, path, mode="r"):
            key = (os.path.realpath(path), mode)
            if key not in readers:
                reader = readers[key] = object.__new__(cls)
                plain.__init__(reader, path, mode)
            return readers[key]

        def __init__(self, *args, **kwargs):  # parsed once, in __new__
            pass

    gguf.GGUFReader = SharedReader
    try:
        yield
    finally:
        gguf.GGUFReader = plain


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
    the ids now there (see ``qerl_kit.chat_tokens.chat_stop_ids``)."""
    from qerl_kit.chat_tokens import chat_stop_ids

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
