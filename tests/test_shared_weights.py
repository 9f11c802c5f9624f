"""StaticEngine(share_weights=True): the model's q/k/v and gate/up tensors become row blocks of the
fused plan's buffers, so one copy of those weights is in memory instead of two, with every rollout,
training step and export the same as with the engine's own copy, and restore_weights() giving the
tensors their own storage back."""

import pytest
import torch

from qerl_kit.lora import attach_lora
from qerl_kit.models import build_model
from qerl_kit.quantize import quantize_model
from qerl_kit.rollout import SamplingParams, StaticEngine

FUSED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
SAMPLED = SamplingParams(max_new_tokens=5, temperature=1.0, seed=3)


def _policy(fmt, seed=1):
    model = build_model("qwen2-tiny", seed=seed, dtype=torch.float32, device="cpu")
    if fmt != "none":
        quantize_model(model, fmt)
    model = attach_lora(model, r=4, seed=seed)
    with torch.no_grad():  # a trained adapter (peft starts B at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed))
    return model


def _prompts(count=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 4, 13)[:count]]


def _bases(model):
    """{(layer, projection): the base layer} of the fused groups' projections."""
    out = {}
    for i, layer in enumerate(model.get_base_model().model.layers):
        for name in FUSED:
            module = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
            out[i, name] = module.get_base_layer()
    return out


def _tensors(base):
    """The base layer's weight tensors the fused plan concatenates."""
    names = base._tensor_fields[:2] if hasattr(base, "_tensor_fields") else ("weight",)
    return [getattr(base, n) for n in names] + ([base.bias] if base.bias is not None else [])


def _storages(*tensors):
    """Bytes of the distinct storages under these tensors (what they hold in memory together)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _plan_tensors(engine):
    """The fused groups' buffers (o_proj and down_proj are groups of one: the model's own tensors)."""
    return [t for lp in engine.decoder.plan.layers for g in (lp.qkv, lp.gate_up) for t in g.fused.values()]


def _same(a, b):
    return torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4", "none"])
def test_one_copy_in_memory_the_same_tensor_objects_and_values_and_the_same_rollouts(fmt):
    model = _policy(fmt)
    tensors = {key: _tensors(base) for key, base in _bases(model).items()}
    values = {key: [t.clone() for t in ts] for key, ts in tensors.items()}
    model_bytes = _storages(*[t for ts in tensors.values() for t in ts])
    copy = StaticEngine(model)
    with_copy = _storages(*[t for ts in tensors.values() for t in ts], *_plan_tensors(copy))
    assert with_copy > model_bytes and not copy.shares_weights  # the engine's own copy
    reference = copy.generate_ids(_prompts(), 3, SAMPLED, ignore_eos=True)
    del copy

    shared = StaticEngine(model, share_weights=True)
    assert shared.shares_weights and shared.decoder.path == "fused"
    for key, base in _bases(model).items():
        now = _tensors(base)
        assert all(a is b for a, b in zip(now, tensors[key])), key  # the same tensor objects
        assert all(torch.equal(a, b) for a, b in zip(now, values[key])), key  # the same values
    everything = [t for ts in tensors.values() for t in ts] + _plan_tensors(shared)
    assert _storages(*everything) == model_bytes  # the plan's buffers are the model's storage: no copy
    layer = shared.decoder.plan.layers[0]
    q = _tensors(_bases(model)[0, "q_proj"])[0]
    assert q.untyped_storage().data_ptr() == layer.qkv.fused[layer.qkv.attrs[0]].untyped_storage().data_ptr()
    assert _same(shared.generate_ids(_prompts(), 3, SAMPLED, ignore_eos=True), reference)

    shared.restore_weights()  # each tensor on its own storage again, the plan keeps a copy
    assert not shared.shares_weights
    for key, base in _bases(model).items():
        now = _tensors(base)
        assert all(a is b and torch.equal(a, v) for a, b, v in zip(now, tensors[key], values[key])), key
    owned = [t for ts in tensors.values() for t in ts]
    assert _storages(*owned) == sum(t.untyped_storage().nbytes() for t in owned)  # nothing shares storage
    assert _storages(*owned, *_plan_tensors(shared)) == with_copy
    assert _same(shared.generate_ids(_prompts(), 3, SAMPLED, ignore_eos=True), reference)


def test_a_base_weight_changed_in_place_or_replaced_reaches_the_next_rollout():
    """load_state_dict writes into the shared tensors; the next call decodes the new weights (as a
    fresh engine does), and a tensor replaced by a new object is copied in and shared again."""
    model, other = _policy("nvfp4", seed=1), _policy("nvfp4", seed=2)
    engine = StaticEngine(model, share_weights=True)
    engine.generate_ids(_prompts(), 2, SAMPLED, ignore_eos=True)  # cache and plan in use
    model.load_state_dict(other.state_dict())
    assert engine.shares_weights
    fresh = StaticEngine(_policy("nvfp4", seed=2)).generate_ids(_prompts(), 2, SAMPLED, ignore_eos=True)
    assert _same(engine.generate_ids(_prompts(), 2, SAMPLED, ignore_eos=True), fresh)

    base = _bases(model)[1, "up_proj"]
    base.packed = base.packed.clone()  # a new tensor object on storage of its own
    group = engine.decoder.plan.layers[1].gate_up
    assert base.packed.untyped_storage().data_ptr() != group.fused["packed"].untyped_storage().data_ptr()
    assert _same(engine.generate_ids(_prompts(), 2, SAMPLED, ignore_eos=True), fresh)
    assert base.packed.untyped_storage().data_ptr() == group.fused["packed"].untyped_storage().data_ptr()


def test_a_tensor_moved_to_another_dtype_is_copied_in_but_not_made_a_row_block_again():
    """Sharing moves storage, never a tensor's dtype or device: a replaced part of another kind is only
    copied into the plan's buffer (cast, as without sharing) and keeps what it is. (The refresh every
    generation call starts with; a float64 weight in a float32 model would stop the prefill itself.)"""
    model = _policy("none")
    engine = StaticEngine(model, share_weights=True)
    q = _bases(model)[0, "q_proj"]
    q.weight.data = q.weight.data.double()
    engine.decoder.refresh()
    group = engine.decoder.plan.layers[0].qkv
    assert q.weight.dtype == torch.float64 and group.fused["weight"].dtype == torch.float32
    assert q.weight.untyped_storage().data_ptr() != group.fused["weight"].untyped_storage().data_ptr()
    assert torch.equal(group.fused["weight"][:q.out_features], q.weight.float())


def test_a_second_engine_decodes_from_the_buffers_the_model_already_is():
    model = _policy("nvfp4")
    first = StaticEngine(model, share_weights=True)
    second = StaticEngine(model)  # the parts are consecutive row blocks of one buffer: no copy, either mode
    for a, b in zip(_plan_tensors(first), _plan_tensors(second)):
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert _same(first.generate_ids(_prompts(), 2, SAMPLED, ignore_eos=True),
                 second.generate_ids(_prompts(), 2, SAMPLED, ignore_eos=True))


def test_a_trainer_step_and_an_export_are_the_same_with_shared_weights(tmp_path):
    from qerl_kit.config import preset
    from qerl_kit.export import load_nvfp4, save_nvfp4
    from qerl_kit.tasks import make_task
    from qerl_kit.tiny import load_tiny
    from qerl_kit.trainer import Trainer

    rows = {}
    for share in (False, True):
        model, tok = load_tiny(quantize="nvfp4")
        model = attach_lora(model, r=4, seed=0)
        cfg = preset("tiny-cpu", output_dir=str(tmp_path / str(share)), save_every=0,
                     rollout=dict(engine="static", batch_size=8, group_size=4, max_new_tokens=8, share_weights=share))
        trainer = Trainer(model, tok, make_task(cfg.data), cfg, progress="none")
        assert trainer.engine.shares_weights is share
        rows[share] = trainer.train_step()
        save_nvfp4(model, tmp_path / f"export-{share}")  # safetensors writes row-block tensors as they are
    clock = ("time", "per_s", "seconds")  # wall-clock metrics differ between any two runs
    assert {k: v for k, v in rows[True].items() if not any(c in k for c in clock)} == \
        {k: v for k, v in rows[False].items() if not any(c in k for c in clock)}
    a, b = load_nvfp4(tmp_path / "export-False"), load_nvfp4(tmp_path / "export-True")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_fused_step_that_fails_gives_the_model_its_storage_back(monkeypatch):
    model = _policy("nvfp4")
    engine = StaticEngine(model, share_weights=True)

    def broken(*args, **kwargs):
        raise RuntimeError("a kernel that does not compile here")

    monkeypatch.setattr(engine.decoder.plan, "decode", broken)
    with pytest.warns(UserWarning, match="the fused decode step failed"):
        out = engine.generate_ids(_prompts(), 2, SAMPLED, ignore_eos=True)
    assert engine.decoder.plan is None and not engine.shares_weights and out.completion_ids.numel()
    owned = [t for base in _bases(model).values() for t in _tensors(base)]
    assert _storages(*owned) == sum(t.untyped_storage().nbytes() for t in owned)


def test_share_weights_is_checked_where_it_enters():
    model = _policy("nvfp4")
    with pytest.raises(ValueError, match="share_weights must be True or False; got 'yes'"):
        StaticEngine(model, share_weights="yes")
    with pytest.raises(ValueError, match="fused must be True or False; got 1"):
        StaticEngine(model, fused=1)
    unfused = StaticEngine(model, fused=False, share_weights=True)  # no plan: nothing to share
    assert not unfused.shares_weights
    unfused.restore_weights()  # a no-op
