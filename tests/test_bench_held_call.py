"""bench.bench_held_call: the held call's host time against nn.Linear's, with the earlier attribute reads."""
from bench import bench_held_call
from qerl_kit.linear import NVFP4Linear, QuantLinear


def test_the_three_ways_are_timed_and_the_earlier_reads_are_restored():
    held, forward_held = NVFP4Linear._held, QuantLinear._forward_held
    res = bench_held_call.run(calls=20, rounds=1, width=32)
    assert set(res) == {"nn.Linear", "NVFP4 held, _buffers", "NVFP4 held, attribute reads"}
    assert all(us > 0 for us in res.values())
    assert NVFP4Linear._held is held and QuantLinear._forward_held is forward_held


def test_the_attribute_reads_variant_computes_the_same_output():
    import torch
    from torch import nn

    from qerl_kit.dense_cache import dense_weight_cache

    layer = NVFP4Linear.from_linear(nn.Linear(32, 16))
    x = torch.randn(3, 5, 32, requires_grad=True)
    with dense_weight_cache():
        y = layer(x)
        with bench_held_call.attribute_reads():
            y_old = layer(x)
    assert torch.equal(y, y_old) and y.abs().sum() > 0
