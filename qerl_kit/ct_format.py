"""The compressed-tensors ``nvfp4-pack-quantized`` on-disk format: config, tensor names, shards.

What vLLM (``CompressedTensorsW4A16Fp4``) and llm-compressor read and write, without needing
compressed-tensors installed:

* per quantized Linear ``<m>``: ``<m>.weight_packed`` uint8 [out, in/2], ``<m>.weight_scale``
  float8_e4m3fn [out, in/16], ``<m>.weight_global_scale`` float32 [1], ``<m>.bias`` unchanged;
  ``<m>.weight`` is absent. Everything else (embeddings, norms, ``lm_head``) keeps its ``.weight``.
* ``config.json`` carries ``quantization_config`` (``nvfp4a16_quantization_config``): one config
  group targeting ``Linear`` with 4-bit float weights, ``tensor_group`` strategy, group size 16,
  symmetric, and ``input_activations: null``, which is what vLLM matches as weight-only FP4.
* weights in ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` shards plus
  ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {...}}``).

Everything written here is deterministic: JSON with sorted keys, fixed safetensors metadata.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

from qerl_kit import file_writes
from qerl_kit.config_types import short_repr

FORMAT = "nvfp4-pack-quantized"
QUANT_METHOD = "compressed-tensors"
PACKED, SCALE, GLOBAL_SCALE = "weight_packed", "weight_scale", "weight_global_scale"
# Our NVFP4Linear buffer -> the compressed-tensors tensor name.
BUFFER_TO_CT = {"packed": PACKED, "scales": SCALE, "global_scale": GLOBAL_SCALE, "bias": "bias"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_METADATA = {"format": "pt"}
# The version written when compressed-tensors is not installed (the format is the same since 0.9).
FALLBACK_CT_VERSION = "0.12.2"


def compressed_tensors_version() -> str:
    """The installed compressed-tensors version (written into the config, as llm-compressor does)."""
    from importlib import metadata

    try:
        return metadata.version("compressed-tensors")
    except metadata.PackageNotFoundError:
        return FALLBACK_CT_VERSION


def nvfp4a16_quantization_config(ignore: Iterable[str], version: str | None = None) -> dict:
    """The ``quantization_config`` of a weight-only NVFP4 (NVFP4A16) compressed-tensors checkpoint."""
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
               "group_size": 16, "dynamic": False, "scale_dtype": "torch.float8_e4m3fn",
               "zp_dtype": None, "actorder": None, "block_structure": None,
               "observer": "memoryless_minmax", "observer_kwargs": {}}
    return {
        "quant_method": QUANT_METHOD,
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "format": FORMAT, "weights": weights,
                                      "input_activations": None, "output_activations": None}},
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": version or compressed_tensors_version(),
    }


def check_quantization_config(qcfg: Mapping | None) -> tuple[list[str], bool]:
    """Validate a checkpoint's ``quantization_config`` as NVFP4; returns (ignore, has_activation_quant).

    Raises a ValueError naming what differs for anything that is not compressed-tensors NVFP4
    (another method, another format, other bit widths or group sizes, asymmetric weights).
    """
    if not qcfg:
        raise ValueError("config.json has no quantization_config: this is not a quantized checkpoint "
                         "(load it with qerl_kit.models.load_model and quantize it instead)")
    method = qcfg.get("quant_method")
    if method != QUANT_METHOD:
        raise ValueError(f"quantization_config.quant_method is {method!r}; only {QUANT_METHOD!r} "
                         f"({FORMAT}) checkpoints load here")
    groups = qcfg.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config has no config_groups")
    act_quant = False
    for name, group in sorted(groups.items()):
        fmt = group.get("format") or qcfg.get("format")
        w = group.get("weights") or {}
        want = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}
        bad = {k: w.get(k) for k, v in want.items() if w.get(k) != v}
        if fmt != FORMAT or bad:
            raise ValueError(f"quantization_config group {name!r} is not NVFP4 ({FORMAT}, 4-bit float, "
                             f"tensor_group, group 16, symmetric): format={fmt!r}, differing={bad}")
        act_quant = act_quant or group.get("input_activations") is not None
    return list(qcfg.get("ignore") or []), act_quant


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "2GB" (10^9), "500MiB" (2^20) or "4096"."""
    if isinstance(size, bool) or not isinstance(size, (int, float, str)):  # True is not 1 byte
        raise ValueError(f"max_shard_size must be an int (bytes) or a size string such as '2GB'; got "
                         f"{short_repr(size)} ({type(size).__name__})")
    if isinstance(size, int):
        if size < 1:
            raise ValueError(f"max_shard_size must be positive; got {size}")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
    if not m:
        raise ValueError(f"max_shard_size: cannot parse size {short_repr(size)}; use an int or e.g. '2GB', '500MB', '1GiB'")
    unit = m.group(2).rstrip("B") or ""
    base = 1024 if unit.endswith("I") else 1000
    power = " KMGT".index(unit[:1] or " ")
    value = int(float(m.group(1)) * base ** power)
    if value < 1:
        raise ValueError(f"max_shard_size must be positive; got {size!r}")
    return value


def plan_shards(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Split tensors (in order) into shards of at most ``max_bytes``; a bigger tensor gets its own."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_json(path: Path, data) -> None:
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_safetensors(path: Path, tensors: Mapping[str, Callable[[], torch.Tensor]], sizes: Mapping[str, int],
                      max_shard_size: int | str) -> list[str]:
    """Write ``tensors`` (name -> a function producing the CPU tensor, so one shard at a time is in
    memory) as one file or shards plus an index. ``path`` must hold no weight files yet (the
    exporter writes into a fresh directory): an existing one is an error, never overwritten."""
    from safetensors.torch import save_file

    path = Path(path)
    existing = sorted(p.name for p in path.glob("model*.safetensors")) + ([INDEX_FILE] if (path / INDEX_FILE).exists() else [])
    if existing:
        raise FileExistsError(f"{path} already holds {', '.join(existing[:3])}; weights are written only into a "
                              "directory without them (qerl_kit.export.save_nvfp4 replaces an earlier export safely)")
    shards = plan_shards(((name, sizes[name]) for name in tensors), parse_size(max_shard_size))
    files = shard_names(len(shards))
    weight_map = {}
    for file, names in zip(files, shards):
        save_file({name: tensors[name]() for name in names}, str(path / file), metadata=SAFETENSORS_METADATA)
        file_writes.match_umask(path / file)  # save_file writes 0600; every other file gets the umask's mode
        weight_map.update({name: file for name in names})
    if len(files) > 1:
        write_json(path / INDEX_FILE, {"metadata": {"total_size": sum(sizes.values())},
                                       "weight_map": dict(sorted(weight_map.items()))})
    return files


def read_weight_map(path: Path) -> dict[str, str]:
    """name -> file for a checkpoint directory (from the index, or the single file's keys)."""
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        try:
            return dict(json.loads((path / INDEX_FILE).read_text(encoding="utf-8"))["weight_map"])
        except (ValueError, KeyError, TypeError) as err:  # bad JSON, no weight_map: named with the file
            raise ValueError(f"{path / INDEX_FILE} is not a safetensors index ({type(err).__name__}: "
                             f"{str(err)[:200]})") from None
    if (path / SINGLE_FILE).is_file():
        from safetensors import safe_open

        with safe_open(str(path / SINGLE_FILE), framework="pt") as f:
            return {name: SINGLE_FILE for name in f.keys()}
    raise FileNotFoundError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}")
