"""StaticEngine on the CPU (no graphs): same model function as transformers, same sampling rules."""

import zlib

import pytest
import torch

from qerl_kit.rollout.static import Decoder, process_logits, sample
from qerl_kit.rollout import StaticEngine
from qerl_kit.lora import attach_lora
from qerl_kit.models import build_model
from qerl_kit.quantize import quantize_model
from qerl_kit.rollout import HFEngine, SamplingParams


def _model(preset: str, fmt: str = "nvfp4", lora: bool = True, seed: int = 0):
    model = build_model(preset, seed=seed)
    if fmt != "none":
        quantize_model(model, fmt)
    if lora:
        model = attach_lora(model, r=4, seed=seed)
        with torch.no_grad():  # B = 0 at init: make the adapter matter
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
    return model


def _prompts(gen: torch.Generator, lengths, vocab=512):
    return [torch.randint(3, vocab, (L,), generator=gen).tolist() for L in lengths]


def _hf_logits(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        return model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()  # predicting each completion token


@pytest.mark.parametrize("preset", ["qwen2-tiny", "qwen3-tiny", "llama-tiny"])
@pytest.mark.parametrize("fmt", ["nvfp4", "none"])
def test_sampled_logprobs_are_the_models(preset, fmt):
    """Each sampled token's log-prob is log_softmax(logits / T) of a plain HF forward on the same
    sequence (left padding, uneven prompts, LoRA on, prefill shared by n samples)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{preset}/{fmt}".encode()))  # hash() varies per process
    model = _model(preset, fmt)
    prompts = _prompts(gen, [5, 11, 8])
    engine = StaticEngine(model, prompt_bucket=4, length_bucket=8)
    out = engine.generate_ids(prompts, n=2, sampling=SamplingParams(max_new_tokens=10, temperature=0.8, seed=3),
                              ignore_eos=True)
    assert out.completion_ids.shape == (6, 10) and bool(out.completion_mask.all())
    for row in range(6):
        prompt = prompts[row // 2]
        completion = out.completion_ids[row].tolist()
        ref = torch.log_softmax(_hf_logits(model, prompt, completion) / 0.8, dim=-1)
        want = ref.gather(1, torch.tensor(completion)[:, None]).squeeze(1)
        torch.testing.assert_close(out.logprobs[row], want, atol=2e-4, rtol=1e-4)
    # the prompt comes back left-padded to its longest length, group-contiguous
    assert out.prompt_ids.shape == (6, 11)
    assert out.prompt_ids[2, -11:].tolist() == prompts[1]
    assert out.prompt_mask[0].tolist() == [0] * 6 + [1] * 5


def test_greedy_matches_hf_engine_on_the_tiny_model(tiny):
    """Same tokens, stop reasons and (nearly) log-probs as transformers' generate, through text."""
    from qerl_kit.data import build_prompt
    from qerl_kit.tasks.arith import PROMPT_SUFFIX, make_dataset

    model, tok = tiny
    rows = make_dataset("test", 5, seed=1)
    prompts = [build_prompt(tok, r["prompt"], suffix=PROMPT_SUFFIX) for r in rows]
    sp = SamplingParams(max_new_tokens=40, temperature=0)
    ref = HFEngine(model, tok).generate(prompts, 2, sp)
    got = StaticEngine(model, tok, check_every=8).generate(prompts, 2, sp)
    assert got.texts == ref.texts
    assert got.finish_reasons == ref.finish_reasons
    assert torch.equal(got.completion_ids, ref.completion_ids)
    assert torch.equal(got.completion_mask, ref.completion_mask)
    torch.testing.assert_close(got.logprobs, ref.logprobs, atol=1e-4, rtol=1e-4)
    assert got.stats["rollout/tokens"] == int(ref.completion_mask.sum())


@pytest.fixture(scope="module")
def tiny():
    from qerl_kit.tiny import load_tiny

    model, tok = load_tiny(quantize="nvfp4")
    return attach_lora(model, r=4, seed=0), tok


def test_stop_tokens_end_rows_and_are_kept(tiny):
    model, tok = tiny
    engine = StaticEngine(model, tok, check_every=4)
    eos = tok.eos_token_id
    out = engine.generate_ids([[5, 6, 7, 8]], n=4, sampling=SamplingParams(max_new_tokens=30, temperature=1.5, seed=0))
    ids, mask = out.completion_ids, out.completion_mask
    for row in range(4):
        L = int(mask[row].sum())
        if out.stopped[row]:
            assert ids[row, L - 1] == eos and (ids[row, :L - 1] != eos).all()
        else:
            assert L == 30
        assert (ids[row, L:] == engine.pad_token_id).all() and (out.logprobs[row, L:] == 0).all()
        assert (out.logprobs[row, :L] < 0).all()


def test_seed_reproduces_and_rng_is_left_alone(tiny):
    model, tok = tiny
    engine = StaticEngine(model, tok)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = engine.generate(["<|user|>\n1+2=<|end|>\n<|assistant|>\n"] * 2, 3, sp)
    after = torch.rand(1)  # the caller's stream continues as if generate had not run
    b = engine.generate(["<|user|>\n1+2=<|end|>\n<|assistant|>\n"] * 2, 3, sp)
    assert torch.equal(before, after)
    assert torch.equal(a.completion_ids, b.completion_ids)
    c = engine.generate(["<|user|>\n1+2=<|end|>\n<|assistant|>\n"] * 2, 3, SamplingParams(max_new_tokens=12, seed=8))
    assert not torch.equal(a.completion_ids, c.completion_ids)


def test_adapter_and_aqn_changes_are_seen_live(tiny):
    """In-place updates (optimizer on LoRA, AQN on norms) reach the next call without a reset."""
    from qerl_kit.aqn import AQN

    model, tok = tiny
    engine = StaticEngine(model, tok)
    prompt = [[9, 10, 11, 12, 13]]
    sp = SamplingParams(max_new_tokens=6, temperature=0)

    def logprobs():
        return engine.generate_ids(prompt, 1, sp, ignore_eos=True).logprobs

    base = logprobs()
    aqn = AQN(sigma_start=0.5, sigma_end=0.1, stages=3, total_steps=3)
    with aqn.noise(model, step=1):
        noisy = logprobs()
    assert not torch.allclose(base, noisy)
    torch.testing.assert_close(logprobs(), base)  # restored exactly
    lora_b = next(p for n, p in model.named_parameters() if "lora_B" in n)
    saved = lora_b.detach().clone()
    with torch.no_grad():
        lora_b.add_(0.5)
    try:
        assert not torch.allclose(logprobs(), base)
    finally:
        with torch.no_grad():
            lora_b.copy_(saved)


def test_max_rows_splits_into_batches_with_the_same_result(tiny):
    model, tok = tiny
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    sp = SamplingParams(max_new_tokens=8, temperature=0)
    whole = StaticEngine(model, tok).generate_ids(prompts, 2, sp)
    for max_rows in (2, 4):  # 4: batches of 2 prompts, the last one padded to the same shape
        split = StaticEngine(model, tok, max_rows=max_rows).generate_ids(prompts, 2, sp)
        assert torch.equal(whole.completion_ids, split.completion_ids)
        assert torch.equal(whole.prompt_ids, split.prompt_ids)
        assert split.stopped.shape == (6,)


def test_forward_hooks_route_to_the_generic_path(tiny):
    """A forward hook (AQN resample='forward' draws noise in one) must run at every decode step:
    the fused step never calls the norm modules, so a hooked model decodes through them."""
    model, tok = tiny
    engine = StaticEngine(model, tok)
    assert engine.decoder.path == "fused"
    norm = Decoder(model).layers[0].input_layernorm
    calls = []
    handle = norm.register_forward_hook(lambda *_: calls.append(1))
    try:
        engine.generate_ids([[9, 10, 11, 12]], 1, SamplingParams(max_new_tokens=6, temperature=0), ignore_eos=True)
    finally:
        handle.remove()
    assert len(calls) == 6  # the prefill and five decode steps
    engine.generate_ids([[9, 10, 11, 12]], 1, SamplingParams(max_new_tokens=3, temperature=0), ignore_eos=True)
    assert engine.decoder.use_plan is True and len(calls) == 6  # back on the fused path, hook gone


def test_process_logits_matches_transformers_warpers():
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 3
    for T, k, p in [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.5)]:
        x = TemperatureLogitsWarper(T)(None, logits.clone())
        if k:
            x = TopKLogitsWarper(k)(None, x)
        if p < 1:
            x = TopPLogitsWarper(p)(None, x)
        torch.testing.assert_close(process_logits(logits, T, k, p), torch.log_softmax(x, -1))


def test_sample_draws_from_the_processed_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -5.0]]).repeat(20000, 1)
    tokens, lp = sample(logits, temperature=1.0, top_k=3)
    freq = torch.bincount(tokens, minlength=5).float() / len(tokens)
    want = process_logits(logits[:1], 1.0, 3, 1.0).exp()[0]
    torch.testing.assert_close(freq, want, atol=0.015, rtol=0)
    assert freq[3:].sum() == 0
    torch.testing.assert_close(lp, want.log()[tokens])
    greedy, glp = sample(logits[:2], temperature=0)
    assert greedy.tolist() == [0, 0] and torch.allclose(glp, torch.log_softmax(logits[:2], -1)[:, 0])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_a_narrower_call_reuses_the_held_cache_up_to_reuse_pad_with_the_same_outputs(device):
    """A call whose prompt bucket is at most reuse_pad narrower than the held cache's pads its prompts to
    the cache's width and decodes on the same state (no new cache, its graphs kept: on CUDA they are
    replayed): the same tokens and log-probs as an engine that never held the wider cache; a wider gap
    re-allocates."""
    gen = torch.Generator().manual_seed(11)
    model = _model("qwen2-tiny", "nvfp4").to(device)
    wide, narrow = _prompts(gen, [11, 4]), _prompts(gen, [5, 3])  # buckets of 4: widths 12 and 8
    sp = SamplingParams(max_new_tokens=6, temperature=0)
    fresh = StaticEngine(model, prompt_bucket=4, length_bucket=8).generate_ids(narrow, 2, sp)
    engine = StaticEngine(model, prompt_bucket=4, length_bucket=8, reuse_pad=4)
    engine.generate_ids(wide, 2, sp)
    held = engine._state[1]
    out = engine.generate_ids(narrow, 2, sp)
    assert engine._state[1] is held and engine._state[0] == (4, 2, 12, 6)  # the wide cache took the call
    assert device == "cpu" or len(held.graphs) > 0  # graphs captured by the wide call, replayed by this one
    assert torch.equal(out.completion_ids, fresh.completion_ids) and torch.equal(out.prompt_ids, fresh.prompt_ids)
    tol = 1e-5 if device == "cpu" else 2e-4  # more masked slots: the GPU kernels' split of the attention changes
    torch.testing.assert_close(out.logprobs, fresh.logprobs, atol=tol, rtol=tol)
    for reuse_pad, width in ((3, 8), (0, 8)):  # 4 tokens wider than the call's bucket: more than reuse_pad
        engine = StaticEngine(model, prompt_bucket=4, length_bucket=8, reuse_pad=reuse_pad)
        engine.generate_ids(wide, 2, sp)
        out = engine.generate_ids(narrow, 2, sp)
        assert engine._state[0] == (4, 2, width, 6) and torch.equal(out.completion_ids, fresh.completion_ids)
    engine.generate_ids(narrow, 1, sp)  # another group size: another cache, whatever the width
    assert engine._state[0] == (2, 1, 8, 6)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match=rf"reuse_pad must be an int >= 0 \(tokens\); got {bad!r}"):
            StaticEngine(model, reuse_pad=bad)


def test_errors_name_the_problem(tiny):
    model, tok = tiny
    with pytest.raises(TypeError, match="not a Qwen2/Qwen3/Llama"):
        Decoder(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="length_bucket"):
        StaticEngine(model, tok, length_bucket=0)
    with pytest.raises(ValueError, match="max_rows"):
        StaticEngine(model, tok, max_rows=0)
    engine = StaticEngine(model, tok)
    with pytest.raises(ValueError, match="zero tokens"):
        engine.generate_ids([[1, 2], []], 1)
    with pytest.raises(TypeError, match="list of strings"):
        engine.generate("one prompt", 1)
    with pytest.raises(ValueError, match="need a tokenizer"):
        StaticEngine(model).generate(["x"], 1)


def test_trainer_runs_on_the_static_engine(tiny, tmp_path):
    """One GRPO step with the engine as the trainer's rollout backend."""
    from qerl_kit.config import preset
    from qerl_kit.tasks import make_task
    from qerl_kit.trainer import Trainer

    model, tok = tiny
    cfg = preset("tiny-cpu", total_steps=3, output_dir=str(tmp_path), save_every=0,
                 rollout=dict(batch_size=8, group_size=4, max_new_tokens=24), aqn=dict(stages=3))
    engine = StaticEngine(model, tok, check_every=4)  # stop checks every 4 steps: the batch gets compacted
    trainer = Trainer(model, tok, make_task(cfg.data), cfg, engine=engine, progress="none")
    seen = []
    generate = engine.generate_ids
    engine.generate_ids = lambda *a, **k: seen.append(generate(*a, **k)) or seen[-1]
    row = trainer.train_step()
    assert row["num_tokens"] > 0 and 0 <= row["reward"] <= 1
    assert seen[0].stats["rollout/compactions"] >= 1
    # step 0 is AQN's noise-free stage: the engine's sampling log-probs are the trainer's own,
    # compaction included
    assert row["sampling/sampling_logp_difference/max"] < 1e-3


def test_make_engine_and_the_config_switch(tiny):
    from qerl_kit.config import RolloutConfig
    from qerl_kit.rollout import make_engine

    model, tok = tiny
    assert isinstance(make_engine("auto", model, tok), HFEngine)  # CPU model: generate
    assert isinstance(make_engine("static", model, tok), StaticEngine)
    assert isinstance(make_engine("hf", model, tok), HFEngine)
    with pytest.raises(ValueError, match="unknown rollout engine"):
        make_engine("vllm2", model, tok)
    with pytest.raises(ValueError, match="rollout.engine must be"):
        RolloutConfig(engine="fast")


def test_auto_resolves_by_layout_and_a_bug_in_an_engine_surfaces(tiny, monkeypatch):
    from qerl_kit.rollout import registry

    model, tok = tiny
    monkeypatch.setattr(type(next(model.parameters())), "is_cuda", property(lambda self: True))  # "on a GPU"
    assert registry.resolve_engine("auto", model) == "static"
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))  # not a causal LM the static engine knows
    assert registry.resolve_engine("auto", plain) == "hf"

    def broken(policy, tokenizer, **kwargs):
        raise TypeError("a bug inside the engine")

    monkeypatch.setitem(registry.ENGINES, "static", broken)
    with pytest.raises(TypeError, match="a bug inside the engine"):  # no silent fallback to transformers
        registry.make_engine("auto", model, tok)


def test_float32_adapters_on_a_bf16_base_stay_on_the_fused_path():
    model = build_model("qwen2-tiny", seed=3, dtype=torch.bfloat16)
    quantize_model(model, "nvfp4")
    model = attach_lora(model, r=4, seed=3, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    engine = StaticEngine(model)
    out = engine.generate_ids([[5, 6, 7, 8, 9]], 2, SamplingParams(max_new_tokens=6, seed=0), ignore_eos=True)
    assert engine.decoder.path == "fused" and engine.decoder._plan_ok
    prompt = [5, 6, 7, 8, 9]
    for row in range(2):
        ids = out.completion_ids[row].tolist()
        ref = torch.log_softmax(_hf_logits(model, prompt, ids), -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        torch.testing.assert_close(out.logprobs[row], ref, atol=0.05, rtol=0)  # bf16 arithmetic


def test_gradient_checkpointing_hooks_keep_the_fused_path():
    """enable_input_require_grads (needed with gradient checkpointing) hooks the embedding; that hook
    is inert at inference, so it must not push rollouts off the fused path and CUDA graphs."""
    from qerl_kit.rollout.static.engine import _hooked_modules

    model = build_model("qwen2-tiny", seed=4)
    quantize_model(model, "nvfp4")
    model = attach_lora(model, r=4, seed=4)
    model.enable_input_require_grads()
    assert _hooked_modules(model) == []
    engine = StaticEngine(model)
    engine.generate_ids([[5, 6, 7]], 1, SamplingParams(max_new_tokens=3, temperature=0), ignore_eos=True)
    assert engine.decoder.use_plan
    handle = model.get_base_model().model.norm.register_forward_pre_hook(lambda *_: None)
    try:
        assert _hooked_modules(model) == ["base_model.model.model.norm"]
    finally:
        handle.remove()


# ---- live rows only: compaction ----------------------------------------------------------------
def _arith_prompts(tok, k=8):
    from qerl_kit.tasks import make_task

    task = make_task()
    return task.encode(tok, task.eval[:k])  # levels 1-4: completions of very different lengths


def test_compaction_keeps_greedy_outputs_and_decodes_fewer_rows(tiny):
    model, tok = tiny
    prompts = _arith_prompts(tok)
    sp = SamplingParams(max_new_tokens=48, temperature=0)
    dense = StaticEngine(model, tok, check_every=2, compact=False).generate_ids(prompts, 2, sp)
    engine = StaticEngine(model, tok, check_every=2)
    packed = engine.generate_ids(prompts, 2, sp)
    assert torch.equal(packed.completion_ids, dense.completion_ids)
    assert torch.equal(packed.completion_mask, dense.completion_mask) and torch.equal(packed.stopped, dense.stopped)
    torch.testing.assert_close(packed.logprobs, dense.logprobs, atol=1e-5, rtol=1e-5)
    lengths = dense.completion_mask.sum(1)
    assert lengths.max() > 2 * lengths.min()  # the case that matters: uneven lengths
    assert packed.stats["rollout/compactions"] >= 2
    assert packed.stats["rollout/row_steps"] < 0.7 * packed.stats["rollout/dense_row_steps"]
    assert dense.stats["rollout/row_steps"] == dense.stats["rollout/dense_row_steps"]
    again = engine.generate_ids(prompts, 2, sp)  # the views (and on a GPU their graphs) are reused
    assert torch.equal(again.completion_ids, dense.completion_ids)


def test_compacted_sampling_has_the_models_logprobs(tiny):
    model, tok = tiny
    prompts = _arith_prompts(tok, 6)
    T = 1.3
    out = StaticEngine(model, tok, check_every=2).generate_ids(prompts, 4, SamplingParams(48, temperature=T, seed=5))
    assert out.stats["rollout/compactions"] >= 1
    for row in range(len(out)):
        prompt, L = list(prompts.ids[row // 4]), int(out.completion_mask[row].sum())
        completion = out.completion_ids[row, :L].tolist()
        ref = torch.log_softmax(_hf_logits(model, prompt, completion) / T, dim=-1)
        want = ref.gather(1, torch.tensor(completion)[:, None]).squeeze(1)
        torch.testing.assert_close(out.logprobs[row, :L], want, atol=2e-4, rtol=1e-4)
        assert (out.logprobs[row, L:] == 0).all() and (out.completion_ids[row, L:] == tok.pad_token_id).all()


def test_forced_lengths_end_rows_there_with_and_without_compaction(tiny):
    """stop_after (benchmarks of realistic length distributions): row r gets exactly that many tokens."""
    model, tok = tiny
    prompts = _arith_prompts(tok, 4)
    lengths = [3, 17, 9, 1, 30, 5, 12, 2]
    sp = SamplingParams(max_new_tokens=32, temperature=1.0, seed=1)
    outs = [StaticEngine(model, tok, check_every=2, compact=c).generate_ids(prompts, 2, sp, ignore_eos=True,
                                                                          stop_after=lengths) for c in (True, False)]
    for out in outs:
        assert out.completion_mask.sum(1).tolist() == lengths and out.stopped.all()
        assert out.completion_ids.shape[1] == 30
    assert outs[0].stats["rollout/row_steps"] < outs[1].stats["rollout/row_steps"]
    with pytest.raises(ValueError, match="one length >= 1 per row"):
        StaticEngine(model, tok).generate_ids(prompts, 2, sp, stop_after=[3] * 7)


def test_forced_lengths_follow_their_rows_into_batches_of_max_rows(tiny):
    """stop_after with max_rows (decoding in turns): each batch takes its own rows' lengths, the padded
    last batch included, and greedy outputs are those of one whole batch."""
    model, tok = tiny
    prompts = _arith_prompts(tok, 5)
    lengths = [3, 17, 9, 1, 30, 5, 12, 2, 7, 21]
    sp = SamplingParams(max_new_tokens=32, temperature=0)
    whole = StaticEngine(model, tok).generate_ids(prompts, 2, sp, ignore_eos=True, stop_after=lengths)
    for max_rows in (4, 6):  # 6: batches of 3 prompts, the last one (2 prompts) padded
        split = StaticEngine(model, tok, max_rows=max_rows).generate_ids(prompts, 2, sp, ignore_eos=True,
                                                                      stop_after=lengths)
        assert split.completion_mask.sum(1).tolist() == lengths and split.stopped.all()
        width = whole.completion_ids.shape[1]
        assert torch.equal(split.completion_ids[:, :width], whole.completion_ids)


def test_a_registered_engine_is_made_by_name(tiny, monkeypatch):
    from qerl_kit.rollout import registry

    model, tok = tiny
    monkeypatch.setitem(registry.ENGINES, "placeholder", None)  # restored after the test
    registry.register_engine("placeholder", lambda policy, tokenizer, **kw: ("built", policy, kw))
    assert registry.make_engine("placeholder", model, tok, batch_size=2) == ("built", model, {"batch_size": 2})
    assert "placeholder" in registry.engine_names()
    with pytest.raises(ValueError, match="other than 'auto'"):
        registry.register_engine("auto", lambda policy, tokenizer: None)
    with pytest.raises(TypeError, match="must be callable"):
        registry.register_engine("x", "not a factory")


def test_shared_prefix_stores_the_prompt_once_and_changes_no_output(tiny):
    """The prompt's keys/values live once per prompt (KVCache's prefix), not in each of its n rows:
    outputs (greedy and sampled, with compaction moving rows) equal the plain layout's, and the
    cache holds P slots per prompt instead of per row."""
    model, tok = tiny
    prompts = _arith_prompts(tok, 6)
    n, new = 4, 48
    for sp in (SamplingParams(new, temperature=0), SamplingParams(new, temperature=1.2, seed=3)):
        plain_engine = StaticEngine(model, tok, check_every=2, shared_prefix=False)
        shared_engine = StaticEngine(model, tok, check_every=2)
        plain, shared = plain_engine.generate_ids(prompts, n, sp), shared_engine.generate_ids(prompts, n, sp)
        assert shared.stats["rollout/compactions"] >= 1  # rows moved: prompt_row followed them
        assert torch.equal(shared.completion_ids, plain.completion_ids)
        torch.testing.assert_close(shared.logprobs, plain.logprobs, atol=1e-6, rtol=0)
        cache_p, cache_s = plain_engine._state[1].cache, shared_engine._state[1].cache
        P, rows = cache_s.prefix_len, len(prompts) * n
        assert P > 0 and cache_p.prefix_len == 0 and cache_s.max_len == cache_p.max_len == P + new
        assert cache_s.pk[0].shape[0] == len(prompts) and cache_s.k[0].shape[:3] == (rows, cache_s.k[0].shape[1], new)
        per_slot = cache_p.nbytes // (rows * (P + new))
        assert cache_s.nbytes == per_slot * (rows * new + len(prompts) * P)
        again = shared_engine.generate_ids(prompts, n, sp)  # prompt_row is reset after the last call's moves
        assert torch.equal(again.completion_ids, shared.completion_ids)
    with pytest.raises(ValueError, match="needs shared_prefix=False"):
        StaticEngine(model, tok, attention="sdpa")
    with pytest.raises(ValueError, match="attention='flash'"):
        StaticEngine(model, tok, shared_prefix=False, attention="flash")


# ---- the model is only read ----------------------------------------------------------------------
def _model_state(model: torch.nn.Module) -> dict:
    """Everything of the model an engine could change: every state-dict entry and buffer (values,
    dtype, device, storage), parameter objects and flags, and each module's attributes and mode."""
    tensors = {**{f"state:{k}": v for k, v in model.state_dict(keep_vars=True).items()},
               **{f"buffer:{k}": v for k, v in model.named_buffers()}}
    return {
        "tensors": {k: (v.detach().clone(), v.dtype, v.device, v.data_ptr(), v.shape, v.stride())
                    for k, v in tensors.items()},
        "params": {k: (id(p), p.requires_grad) for k, p in model.named_parameters()},
        "modules": {name: (type(m), m.training, sorted(vars(m)), sorted(m._parameters), sorted(m._buffers),
                           {k: v for k, v in vars(m).items() if isinstance(v, (bool, int, float, str, type(None)))})
                    for name, m in model.named_modules()},
    }


def _assert_same_state(before: dict, after: dict) -> None:
    assert after["params"] == before["params"] and after["modules"] == before["modules"]
    assert after["tensors"].keys() == before["tensors"].keys()
    for key, (value, *meta) in before["tensors"].items():
        got, *got_meta = after["tensors"][key]
        assert got_meta == meta, key  # dtype, device, storage, shape, strides
        assert torch.equal(got.view(torch.uint8) if got.dtype != torch.bool else got,
                           value.view(torch.uint8) if value.dtype != torch.bool else value), key  # bit for bit


@pytest.mark.parametrize("fmt", ["nvfp4", "none"])
@pytest.mark.parametrize("fused", [True, False])
def test_building_and_generating_leave_the_model_as_it_was(fmt, fused):
    """The engine reads the model and never writes to it: after building it (the fused plan's
    copies), generating (prefill, decode, compaction, sampling) and an AQN sync, the state dict,
    the buffers, the parameter objects and every module's attributes are what they were, bit for bit."""
    from qerl_kit.aqn import AQN

    model = _model("qwen3-tiny", fmt, seed=6)
    model.train()  # the engine runs in eval mode and must give the flags back
    before = _model_state(model)
    engine = StaticEngine(model, check_every=2, length_bucket=8, fused=fused)
    assert (engine.decoder.path == "fused") == fused
    prompts = _prompts(torch.Generator().manual_seed(6), [4, 9, 6])
    engine.generate_ids(prompts, 2, SamplingParams(max_new_tokens=12, temperature=1.0, seed=1),
                        stop_after=[2, 12, 3, 5, 1, 12])
    aqn = AQN(sigma_start=0.5, sigma_end=0.1, stages=3, total_steps=3)
    with engine.sync(model, noise=aqn, step=1):
        engine.generate_ids(prompts, 1, SamplingParams(max_new_tokens=5, temperature=0), ignore_eos=True)
    _assert_same_state(before, _model_state(model))


@pytest.mark.parametrize("fmt", ["nvfp4", "none"])
def test_the_fused_copies_follow_a_change_of_the_models_base_weights(fmt):
    """The fused plan decodes on its own copies of q/k/v and gate/up; a base weight written in
    place (reloaded, trained) is copied again at the next call, so fused and generic paths agree."""
    model = _model("qwen2-tiny", fmt, lora=False, seed=7)
    fused, generic = StaticEngine(model), StaticEngine(model, fused=False)
    prompts, sp = [[5, 6, 7, 8, 9]], SamplingParams(max_new_tokens=6, temperature=0)
    first = fused.generate_ids(prompts, 1, sp, ignore_eos=True)
    k_proj = model.model.layers[0].self_attn.k_proj
    name = "packed" if fmt == "nvfp4" else "weight"
    with torch.no_grad():
        tensor = getattr(k_proj, name)
        tensor.copy_(torch.flip(tensor, dims=[0]))
    got = fused.generate_ids(prompts, 1, sp, ignore_eos=True)
    want = generic.generate_ids(prompts, 1, sp, ignore_eos=True)
    assert not torch.equal(got.logprobs, first.logprobs)  # the change reached the fused step
    assert torch.equal(got.completion_ids, want.completion_ids)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=2e-4, rtol=1e-4)


def test_a_renamed_keyword_says_its_new_name(tiny):
    model, tok = tiny
    with pytest.raises(TypeError, match="sync_every is now called check_every"):
        StaticEngine(model, tok, sync_every=8)
    with pytest.raises(TypeError, match="unexpected keyword argument 'chek_every'"):
        StaticEngine(model, tok, chek_every=8)
