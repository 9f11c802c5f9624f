"""Rollout engine: Rollouts layout, sampling log-probs vs teacher forcing, prefill sharing, seeds.

Run: python -m pytest tests/test_rollout.py -q
Models are qwen2-tiny with random weights; the lm_head is scaled up (and the EOS row more) so
that greedy and sampled completions are non-trivial and both finish reasons occur.
"""

import string

import pytest
import torch

from qerl_kit.lora import attach_lora
from qerl_kit.models import build_model
from qerl_kit.quantize import quantize_model
from qerl_kit.rollout import HFEngine, RolloutEngine, Rollouts, SamplingParams

PROMPTS = ["What is 2+3?", "Hi", "The quick brown fox jumps", "x"]  # lengths 12, 2, 25, 1
EOS, PAD = 1, 0


def make_tokenizer(chat_template=None, size=512, pad=True):
    """Char-level offline tokenizer: <pad>=0, <eos>=1, <unk>=2, printable ASCII, then filler chars."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    chars = list(string.printable[:95]) + ["\n"]
    chars += [chr(0x100 + i) for i in range(size - len(specials) - len(chars))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    kwargs = dict(pad_token="<pad>") if pad else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", **kwargs)
    if chat_template:
        fast.chat_template = chat_template
    return fast


def make_model(quantized=False, lora=False, seed=0):
    """qwen2-tiny whose random outputs stop sometimes: lm_head x10, EOS row x3 more."""
    model = build_model("qwen2-tiny", seed=seed)
    if quantized:
        quantize_model(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
        model.lm_head.weight[EOS].mul_(3.0)
    if lora:
        model = attach_lora(model, r=4, seed=seed)
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model():
    return make_model()


def teacher_logits(model, r: Rollouts) -> torch.Tensor:
    """[rows, C, V] logits predicting each completion token, from one teacher-forced forward."""
    mask = r.attention_mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=r.input_ids, attention_mask=mask, position_ids=positions).logits.float()
    P = r.prompt_ids.shape[1]
    return logits[:, P - 1:-1]


def gathered(logp: torch.Tensor, r: Rollouts) -> torch.Tensor:
    return torch.where(r.completion_mask.bool(), logp.gather(-1, r.completion_ids[..., None]).squeeze(-1), 0.0)


def assert_same(a: Rollouts, b: Rollouts, atol=1e-4):
    assert a.prompts == b.prompts and a.texts == b.texts and a.finish_reasons == b.finish_reasons
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=atol, rtol=0)


# ----------------------------------------------------------------------------- layout

def test_greedy_layout_masks_and_finish_reasons(model, tok):
    n, max_new = 3, 12
    r = HFEngine(model, tok).generate(PROMPTS, n, SamplingParams(max_new, temperature=0))
    rows = len(PROMPTS) * n
    assert isinstance(r, Rollouts) and len(r) == rows and r.group_size == n
    assert r.prompts == [p for p in PROMPTS for _ in range(n)]
    # prompts: left-padded, mask counts the real tokens
    lengths = [len(tok(p)["input_ids"]) for p in PROMPTS]
    assert r.prompt_ids.shape == (rows, max(lengths))
    assert r.prompt_mask.sum(1).tolist() == [L for L in lengths for _ in range(n)]
    assert (r.prompt_mask[:, -1] == 1).all()                      # left padding: last column real
    assert (r.prompt_ids[r.prompt_mask == 0] == PAD).all()
    # completions: mask is a prefix of ones, padding after, logprobs 0 there and <= 0 on tokens
    C = r.completion_ids.shape[1]
    assert C <= max_new and r.logprobs.dtype == torch.float32
    lens = r.completion_lengths
    assert torch.equal(r.completion_mask, (torch.arange(C)[None] < lens[:, None]).long())
    assert (r.completion_ids[r.completion_mask == 0] == PAD).all()
    assert (r.logprobs[r.completion_mask == 0] == 0).all() and (r.logprobs[r.completion_mask == 1] <= 0).all()
    for i in range(rows):
        L, row = int(lens[i]), r.completion_ids[i].tolist()
        if r.finish_reasons[i] == "stop":
            assert row[L - 1] == EOS and EOS not in row[:L - 1]
            assert r.texts[i] == tok.decode(row[:L - 1])
        else:
            assert r.finish_reasons[i] == "length" and L == max_new and EOS not in row[:L]
            assert r.texts[i] == tok.decode(row[:L])
    assert {"stop", "length"} <= set(r.finish_reasons)
    # greedy: the n samples of a prompt are identical, groups differ
    for g in range(len(PROMPTS)):
        block = r.completion_ids[g * n:(g + 1) * n]
        assert (block == block[0]).all()
    assert not torch.equal(r.completion_ids[0], r.completion_ids[n])
    # convenience views and stats
    assert torch.equal(r.input_ids, torch.cat([r.prompt_ids, r.completion_ids], 1))
    assert r.attention_mask.shape == r.input_ids.shape
    assert set(r.stats) == {"rollout/tokens", "rollout/seconds", "rollout/tokens_per_s"}
    assert r.stats["rollout/tokens"] == int(lens.sum()) and r.stats["rollout/tokens_per_s"] > 0
    assert "prompts x 3" in repr(r)
    assert isinstance(HFEngine(model, tok), RolloutEngine)


def test_sampling_seeded_reproducible_diverse_and_leaves_global_rng_alone(model, tok):
    engine = HFEngine(model, tok)
    sp = SamplingParams(10, temperature=1.0, seed=123)
    torch.manual_seed(7)
    state = torch.get_rng_state()
    a = engine.generate(PROMPTS[:2], 4, sp)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG stream is untouched
    b = engine.generate(PROMPTS[:2], 4, sp)
    assert_same(a, b, atol=0)
    c = engine.generate(PROMPTS[:2], 4, SamplingParams(10, temperature=1.0, seed=124))
    assert not torch.equal(a.completion_ids, c.completion_ids)
    for g in range(2):  # samples of one prompt differ
        block = a.completion_ids[g * 4:(g + 1) * 4]
        assert len({tuple(row.tolist()) for row in block}) > 1
    # seed=None draws from the global RNG (and advances it)
    engine.generate(PROMPTS[:1], 2, SamplingParams(4))
    assert not torch.equal(torch.get_rng_state(), state)


# ----------------------------------------------------------------------------- log-probs

@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_teacher_forced_forward(model, tok, temperature):
    r = HFEngine(model, tok).generate(PROMPTS, 2, SamplingParams(10, temperature=temperature, seed=0))
    logits = teacher_logits(model, r)
    scaled = logits / (temperature or 1.0)   # greedy reports the raw (temperature 1) distribution
    expected = gathered(torch.log_softmax(scaled, -1), r)
    torch.testing.assert_close(r.logprobs, expected, atol=1e-4, rtol=0)
    if temperature == 0:
        argmax = logits.argmax(-1)
        assert torch.equal(r.completion_ids[r.completion_mask == 1], argmax[r.completion_mask == 1])


def test_top_k_top_p_logprobs_are_renormalized_over_kept_tokens(model, tok):
    T, k = 0.8, 5
    r = HFEngine(model, tok).generate(PROMPTS, 3, SamplingParams(10, temperature=T, top_k=k, seed=1))
    scaled = teacher_logits(model, r) / T
    topk = scaled.topk(k, dim=-1)
    real = r.completion_mask == 1
    in_topk = (topk.indices == r.completion_ids[..., None]).any(-1)
    assert in_topk[real].all()  # every sampled token survived the top-k filter
    expected = gathered(scaled, r) - torch.where(real, topk.values.logsumexp(-1), 0.0)
    torch.testing.assert_close(r.logprobs, expected, atol=1e-4, rtol=0)
    assert (r.logprobs[real] >= gathered(torch.log_softmax(scaled, -1), r)[real] - 1e-5).all()

    r = HFEngine(model, tok).generate(PROMPTS, 3, SamplingParams(10, temperature=T, top_p=0.5, seed=1))
    logp = torch.log_softmax(teacher_logits(model, r) / T, -1)
    real = r.completion_mask == 1
    full = gathered(logp, r)[real]
    assert (r.logprobs[real] >= full - 1e-5).all() and (r.logprobs[real] > full + 1e-3).any()


# ----------------------------------------------------------------------------- prefill sharing

@pytest.mark.parametrize("prompts", [PROMPTS, ["abcd", "efgh", "ijkl"]], ids=["padded", "unpadded"])
def test_share_prefill_matches_plain_expansion(model, tok, prompts):
    shared, plain = HFEngine(model, tok, share_prefill=True), HFEngine(model, tok, share_prefill=False)
    greedy = SamplingParams(10, temperature=0)
    shapes = []
    record = lambda _module, args: shapes.append(tuple(args[0].shape))  # noqa: E731
    hook = model.model.embed_tokens.register_forward_pre_hook(record)
    try:
        a = shared.generate(prompts, 3, greedy)
        first_shared, shapes[:] = shapes[:2], []
        b = plain.generate(prompts, 3, greedy)
    finally:
        hook.remove()
    B, P = len(prompts), a.prompt_ids.shape[1]
    assert first_shared == [(B, P - 1), (3 * B, 1)]  # prefix once per prompt, then one token per sample
    assert shapes[0] == (3 * B, P)                   # plain: every sample prefills the whole prompt
    assert_same(a, b)
    sampled = SamplingParams(10, temperature=1.0, seed=5)
    assert_same(shared.generate(prompts, 3, sampled), plain.generate(prompts, 3, sampled))


def test_micro_batches_match_one_batch(model, tok):
    greedy = SamplingParams(8, temperature=0)
    one = HFEngine(model, tok).generate(PROMPTS, 2, greedy)
    for batch_size in (1, 3):
        assert_same(HFEngine(model, tok, batch_size=batch_size).generate(PROMPTS, 2, greedy), one)


# ----------------------------------------------------------------------------- models

def test_quantized_lora_model_logprobs_and_adapter_is_applied(tok):
    model = make_model(quantized=True, lora=True)
    engine = HFEngine(model, tok)
    sp = SamplingParams(8, temperature=1.0, seed=0)
    r = engine.generate(PROMPTS, 2, sp)
    expected = gathered(torch.log_softmax(teacher_logits(model, r), -1), r)
    torch.testing.assert_close(r.logprobs, expected, atol=1e-4, rtol=0)
    assert_same(r, HFEngine(model, tok, share_prefill=False).generate(PROMPTS, 2, sp))
    greedy = SamplingParams(8, temperature=0)
    with model.disable_adapter():
        base = engine.generate(PROMPTS, 1, greedy)
    assert not torch.equal(engine.generate(PROMPTS, 1, greedy).completion_ids, base.completion_ids)


def test_restores_train_flags_and_needs_no_grad(tok):
    model = make_model()
    model.train()
    model.model.layers[0].eval()
    before = [m.training for m in model.modules()]
    r = HFEngine(model, tok).generate(PROMPTS[:2], 2, SamplingParams(4, seed=0))
    assert [m.training for m in model.modules()] == before
    assert not r.logprobs.requires_grad


def test_extra_stop_token_and_eos_as_pad(model, tok):
    greedy = SamplingParams(12, temperature=0)
    plain = HFEngine(model, tok).generate(PROMPTS, 1, greedy)
    long_row = plain.finish_reasons.index("length")
    stop_id = plain.completion_ids[long_row, 3].item()  # a token greedy decoding reaches later
    r = HFEngine(model, tok, stop_token_ids=[stop_id]).generate(PROMPTS, 1, greedy)
    assert r.finish_reasons[long_row] == "stop"
    L = int(r.completion_lengths[long_row])
    assert L <= 4 and r.completion_ids[long_row, L - 1] == stop_id
    assert r.texts[long_row] == tok.decode(r.completion_ids[long_row, :L - 1].tolist())
    # a tokenizer without a pad token pads with eos
    no_pad = make_tokenizer(pad=False)
    engine = HFEngine(model, no_pad)
    assert engine.pad_token_id == EOS
    r = engine.generate(PROMPTS, 1, greedy)
    assert (r.prompt_ids[r.prompt_mask == 0] == EOS).all() and no_pad.pad_token_id is None


# ----------------------------------------------------------------------------- helpers, errors

def test_from_lists_cat_and_to(model, tok):
    r = HFEngine(model, tok).generate(PROMPTS, 2, SamplingParams(6, seed=3))
    rows = range(len(r))
    rebuilt = Rollouts.from_lists(
        r.prompts, [r.prompt_ids[i][r.prompt_mask[i] == 1].tolist() for i in rows],
        [r.completion_ids[i][r.completion_mask[i] == 1].tolist() for i in rows],
        [r.logprobs[i][r.completion_mask[i] == 1].tolist() for i in rows],
        r.texts, r.finish_reasons, r.group_size, PAD)
    assert_same(rebuilt, r, atol=0)
    halves = [Rollouts.from_lists(r.prompts[s], [[5, 6]] * 4, [[7]] * 4, [[-0.5]] * 4, r.texts[s],
                                  r.finish_reasons[s], 2, PAD) for s in (slice(0, 4), slice(4, 8))]
    both = Rollouts.concat([r, *halves])
    assert len(both) == 16 and both.completion_ids.shape[1] == r.completion_ids.shape[1]
    assert torch.equal(both.prompt_ids[8:, -2:], torch.tensor([[5, 6]] * 8))
    assert (both.prompt_mask[8:, :-2] == 0).all() and both.logprobs[8:, 0].eq(-0.5).all()
    # select: whole groups, padding columns trimmed; concat of selections = the original rows
    short = Rollouts.from_lists(["a", "a"], [[5], [5]], [[7], [7]], [[-1.0], [-2.0]], ["", ""],
                                ["stop"] * 2, 2, PAD)
    padded = Rollouts.concat([r, short])
    back = padded.select(torch.arange(len(padded) - 2, len(padded)))
    assert back.prompt_ids.shape == (2, 1) and back.completion_ids.shape == (2, 1)
    assert_same(back, short, atol=0)
    assert_same(Rollouts.concat([padded.select(range(0, 4)), padded.select(range(4, 8))]), r, atol=0)
    with pytest.raises(ValueError, match="whole groups"):
        r.select([0, 1, 2])
    moved = r.to("cpu")
    assert moved is not r and torch.equal(moved.completion_ids, r.completion_ids)
    with pytest.raises(ValueError, match="groups of 3"):
        Rollouts.from_lists(r.prompts[:4], [[5]] * 4, [[7]] * 4, [[0.0]] * 4, r.texts[:4],
                            r.finish_reasons[:4], 3, PAD)
    with pytest.raises(ValueError, match="group sizes"):
        Rollouts.concat([r, Rollouts.from_lists(r.prompts[:1], [[5]], [[7]], [[0.0]], ["x"], ["stop"], 1, PAD)])


def test_errors(model, tok):
    engine = HFEngine(model, tok)
    with pytest.raises(ValueError, match="n .samples per prompt"):
        engine.generate(PROMPTS, 0, SamplingParams(4))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], 2, SamplingParams(4))
    with pytest.raises(TypeError, match="list of strings"):
        engine.generate("hello", 2, SamplingParams(4))
    with pytest.raises(ValueError, match="zero tokens"):
        engine.generate(["ok", ""], 1, SamplingParams(4))
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="batch_size"):
        HFEngine(model, tok, batch_size=0)


# ----------------------------------------------------------------------------- the contract: prompts, sync

def test_prompts_are_tokenized_once_and_every_input_form_gives_the_same_rollouts(model, tok):
    from qerl_kit.rollout import Prompts, as_prompts

    engine = HFEngine(model, tok)
    sp = SamplingParams(6, seed=2)
    encoded = Prompts.encode(tok, PROMPTS)
    assert encoded.texts == tuple(PROMPTS) and [len(p) for p in encoded.ids] == [12, 2, 25, 1]
    from_texts = engine.generate(PROMPTS, 2, sp)
    from_prompts = engine.generate(encoded, 2, sp)
    from_ids = engine.generate([list(p) for p in encoded.ids], 2, sp)
    assert_same(from_prompts, from_texts, atol=0)
    assert torch.equal(from_ids.completion_ids, from_texts.completion_ids) and from_ids.prompts == [""] * 8
    assert as_prompts(encoded) is encoded and encoded[1:3].texts == tuple(PROMPTS[1:3])
    gen = engine.generate_ids(encoded, 2, sp)  # the token-level result: no texts
    assert torch.equal(gen.completion_ids, from_texts.completion_ids) and gen.stopped.dtype == torch.bool
    with pytest.raises(ValueError, match="zero tokens"):
        as_prompts([[5], []])
    with pytest.raises(ValueError, match="need a tokenizer"):
        as_prompts(["text"], None)


def test_sync_puts_the_steps_noise_in_for_the_block_only(model, tok):
    from qerl_kit.aqn import AQN

    engine = HFEngine(model, tok)
    aqn = AQN(total_steps=10, stages=10, seed=1)
    norms = aqn.norms(model)
    clean = [n.weight.detach().clone() for n in norms]
    with engine.sync(model, noise=aqn, step=5) as info:
        assert info["aqn/norms"] == len(norms) > 0
        assert not torch.equal(norms[0].weight, clean[0])     # the rollout reads noisy norms
        noisy = engine.generate(PROMPTS, 2, SamplingParams(6, seed=3))
    assert all(torch.equal(n.weight, c) for n, c in zip(norms, clean))  # gone before any training forward
    plain = engine.generate(PROMPTS, 2, SamplingParams(6, seed=3))
    assert not torch.equal(noisy.logprobs, plain.logprobs)
    with engine.sync(model) as info:                            # no noise: nothing to do
        assert info == {}
    with pytest.raises(ValueError, match="generates with its own model"):
        with engine.sync(make_model(seed=1)):
            pass
