"""Probe humming-kernels on the GPU before building on it (one process per humming version).

What it answers, for the installed humming version:
* does a ``HummingLayer`` built from qerl_kit's own NVFP4 tensors (compressed-tensors schema,
  ``nvfp4-pack-quantized``) compute our function (relative error against the fp32 reference)?
* how long does the first call of a layer shape take (JIT), and a second shape, and a second
  layer of an already-compiled shape?
* the ``configs`` tensor ``prepare_kernels`` returns (M intervals -> kernel ids);
* per-call CPU cost, eager, 200 back-to-back calls at M = 8: ``layer(x)``, the raw
  ``torch.ops.humming.launch_kernel`` with cached configs, bf16 ``F.linear``;
* the raw launch gives the same bits as ``layer(x)``, also inside a CUDA graph;
* what the on-disk cache holds afterwards (size), so it can be carried to a later machine.

    python -m lab.probe_humming --out $OUT/probe.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import time

import torch
import torch.nn.functional as F

from bench.bench_routes import per_call_us
from qerl_kit import nvfp4
from qerl_kit.kernels.reference import nvfp4_linear_ref

CT = dict(quant_method="compressed-tensors", format="nvfp4-pack-quantized", type="float", num_bits=4,
          strategy="tensor_group", group_size=16, symmetric=True)


def weights(n, k):
    w = torch.randn(n, k, device="cuda") * 0.02
    q = nvfp4.quantize(w)
    return q.packed, q.scales, q.global_scale


def build(packed, scales, gs, dtype=torch.bfloat16):
    from humming.layer import HummingLayer

    n, k = packed.shape[0], packed.shape[1] * 2
    with torch.device(packed.device):
        layer = HummingLayer(shape_n=n, shape_k=k, weight_config=dict(CT), torch_dtype=dtype)
    layer.load_from_tensors({"weight_packed": packed, "weight_scale": scales,
                             "weight_global_scale": gs.reshape(1).float()})
    layer.transform()
    return layer


def raw_launcher(layer, version):
    """(configs, fn(x) -> y) through the raw op, for this humming version."""
    from humming.kernel.humming import HummingKernel

    if hasattr(layer, "humming_config") and layer.humming_config is not None:  # >= 0.1.1x
        cfg = layer.humming_config.to_str()
        configs = HummingKernel.prepare_kernels(cfg, None, None, layer.weight.device)
        ws2 = getattr(layer, "weight_scale_2", None)
        op = torch.ops.humming.launch_kernel.default

        def fn(x):
            return op(configs, x, layer.weight, layer.weight_scale, ws2, None, None, None, None, None,
                      None, None, None, None, layer.locks, 1, 0)
    else:  # 0.1.10
        meta = layer.humming_metas[""]
        configs = HummingKernel.prepare_kernels(meta.to_str(), None, None)
        gsc = getattr(layer, meta.global_scale_name, None)
        op = torch.ops.humming.launch_kernel

        def fn(x):
            return op(configs, x, layer.weight, None, None, layer.weight_scale, None, None, gsc,
                      None, None, None, None, layer.locks, 1, 0)
    return configs, fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    res = {"version": importlib.metadata.version("humming-kernels"), "torch": torch.__version__}
    t0 = time.perf_counter()
    import humming  # noqa: F401
    from humming.layer import HummingLayer  # noqa: F401
    res["import_s"] = time.perf_counter() - t0
    print(res, flush=True)
    shapes = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]
    res["shapes"] = {}
    for n, k in shapes:
        r = {}
        try:
            p, s, g = weights(n, k)
            t0 = time.perf_counter()
            layer = build(p, s, g)
            torch.cuda.synchronize()
            r["build_s"] = time.perf_counter() - t0
            x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
            t0 = time.perf_counter()
            y = layer(x)
            torch.cuda.synchronize()
            r["first_call_s"] = time.perf_counter() - t0
            errs = {}
            for m in (1, 3, 8, 33, 64, 100, 256, 2048):
                xm = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                t0 = time.perf_counter()
                ym = layer(xm).float()
                torch.cuda.synchronize()
                ref = nvfp4_linear_ref(xm.float(), p, s, g)
                errs[m] = [((ym - ref).norm() / ref.norm()).item(), time.perf_counter() - t0]
            r["rel_err_and_s"] = errs
            t0 = time.perf_counter()
            layer2 = build(*weights(n, k))
            layer2(x)
            torch.cuda.synchronize()
            r["second_layer_same_shape_s"] = time.perf_counter() - t0
            configs, fn = raw_launcher(layer, res["version"])
            r["configs"] = configs.tolist()
            y_raw = fn(x)
            r["raw_equal"] = bool(torch.equal(y_raw, y))
            r["tensors"] = {name: [list(t.shape), str(t.dtype)] for name, t in layer.state_dict().items()}
            # bias: does adding it after cost a launch only
            if (n, k) == shapes[0]:
                w_dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                r["eager_us"] = {"layer": per_call_us(lambda: layer(x)), "raw": per_call_us(lambda: fn(x)),
                                 "F.linear": per_call_us(lambda: F.linear(x, w_dense))}
                # graph capture of the raw launch
                static_x = x.clone()
                s_ = torch.cuda.Stream()
                s_.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s_):
                    fn(static_x)
                torch.cuda.current_stream().wait_stream(s_)
                g_ = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g_):
                    y_g = fn(static_x)
                static_x.copy_(torch.randn_like(static_x))
                g_.replay()
                torch.cuda.synchronize()
                r["graph_equal"] = bool(torch.equal(y_g, fn(static_x)))
                # non-contiguous / 3-D inputs
                try:
                    x3 = torch.randn(2, 4, k, device="cuda", dtype=torch.bfloat16)
                    r["3d_ok"] = bool(torch.equal(layer(x3.reshape(8, k)), fn(x3.reshape(8, k))))
                except Exception as e:  # noqa: BLE001
                    r["3d_ok"] = repr(e)[:300]
                try:
                    xs = torch.randn(8, 2 * k, device="cuda", dtype=torch.bfloat16)[:, :k]
                    r["strided_x"] = ((fn(xs).float() - nvfp4_linear_ref(xs.float(), p, s, g)).norm()
                                      / nvfp4_linear_ref(xs.float(), p, s, g).norm()).item()
                except Exception as e:  # noqa: BLE001
                    r["strided_x"] = repr(e)[:300]
                try:
                    xh = torch.randn(8, k, device="cuda", dtype=torch.float16)
                    lh = build(p, s, g, torch.float16)
                    yh = lh(xh).float()
                    ref = nvfp4_linear_ref(xh.float(), p, s, g)
                    r["fp16_err"] = ((yh - ref).norm() / ref.norm()).item()
                except Exception as e:  # noqa: BLE001
                    r["fp16_err"] = repr(e)[:300]
                r["weight_bytes_ours"] = p.numel() + s.numel() + 4
                r["weight_bytes_humming"] = sum(t.numel() * t.element_size() for t in layer.state_dict().values())
            del layer, layer2
        except Exception as e:  # noqa: BLE001
            import traceback
            r["error"] = traceback.format_exc()[-3000:]
        res["shapes"][f"{n}x{k}"] = r
        print(f"{n}x{k}", json.dumps(r)[:1500], flush=True)
        torch.cuda.empty_cache()
    cache = os.environ.get("HUMMING_CACHE_DIR", os.path.expanduser("~/.humming/cache"))
    total = 0
    for root, _, files in os.walk(cache):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    res["cache_dir"], res["cache_bytes"] = cache, total
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "shapes"}))


if __name__ == "__main__":
    main()
