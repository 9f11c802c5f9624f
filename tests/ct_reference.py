"""compressed-tensors' own NVFP4 min-max path, as llm-compressor's memoryless observer drives it.

The oracle for bit-exactness: global scale from ``generate_gparam`` over the tensor's min/max,
block scales from ``calculate_qparams`` over each 16-element group's min/max (both in the
weight's dtype, as the observer computes them), codes from ``quantize_and_pack_fp4``, and
dequantization through ``NVFP4PackedCompressor.decompress``.
"""

import torch

ct = __import__("pytest").importorskip("compressed_tensors")
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

ARGS = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                        symmetric=True, dynamic=False, scale_dtype=torch.float8_e4m3fn)
SCHEME = QuantizationScheme(targets=["Linear"], weights=ARGS)


def ct_quantize(w: torch.Tensor, global_scale: torch.Tensor | None = None):
    """(packed uint8, scales fp8, global_scale fp32[1]) as compressed-tensors computes them."""
    if global_scale is None:
        global_scale = generate_gparam(w.amin(), w.amax())
    n, k = w.shape
    groups = w.reshape(n, k // 16, 16)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), ARGS, global_scale=global_scale)
    packed = quantize_and_pack_fp4(w, scale, global_scale=global_scale, group_size=16)
    return packed, scale.to(torch.float8_e4m3fn), global_scale


def ct_dequantize(packed, scales, global_scale) -> torch.Tensor:
    state = {"weight_packed": packed, "weight_scale": scales, "weight_global_scale": global_scale}
    return NVFP4PackedCompressor.decompress(state, SCHEME)["weight"]
