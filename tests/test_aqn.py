"""Adaptive Quantization Noise: schedule, structural norm discovery, exact restore, statistics."""

import math

import pytest
import torch

from qerl_kit.aqn import AQN, find_noise_norms
from qerl_kit.lora import attach_lora
from qerl_kit.models import build_model
from qerl_kit.quantize import quantize_model

IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])


def _model(arch="qwen2-tiny", dtype=torch.float32, **kw):
    model = build_model(arch, dtype=dtype, **kw)
    with torch.no_grad():  # norms that are not all ones, so restore has real bits to get right
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape))
    quantize_model(model)
    return model


def test_schedule_exact_values():
    aqn = AQN(sigma_start=1e-2, sigma_end=5e-4, stages=10, total_steps=100)
    assert [aqn.sigma(s) for s in range(10)] == [0.0] * 10  # stage 0: quantization noise only
    for k in range(1, 10):
        expected = 1e-2 * (5e-4 / 1e-2) ** ((k - 1) / 8)
        assert aqn.sigma(10 * k) == pytest.approx(expected, rel=1e-12)
        assert aqn.sigma(10 * k + 9) == aqn.sigma(10 * k)
    assert aqn.sigma(10) == pytest.approx(1e-2) and aqn.sigma(99) == pytest.approx(5e-4)
    assert aqn.sigma(250) == pytest.approx(5e-4)  # past the end: stays at the last stage
    assert [s for s, _ in aqn.schedule()] == list(range(0, 100, 10))


def test_schedule_uneven_split_and_three_stages():
    aqn = AQN(sigma_start=0.1, sigma_end=0.001, stages=3, total_steps=10)
    assert [aqn.stage(s) for s in range(10)] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert aqn.sigma(4) == pytest.approx(0.1) and aqn.sigma(9) == pytest.approx(0.001)


@pytest.mark.parametrize("kwargs, match", [
    (dict(stages=2), r"stages must be an int >= 3"), (dict(sigma_start=0.0), "positive"),
    (dict(total_steps=5), r"total_steps must be >= stages = 10"), (dict(resample="batch"), "resample must be one of"),
])
def test_bad_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AQN(**{"total_steps": 100, **kwargs})


@pytest.mark.parametrize("arch", ["qwen2-tiny", "qwen3-tiny", "llama-tiny"])
@pytest.mark.parametrize("wrap", ["plain", "lora", "lora+norms"])
def test_perturbed_norm_counts_by_structure(arch, wrap):
    model = _model(arch, num_hidden_layers=3)
    if wrap != "plain":
        model = attach_lora(model, r=4, train_norms=wrap == "lora+norms")
    norms = find_noise_norms(model)
    assert len(norms) == 2 * 3  # input + post-attention norm per layer; not q/k norms, not final
    aqn = AQN(total_steps=100)
    assert aqn.apply(model, step=50) == 6
    assert aqn.restore(model) == 6
    assert aqn.apply(model, step=0) == 0  # stage 0 is noise-free


@pytest.mark.parametrize("quantized", [True, False])
def test_the_probe_runs_no_projection_and_gives_every_forward_back(quantized, monkeypatch):
    """The probe reads where tensors go: no projection computes (on a GPU a 4-row NVFP4 call could send
    a large weight to humming-kernels, which keeps a repacked copy of it), the norms found are the
    structure's, and every layer has its own forward again afterwards, an error inside included."""
    from qerl_kit.aqn import _projection_layers

    model = attach_lora(_model() if quantized else build_model("qwen2-tiny"), r=4)
    layers = _projection_layers(model)
    own = layers[0].forward  # a layer that brought its own forward (as accelerate's hooks do) keeps it
    layers[0].forward = own
    calls, targets = [], {id(m) for m in layers}
    for cls in {type(m) for m in layers}:  # a projection's own forward, counted (LoRA's matrices run as ever)
        def counted(self, *args, _forward=cls.forward, **kwargs):
            calls.extend([1] if id(self) in targets else [])
            return _forward(self, *args, **kwargs)
        monkeypatch.setattr(cls, "forward", counted)
    with torch.no_grad():
        model(input_ids=IDS)  # the counter counts: an ordinary forward runs every projection's class forward
    assert len(calls) == len(layers) - 1  # (layers[0] runs the forward it brought)
    calls.clear()
    norms = find_noise_norms(model)
    assert len(norms) == 4 and not calls
    assert vars(layers[0])["forward"] is own and all("forward" not in vars(m) for m in layers[1:])
    monkeypatch.undo()
    with torch.no_grad():
        before = model(input_ids=IDS).logits
    with pytest.raises(RuntimeError, match="indices"):  # an error inside the probe
        find_noise_norms(model, probe_ids=IDS.float())  # float ids: the embedding refuses them
    assert all("forward" not in vars(m) for m in layers[1:]) and vars(layers[0])["forward"] is own
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, before)


def test_unquantized_model_gets_the_same_norms_for_the_bf16_ablation():
    model = build_model("qwen2-tiny")
    assert len(find_noise_norms(model)) == 4
    assert len(find_noise_norms(attach_lora(model, r=4))) == 4


def test_no_norms_is_an_error():

    class NoNorms(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 16)
            self.proj = torch.nn.Linear(16, 16)

        def forward(self, input_ids):
            return self.proj(self.emb(input_ids))

    model = NoNorms()
    quantize_model(model)
    with pytest.raises(ValueError, match="no norm"):
        AQN(total_steps=10).apply(model, step=5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_restore_is_bit_exact_after_1000_cycles(dtype):
    model = _model(dtype=dtype)
    clean = {n: p.detach().clone() for n, p in model.named_parameters()}
    aqn = AQN(sigma_start=0.05, sigma_end=0.01, stages=4, total_steps=1000, seed=1)
    for step in range(1000):
        with aqn.noise(model, step) as count:
            assert count in (0, 4)
    for n, p in model.named_parameters():
        assert torch.equal(p, clean[n]), n
    assert not aqn.active


def test_noise_does_not_accumulate_and_statistics_match_sigma():
    model = _model(hidden_size=256, num_attention_heads=4, num_hidden_layers=4)
    norms = find_noise_norms(model)
    clean = [n.weight.detach().clone() for n in norms]
    aqn = AQN(total_steps=100, seed=0)
    for _ in range(5):  # applying again redraws around the clean weights
        aqn.apply(model, step=10)
    noise = torch.cat([(n.weight.detach() - c) for n, c in zip(norms, clean)])
    assert noise.numel() == 8 * 256
    assert abs(noise.mean().item()) < 3 * 1e-2 / math.sqrt(noise.numel()) * 2
    assert noise.std().item() == pytest.approx(1e-2, rel=0.06)
    aqn.restore(model)
    assert all(torch.equal(n.weight, c) for n, c in zip(norms, clean))


def test_noise_is_seedable_and_fresh_each_step():
    def draw(seed):
        model = _model()
        aqn = AQN(total_steps=100, seed=seed)
        norm = find_noise_norms(model)[0]
        clean = norm.weight.detach().clone()
        aqn.apply(model, 20)
        first = norm.weight.detach() - clean
        aqn.apply(model, 21)
        return first, norm.weight.detach() - clean

    a1, a2 = draw(0)
    b1, _ = draw(0)
    c1, _ = draw(1)
    assert torch.equal(a1, b1) and not torch.equal(a1, c1) and not torch.equal(a1, a2)


def test_context_manager_restores_on_error_and_checkpoints_stay_clean():
    model = _model()
    clean_sd = {k: v.clone() for k, v in model.state_dict().items()}
    aqn = AQN(total_steps=100)
    with pytest.raises(RuntimeError):
        with aqn.noise(model, step=50):
            noisy_sd = model.state_dict()
            assert all(torch.equal(noisy_sd[k], clean_sd[k]) for k in clean_sd)  # hook hides noise
            assert any(not torch.equal(p, clean_sd[n]) for n, p in model.named_parameters())
            raise RuntimeError("crash mid-rollout")
    assert all(torch.equal(v, clean_sd[k]) for k, v in model.state_dict().items())


def test_per_forward_resampling_option():
    model = _model()
    with torch.no_grad():
        with AQN(total_steps=100, resample="step").noise(model, 50):
            same = [model(IDS).logits for _ in range(2)]
        with AQN(total_steps=100, resample="forward").noise(model, 50):
            fresh = [model(IDS).logits for _ in range(2)]
        clean = model(IDS).logits
    assert torch.equal(same[0], same[1])
    assert not torch.equal(fresh[0], fresh[1])
    assert not torch.equal(same[0], clean)


def test_state_dict_round_trip_continues_the_same_noise():
    a = AQN(total_steps=100, seed=3)
    a._generator.manual_seed(3)
    torch.randn(5, generator=a._generator)
    b = AQN(total_steps=100, seed=0)
    b.load_state_dict(a.state_dict())
    assert b.seed == 3
    assert torch.equal(torch.randn(4, generator=a._generator), torch.randn(4, generator=b._generator))


# ---- constructor checks shared with the config (qerl_kit.config.AQNConfig) ----------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(sigma_start=float("nan")), r"^sigma_start must be a finite float in \(0, 10\].*got nan"),
    (dict(sigma_start=float("inf")), r"^sigma_start must be a finite float in \(0, 10\].*got inf"),
    (dict(sigma_end=float("inf"), sigma_start=1.0), r"^sigma_end must be a finite float in \(0, 10\].*got inf"),
    (dict(sigma_end=-1e-3), r"^sigma_end must be a finite float in \(0, 10\].*got -0\.001"),
    (dict(sigma_start=-1e-2, sigma_end=-1e-3), r"^sigma_start must be a finite float in \(0, 10\]"),
    (dict(sigma_start=True), r"^sigma_start must be a finite float in \(0, 10\].*got True"),
    (dict(sigma_start="loud"), r"^sigma_start must be a finite float in \(0, 10\].*got 'loud'"),
    (dict(stages=3.5), r"^stages must be an int"),
    (dict(total_steps="many"), r"^total_steps must be an int"),
    (dict(seed=1.5), r"^seed must be an int"),
    (dict(allow_increasing="maybe"), r"^allow_increasing must be a boolean"),
])
def test_non_finite_negative_or_mistyped_values_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AQN(**{"total_steps": 100, **kwargs})


def test_growing_noise_needs_allow_increasing():
    with pytest.raises(ValueError, match=r"sigma_end must be <= sigma_start.*allow_increasing=True.*got 0\.05"):
        AQN(sigma_start=1e-2, sigma_end=5e-2, total_steps=100)
    aqn = AQN(sigma_start=1e-2, sigma_end=5e-2, total_steps=100, allow_increasing=True)
    assert aqn.sigma(10) == pytest.approx(1e-2) and aqn.sigma(99) == pytest.approx(5e-2)
    assert aqn.sigma(50) > aqn.sigma(10)  # it really grows
    assert AQN(sigma_start=1e-2, sigma_end=1e-2, total_steps=100).sigma(99) == pytest.approx(1e-2)  # flat: fine


def test_the_config_and_the_class_agree():
    from qerl_kit.config import AQNConfig

    for kwargs in (dict(sigma_start=1e-2, sigma_end=5e-2), dict(sigma_end=float("inf")), dict(sigma_start=-1.0)):
        with pytest.raises(ValueError):
            AQNConfig(**kwargs)
        with pytest.raises(ValueError):
            AQN(total_steps=100, **kwargs)
    cfg = AQNConfig(sigma_start=1e-2, sigma_end=5e-2, allow_increasing=True)
    AQN(cfg.sigma_start, cfg.sigma_end, cfg.stages, 100, resample=cfg.resample, allow_increasing=cfg.allow_increasing)
    assert AQN(sigma_start="1e-2", total_steps=100).sigma_start == 1e-2  # the config's coercion rules
