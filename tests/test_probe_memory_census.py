"""bench.probe_memory_census: the tensor walk names each storage once, folds layer numbers, and the
allocation sites group a snapshot's live blocks by the first frames of our code."""
import torch
from torch import nn

from bench import probe_memory_census as pmc


class _Holder:  # a qerl_kit-like object the walk enters (its module is checked by name)
    pass


_Holder.__module__ = "qerl_kit.fake"


def test_the_walk_counts_a_shared_storage_once_and_folds_layer_numbers():
    layers = nn.ModuleList(nn.Linear(8, 4, bias=False) for _ in range(3))
    holder = _Holder()
    holder.cache = {"k": [torch.randn(2, 5), torch.randn(2, 5)]}
    holder.alias = layers[0].weight.detach()[:2]  # a view of a parameter: the same storage
    lines, named = pmc.census({"model": layers, "engine": holder}, device="cpu")
    got = {k: (g, n) for k, g, n, _ in lines}
    assert got["model.N.weight"][1] == 3 and got["engine.cache.k.N"][1] == 2
    assert "engine.alias" not in got  # reached first through the model
    assert named == 3 * 8 * 4 * 4 + 2 * 2 * 5 * 4
    assert abs(got["model.N.weight"][0] * pmc.GIB - 3 * 8 * 4 * 4) < 1e-6


def test_the_walk_leaves_objects_of_other_libraries_alone():
    class Foreign:
        pass

    obj = Foreign()
    obj.t = torch.randn(4)
    lines, named = pmc.census({"x": {"a": obj, "b": torch.randn(3)}}, device="cpu")
    assert [k for k, *_ in lines] == ["x.b"] and named == 12


def test_allocation_sites_group_live_blocks_by_our_innermost_frames():
    def frame(path, line, name):
        return {"filename": path, "line": line, "name": name}

    torch_frame = frame("/usr/lib/python3/site-packages/torch/nn/functional.py", 10, "linear")
    ours = frame("/repo/qerl_kit/rollout/static/fast.py", 120, "_dequantized")
    up = frame("/repo/qerl_kit/rollout/static/fast.py", 90, "__init__")
    snap = {"segments": [
        {"blocks": [{"size": 3 * pmc.GIB, "state": "active_allocated", "frames": [torch_frame, ours, up]},
                    {"size": pmc.GIB, "state": "active_allocated", "frames": [ours, up]},
                    {"size": 5 * pmc.GIB, "state": "inactive", "frames": [ours]}]},
        {"blocks": [{"size": 2 * pmc.GIB, "state": "active_allocated", "frames": [torch_frame]},
                    {"size": pmc.GIB // 2, "state": "active_allocated"}]}]}
    sites = pmc.allocation_sites(snap)
    assert sites[0] == ("static/fast.py:120 _dequantized < static/fast.py:90 __init__", 4.0, 2)
    assert sites[1] == ("(no stack)", 2.5, 2)  # freed blocks (inactive) are not counted
    assert len(sites) == 2


def test_live_bytes_split_between_the_default_pool_and_graph_pools():
    snap = {"segments": [
        {"segment_pool_id": (0, 0), "blocks": [{"size": 2 * pmc.GIB, "state": "active_allocated"},
                                               {"size": pmc.GIB, "state": "inactive"}]},
        {"segment_pool_id": (1, 3), "blocks": [{"size": pmc.GIB // 4, "state": "active_allocated"}]},
        {"segment_pool_id": [2, 0], "blocks": [{"size": pmc.GIB // 4, "state": "active_pending_free"}]}]}
    assert pmc.pool_gib(snap) == {"default pool": 2.0, "CUDA-graph pools": 0.25}


def test_hummings_copies_are_named_by_the_weight_each_repacks():
    """A census line of humming's cache says whose weight it is (the engine's fused buffer or the
    policy's own projection): the copy the AQN probe once made of a 32B's gate/up showed only as
    humming's, with no owner."""
    import weakref

    from bench.probe_memory_census import census, humming_roots, walk

    def Gemm(n):  # noqa: N802 - a repacked copy: a tensor of humming's own
        return {"weight": torch.zeros(n, dtype=torch.uint8)}

    policy = torch.nn.ModuleDict({"layers": torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))})
    engine = {"fused": [torch.zeros(8, 4), torch.zeros(8, 4)]}
    weights = [policy["layers"][0].weight, engine["fused"][1]]
    cache = {(id(w), torch.bfloat16): (weakref.ref(w), 0, Gemm(10 * (i + 1))) for i, w in enumerate(weights)}
    gone = torch.zeros(3)
    cache[(id(gone), torch.bfloat16)] = (weakref.ref(gone), 0, Gemm(5))
    found = walk({"policy": policy, "engine": engine}, device="cpu")
    roots = humming_roots(cache, found)
    assert sorted(roots) == sorted(["[policy.layers.0.weight]", "[engine.fused.1]", f"[unnamed.{id(gone)}]"])
    lines, _ = census({"humming": roots}, device="cpu", found=found)  # the policy and engine walked once
    assert "policy.layers.N.weight" in {line[0] for line in lines}
    assert {line[0] for line in lines if line[0].startswith("humming")} == {
        "humming.[policy.layers.N.weight].weight", "humming.[engine.fused.N].weight", "humming.[unnamed.N].weight"}
