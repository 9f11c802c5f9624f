"""The vLLM rollout backend around vLLM itself: adapter directories, norm mapping, AQN on vLLM's
norms, the call sequence against a fake ``vllm`` module, and the missing-vLLM/CUDA errors.

vLLM itself never runs here (no GPU, not installed): these tests pin what we send to it and how
we read what it returns, with the API of vLLM >= 0.10.1.
"""

import dataclasses
import json
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from qerl_kit.rollout import vllm as vllm_backend
from qerl_kit.aqn import AQN
from qerl_kit.lora import attach_lora, load_lora
from qerl_kit.models import build_model
from qerl_kit.quantize import quantize_model
from qerl_kit.rollout import Prompts, Rollouts, SamplingParams
from qerl_kit.rollout.vllm import (AdapterWriter, VLLMEngine, hf_norm_names, resolve_norms,
                                   vllm_norm_names)

EOS, PAD = 1, 0
ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


# ---- a fake vLLM ----------------------------------------------------------------------------------
class VllmRMSNorm(nn.Module):  # vLLM's own class: transformers' isinstance checks would miss it
    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16))


def fake_vllm_model(layers=2, hidden=64, drop=None):
    """vLLM's module tree for Qwen2: fused qkv_proj / gate_up_proj, HF names for the norms."""
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList()
    for i in range(layers):
        layer = nn.Module()
        layer.input_layernorm = VllmRMSNorm(hidden)
        if drop != i:
            layer.post_attention_layernorm = VllmRMSNorm(hidden)
        layer.self_attn, layer.mlp = nn.Module(), nn.Module()
        layer.self_attn.qkv_proj, layer.mlp.gate_up_proj = nn.Linear(2, 2), nn.Linear(2, 2)
        root.model.layers.append(layer)
    root.model.norm = VllmRMSNorm(hidden)
    return root


@dataclasses.dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclasses.dataclass
class Logprob:
    logprob: float


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    logprobs: list
    finish_reason: str


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


def _min_tokens_run(kw: dict, i: int, j: int) -> list[int]:
    """A request with ``min_tokens`` as vLLM runs it: this request's model would write EOS as its
    2nd and 4th token; a stop id (EOS, ``stop_token_ids``) is masked until ``min_tokens`` tokens exist
    (the next likeliest token instead), then stops the request, EOS only without ``ignore_eos``;
    ``max_tokens`` ends it."""
    stops = {EOS, *(kw.get("stop_token_ids") or ())}
    toks = []
    for t in [40 + i, EOS, 50 + j, EOS] + [60 + k for k in range(kw["max_tokens"])]:
        if len(toks) == kw["max_tokens"]:
            break
        if t in stops and len(toks) < kw["min_tokens"]:
            t = 70 + len(toks)  # masked
        toks.append(t)
        if t in stops and not (t == EOS and kw.get("ignore_eos")):
            break
    return toks


class FakeLLM:
    """Records calls; ``generate`` answers completion j of prompt i with tokens 10+i, 20+j, ..."""

    has_logprobs_mode = True

    def __init__(self, **kwargs):
        if "logprobs_mode" in kwargs and not self.has_logprobs_mode:
            raise TypeError("EngineArgs.__init__() got an unexpected keyword argument 'logprobs_mode'")
        self.kwargs, self.calls, self.model = kwargs, [], fake_vllm_model()
        self.llm_engine = types.SimpleNamespace(remove_lora=lambda i: self.calls.append(("remove_lora", i)))

    def generate(self, prompts, params, lora_request=None, use_tqdm=True):
        self.calls.append(("generate", prompts, params, lora_request))
        outs = []
        for i, _ in enumerate(prompts):
            comps = []
            p = params[i] if isinstance(params, list) else params  # a list: one SamplingParams per request
            for j in range(p.kwargs["n"]):
                stop = j % 2 == 0
                toks = [10 + i, 20 + j] + ([EOS] if stop else [30, 31])
                if "min_tokens" in p.kwargs:
                    toks = _min_tokens_run(p.kwargs, i, j)
                    stop = toks[-1] in {EOS, *(p.kwargs.get("stop_token_ids") or ())}
                comps.append(CompletionOutput(j, f"p{i}c{j}", toks, [{t: Logprob(-0.1 * (k + 1) - j)} for k, t in enumerate(toks)],
                                              "stop" if stop else "length"))
            outs.append(types.SimpleNamespace(outputs=comps[::-1]))  # vLLM does not promise order
        return outs

    def apply_model(self, fn):
        self.calls.append(("apply_model",))
        return [fn(self.model)]

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up",))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


@pytest.fixture
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = FakeLLM, FakeSamplingParams
    lora, request = types.ModuleType("vllm.lora"), types.ModuleType("vllm.lora.request")
    request.LoRARequest = LoRARequest
    vllm.lora, lora.request = lora, request
    for name, mod in (("vllm", vllm), ("vllm.lora", lora), ("vllm.lora.request", request)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # an 80 GiB GPU for the memory planner (the Trainer sizes vLLM's share from it)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 << 30))
    monkeypatch.setenv(ENV, "restored-after-the-test")
    monkeypatch.delenv(ENV)
    return vllm


class Tok:
    eos_token_id, pad_token_id = EOS, PAD

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[100 + ord(c) % 50 for c in t] for t in texts]}

    def save_pretrained(self, path):  # what save_nvfp4 calls: vLLM reads the tokenizer from the checkpoint
        (Path(path) / "tokenizer.json").write_text("{}")
        return [str(Path(path) / "tokenizer.json")]


def _peft(train_norms=True, r=4):
    model = build_model("qwen2-tiny", dtype=torch.bfloat16)
    quantize_model(model)
    peft = attach_lora(model, r=r, train_norms=train_norms, seed=0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return peft


# ---- pure parts -----------------------------------------------------------------------------------
def test_vllm_norm_names_strip_peft_prefixes_and_wrappers():
    names = ["base_model.model.model.layers.0.input_layernorm.modules_to_save.default",
             "base_model.model.model.layers.0.post_attention_layernorm.original_module",
             "model.layers.1.input_layernorm", "model.layers.1.input_layernorm"]
    assert vllm_norm_names(names) == ["model.layers.0.input_layernorm",
                                      "model.layers.0.post_attention_layernorm", "model.layers.1.input_layernorm"]


def test_structural_norms_resolve_on_a_vllm_tree_with_the_count_asserted():
    from qerl_kit.aqn import find_noise_norms

    peft = _peft(train_norms=True)
    norms = find_noise_norms(peft)
    names = vllm_norm_names(hf_norm_names(peft, norms))
    assert len(norms) == 4 and len(names) == 4
    modules = resolve_norms(fake_vllm_model(), names, expected=len(norms))
    assert all(isinstance(m, VllmRMSNorm) for m in modules)
    with pytest.raises(ValueError, match="no module 'model.layers.1.post_attention_layernorm'"):
        resolve_norms(fake_vllm_model(drop=1), names, expected=len(norms))
    with pytest.raises(ValueError, match="expected 5"):
        resolve_norms(fake_vllm_model(), names, expected=5)


def test_adapter_writer_uses_tmpfs_fresh_ids_and_a_loadable_lora_only_adapter():
    peft = _peft(train_norms=True)
    writer = AdapterWriter()
    try:
        if vllm_backend.os.path.isdir("/dev/shm"):
            assert str(writer.root).startswith("/dev/shm/")
        id1, p1 = writer.write(peft)
        id2, p2 = writer.write(peft)
        assert (id1, id2) == (1, 2) and p1 != p2 and not p1.exists() and p2.exists()
        tensors = load_file(str(p2 / "adapter_model.safetensors"))
        assert tensors and all("lora_" in k for k in tensors)
        config = json.loads((p2 / "adapter_config.json").read_text())
        assert config["modules_to_save"] is None and config["r"] == 4
        assert peft.peft_config["default"].modules_to_save  # the live config is untouched
        fresh = build_model("qwen2-tiny", dtype=torch.bfloat16)
        quantize_model(fresh)
        reloaded = load_lora(fresh, str(p2))
        ours = dict(peft.named_parameters())
        for name, p in reloaded.named_parameters():
            if "lora_" in name:
                assert torch.equal(p.to(ours[name].dtype), ours[name]), name
    finally:
        writer.cleanup()
    assert not writer.root.exists()


# ---- errors ---------------------------------------------------------------------------------------
def test_missing_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"pip install 'qerl_kit\[vllm\]'"):
        VLLMEngine("ckpt", Tok())


def test_missing_cuda_is_a_clear_runtime_error(fake_vllm, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU.*HFEngine"):
        VLLMEngine("ckpt", Tok())


# ---- the call sequence ----------------------------------------------------------------------------
def test_llm_is_built_on_the_checkpoint_with_lora_and_sleep_mode(fake_vllm, tmp_path):
    engine = VLLMEngine(tmp_path, Tok(), gpu_memory_utilization=0.25, max_lora_rank=40, max_model_len=512,
                        enforce_eager=True)
    kw = engine.llm.kwargs
    assert kw["model"] == str(tmp_path) and kw["enable_lora"] is True and kw["max_lora_rank"] == 64
    assert kw["gpu_memory_utilization"] == 0.25 and kw["enable_sleep_mode"] is True
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["max_model_len"] == 512
    assert kw["trust_remote_code"] is False and kw["enforce_eager"] is True
    assert vllm_backend.os.environ[ENV] == "0"  # the engine core stays in this process
    FakeLLM.has_logprobs_mode = False  # vLLM 0.10.1: no logprobs_mode, retried without it
    try:
        old = VLLMEngine(tmp_path, Tok())
    finally:
        FakeLLM.has_logprobs_mode = True
    assert "logprobs_mode" not in old.llm.kwargs and old.logprobs_mode == "raw_logprobs"
    engine.close()
    old.close()


def test_without_vllms_tokenizer_the_engine_decodes_and_ignore_eos_reaches_vllm(fake_vllm, tmp_path):
    class DecodingTok(Tok):
        def batch_decode(self, rows, skip_special_tokens=True):
            return ["-".join(map(str, r)) for r in rows]

    engine = VLLMEngine(tmp_path, DecodingTok(), skip_tokenizer_init=True, ignore_eos=True)
    assert engine.llm.kwargs["skip_tokenizer_init"] is True
    out = engine.generate(["ab"], n=2, sampling=SamplingParams(max_new_tokens=4))
    params = engine.llm.calls[-1][2]
    assert params.kwargs["detokenize"] is False and params.kwargs["ignore_eos"] is True
    # completion 0 stopped on EOS (dropped from the text), completion 1 ran to the length
    assert out.texts == ["10-20", "10-21-30-31"]


def test_stop_after_sends_one_request_per_row_forced_to_its_length(fake_vllm, tmp_path):
    # the whole-step bench forces realistic lengths on vLLM as on the StaticEngine (stop_after)
    engine = VLLMEngine(tmp_path, Tok(), ignore_eos=True)
    lengths = [3, 1, 5, 2, 4, 6]
    gen = engine.generate_ids([[101, 102], [103]], n=3, sampling=SamplingParams(max_new_tokens=8, seed=7),
                              stop_after=lengths)
    _, requests, params, _ = engine.llm.calls[-1]
    assert [r["prompt_token_ids"] for r in requests] == [[101, 102]] * 3 + [[103]] * 3  # prompt-major rows
    assert [(p.kwargs["n"], p.kwargs["max_tokens"], p.kwargs["min_tokens"]) for p in params] == \
        [(1, L, L) for L in lengths]
    assert [p.kwargs["seed"] for p in params] == [7, 8, 9, 10, 11, 12]  # distinct samples within a group
    assert gen.completion_mask.sum(1).tolist() == lengths
    # each row's model wrote EOS as its 2nd token: min_tokens masked it, the row still ran to its length
    assert all(EOS not in row[:L].tolist() for row, L in zip(gen.completion_ids, lengths))
    assert gen.completion_ids[2, :5].tolist() == [42, 71, 50, 73, 60]  # request 2, length 5
    # the fake keeps vLLM's rule: once min_tokens are out, a stop id ends the request (EOS unless ignore_eos)
    assert _min_tokens_run(dict(max_tokens=6, min_tokens=2), 0, 0) == [40, 71, 50, EOS]
    assert _min_tokens_run(dict(max_tokens=6, min_tokens=2, ignore_eos=True), 0, 0) == [40, 71, 50, EOS, 60, 61]
    with pytest.raises(ValueError, match="one length >= 1 per row \\(6\\); got 2 values"):
        engine.generate_ids([[101, 102], [103]], n=3, stop_after=[1, 2])
    with pytest.raises(ValueError, match="smallest 0"):
        engine.generate_ids([[101, 102], [103]], n=3, stop_after=[1, 2, 0, 1, 1, 1])
    engine.generate_ids([[101, 102]], n=2, sampling=SamplingParams(max_new_tokens=4))
    assert engine.llm.calls[-1][2].kwargs["max_tokens"] == 4 and "min_tokens" not in engine.llm.calls[-1][2].kwargs


def test_sync_generate_and_sleep_sequence(fake_vllm, tmp_path):
    peft = _peft(train_norms=False)
    engine = VLLMEngine(tmp_path, Tok())
    llm = engine.llm
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(["ab"], 2)
    with engine.awake():
        req1 = engine._upload_adapter(peft)
        req2 = engine._upload_adapter(peft)
        out = engine.generate(["ab", "xyz"], n=3, sampling=SamplingParams(max_new_tokens=8, temperature=0.7,
                                                                          top_p=0.9, top_k=0, seed=3))
    assert (req1.lora_int_id, req2.lora_int_id) == (1, 2) and req2.lora_path.endswith("adapter-2")
    assert [c[0] for c in llm.calls] == ["sleep", "wake_up", "reset_prefix_cache", "remove_lora",
                                         "reset_prefix_cache", "generate", "sleep"]
    assert ("remove_lora", 1) in llm.calls  # no norms trained, no AQN: no apply_model
    _, prompts, params, lora_request = llm.calls[5]
    assert lora_request is req2
    assert prompts == [{"prompt_token_ids": Tok()(["ab"])["input_ids"][0]},
                       {"prompt_token_ids": Tok()(["xyz"])["input_ids"][0]}]
    assert params.kwargs == dict(n=3, max_tokens=8, temperature=0.7, top_p=0.9, top_k=-1, seed=3, logprobs=0,
                                 skip_special_tokens=True, stop_token_ids=None)
    # the conversion into Rollouts
    assert isinstance(out, Rollouts) and len(out) == 6 and out.group_size == 3
    assert out.prompts == ["ab"] * 3 + ["xyz"] * 3 and out.texts[:3] == ["p0c0", "p0c1", "p0c2"]
    assert out.finish_reasons == ["stop", "length", "stop"] * 2
    assert out.prompt_ids.shape == (6, 3) and out.prompt_mask[:3].tolist() == [[0, 1, 1]] * 3  # left-padded
    assert out.completion_ids.shape == (6, 4)
    assert out.completion_ids[0].tolist() == [10, 20, EOS, PAD] and out.completion_mask[0].tolist() == [1, 1, 1, 0]
    assert out.completion_ids[4].tolist() == [11, 21, 30, 31] and out.completion_mask[4].tolist() == [1, 1, 1, 1]
    assert out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs[1], torch.tensor([-1.1, -1.2, -1.3, -1.4]))
    assert out.logprobs[0, 3] == 0 and out.stats["rollout/tokens"] == int(out.completion_mask.sum())
    with pytest.raises(ValueError, match="max_lora_rank"):
        engine._upload_adapter(_peft(train_norms=False, r=128))
    engine.close()


def test_aqn_and_trained_norms_reach_vllms_own_norms(fake_vllm, tmp_path):
    peft = _peft(train_norms=True)
    with torch.no_grad():  # trained norms differ from the base's
        for name, p in peft.named_parameters():
            if "modules_to_save" in name:
                p.add_(0.25)
    hf_norm = lambda i, which: getattr(peft.base_model.model.model.layers[i], which).modules_to_save["default"].weight  # noqa: E731
    clean = hf_norm(1, "post_attention_layernorm").detach().clone()
    engine = VLLMEngine(tmp_path, Tok())
    vnorm = engine.llm.model.model.layers[1].post_attention_layernorm.weight
    aqn = AQN(total_steps=10, stages=10, seed=7)
    engine._upload_adapter(peft, aqn=aqn, step=0)  # stage 0: trained norms, no noise
    assert torch.equal(vnorm, clean)
    assert torch.equal(engine.llm.model.model.norm.weight, torch.ones(64, dtype=torch.bfloat16))  # final norm untouched
    engine._upload_adapter(peft, aqn=aqn, step=5)
    assert torch.equal(hf_norm(1, "post_attention_layernorm"), clean)  # the HF model is restored
    twin = AQN(total_steps=10, stages=10, seed=7)
    with twin.noise(peft, step=5):
        expected = hf_norm(1, "post_attention_layernorm").detach().clone()
    assert torch.equal(vnorm, expected) and not torch.equal(vnorm, clean)
    engine._upload_adapter(peft, aqn=aqn, step=0)  # back to noise-free: nothing accumulates
    assert torch.equal(vnorm, clean)
    assert [c[0] for c in engine.llm.calls].count("apply_model") == 3
    engine.llm.model = fake_vllm_model(drop=0)  # a vLLM model whose norms do not all resolve
    with pytest.raises(ValueError, match="no module"):
        engine._upload_adapter(peft, aqn=aqn, step=5)
    engine.close()


# ---- the rollout contract: sync, from_policy, the registry, the Trainer driving it ------------------
def _lora_file(engine) -> dict:
    return load_file(str(Path(engine.lora_request.lora_path) / "adapter_model.safetensors"))


def test_sync_wakes_uploads_the_adapter_and_the_steps_noise_then_sleeps(fake_vllm, tmp_path):
    peft = _peft(train_norms=False)
    engine = VLLMEngine(tmp_path, Tok())
    engine.sleep()
    aqn = AQN(total_steps=10, stages=10, seed=7)
    with engine.sync(peft, noise=aqn, step=5) as info:
        assert not engine.asleep
        out = engine.generate(Prompts.encode(Tok(), ["ab"]), 2)
    assert engine.asleep and info["aqn/norms"] == 4 and info["sync/seconds"] >= 0
    assert all(info[f"sync/{k}_seconds"] >= 0 for k in ("wake", "upload", "sleep"))  # sleep: filled on exit
    calls = [c[0] for c in engine.llm.calls]
    assert calls == ["sleep", "wake_up", "apply_model", "reset_prefix_cache", "generate", "sleep"]
    assert engine.llm.calls[4][3] is engine.lora_request and out.prompts == ["ab", "ab"]
    with engine.sync(peft, noise=aqn, step=0) as info:  # AQN's noise-free stage: clean norms, none perturbed
        pass
    assert info["aqn/norms"] == 0
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(["ab"], 1)
    with pytest.raises(ValueError, match="needs the policy"):
        with engine.sync(None, noise=aqn, step=1):
            pass
    engine.close()


def test_a_stale_adapter_never_reaches_vllm(fake_vllm, tmp_path):
    """Each sync sends the adapter as it is now; a change after a sync reaches vLLM at the next one."""
    peft = _peft(train_norms=False)
    engine = VLLMEngine(tmp_path, Tok(), enable_sleep_mode=False)
    lora = {n: p for n, p in peft.named_parameters() if "lora_B" in n}
    with engine.sync(peft):
        first, first_id = _lora_file(engine), engine.lora_request.lora_int_id
    with torch.no_grad():
        for p in lora.values():
            p.add_(1.0)  # an optimizer step
    with engine.sync(peft):
        second = _lora_file(engine)
    assert engine.lora_request.lora_int_id == first_id + 1 and ("remove_lora", first_id) in engine.llm.calls
    key = next(k for k in second if "lora_B" in k)
    assert torch.equal(second[key], first[key] + 1.0)
    assert "sleep" not in [c[0] for c in engine.llm.calls]  # sleep mode off: never put to sleep
    engine.close()


def test_from_policy_exports_the_base_and_make_engine_builds_it(fake_vllm):
    from qerl_kit.rollout import make_engine

    peft = _peft(train_norms=False, r=16)
    engine = make_engine("vllm", peft, Tok(), gpu_memory_utilization=0.4)
    export = Path(engine.llm.kwargs["model"])
    config = json.loads((export / "config.json").read_text())
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized" and (export / "tokenizer.json").exists()
    assert engine.llm.kwargs["max_lora_rank"] == 16 and engine.llm.kwargs["gpu_memory_utilization"] == 0.4
    engine.close()
    assert not export.exists()  # the temporary export goes with the engine


def test_the_trainer_drives_vllm_syncing_before_every_rollout(fake_vllm, tmp_path):
    from qerl_kit.config import from_dict
    from qerl_kit.tasks import Task
    from qerl_kit.trainer import Trainer

    peft = _peft(train_norms=False)
    rows = [{"prompt": p} for p in ("ab", "cd", "ef", "gh")]
    task = Task("fake", rows, [], (lambda completions, **_: [float(c.endswith("c1")) for c in completions],),
                lambda tok, row: row["prompt"])
    cfg = from_dict(dict(rollout=dict(batch_size=4, group_size=2, max_new_tokens=4, engine="vllm"),
                         loss=dict(micro_batch=4), aqn=dict(stages=3), total_steps=3, save_every=0,
                         output_dir=str(tmp_path / "run")))
    trainer = Trainer(peft, Tok(), task, cfg, progress="none")
    assert isinstance(trainer.engine, VLLMEngine)
    kwargs = trainer.engine.llm.kwargs  # sized for this run: 2-character prompts + 4 new tokens, in 64s
    assert kwargs["max_model_len"] == 64 and 0.05 <= kwargs["gpu_memory_utilization"] <= 0.1
    trainer.train(3)
    calls = [c[0] for c in trainer.engine.llm.calls]
    generates = [i for i, c in enumerate(calls) if c == "generate"]
    assert len(generates) == 3 and all(calls[i - 1] == "reset_prefix_cache" and calls[i + 1] == "sleep"
                                       for i in generates)  # adapter synced right before, asleep right after
    requests = [trainer.engine.llm.calls[i][3].lora_int_id for i in generates]
    assert requests == sorted(set(requests))  # a new adapter version for every rollout
    assert [r["aqn/norms"] for r in trainer.history] == [0, 4, 4]  # noise reached vLLM's norms from stage 1
    assert all("time/sync" in r for r in trainer.history)
    assert all(r[k] >= 0 for r in trainer.history for k in ("time/wake", "time/upload", "time/sleep"))
    trainer.engine.close()


def test_a_sync_without_noise_after_a_noisy_one_puts_the_clean_norms_back(fake_vllm, tmp_path):
    """An evaluation (sync without AQN) right after a noisy rollout must not generate with that noise."""
    peft = _peft(train_norms=False)
    engine = VLLMEngine(tmp_path, Tok())
    vnorm = engine.llm.model.model.layers[1].post_attention_layernorm.weight
    hf_norm = peft.base_model.model.model.layers[1].post_attention_layernorm.weight
    aqn = AQN(total_steps=10, stages=10, seed=7)
    applies = lambda: [c[0] for c in engine.llm.calls].count("apply_model")  # noqa: E731
    with engine.sync(peft):  # clean and nothing trained: no norms to send
        pass
    assert applies() == 0 and not engine.noisy_norms
    with engine.sync(peft, noise=aqn, step=5):
        pass
    assert engine.noisy_norms and not torch.equal(vnorm, hf_norm.to(vnorm.dtype))
    with engine.sync(peft):  # no noise now: vLLM's norms go back to the clean ones
        pass
    assert applies() == 2 and not engine.noisy_norms and torch.equal(vnorm, hf_norm.to(vnorm.dtype))
    with engine.sync(peft):  # already clean: nothing more sent
        pass
    assert applies() == 2
    with engine.sync(peft, noise=aqn, step=0):  # AQN's noise-free stage sends clean norms, nothing noisy left
        pass
    assert applies() == 3 and not engine.noisy_norms
    engine.close()


def test_the_trainer_moves_engine_rollouts_to_the_policys_device(fake_vllm, tmp_path, monkeypatch):
    """vLLM's Rollouts are CPU tensors; the trainer moves them to the policy's device before scoring them."""
    from qerl_kit.config import from_dict
    from qerl_kit.tasks import Task
    from qerl_kit.trainer import Trainer

    moved = []
    original = Rollouts.to
    monkeypatch.setattr(Rollouts, "to", lambda self, device: moved.append(torch.device(device)) or original(self, device))
    peft = _peft(train_norms=False)
    task = Task("fake", [{"prompt": "ab"}, {"prompt": "cd"}], [], (lambda completions, **_: [1.0] * len(completions),),
                lambda tok, row: row["prompt"])
    cfg = from_dict(dict(rollout=dict(batch_size=4, group_size=2, max_new_tokens=4, engine="vllm"),
                         loss=dict(micro_batch=4), aqn=dict(enabled=False), total_steps=1, save_every=0,
                         output_dir=str(tmp_path / "run")))
    trainer = Trainer(peft, Tok(), task, cfg, progress="none")
    trainer.train(1)
    assert moved == [torch.device("cpu")]  # the device of the policy's trainable parameters
    trainer.engine.close()


def test_the_rollout_config_sets_vllms_memory_share(fake_vllm, tmp_path):
    from qerl_kit.config import ConfigError, from_dict
    from qerl_kit.rollout.registry import engine_options
    from qerl_kit.tasks import Task

    task = Task("fake", [{"prompt": "x" * 100}, {"prompt": "ab"}], [{"prompt": "y" * 130}],
                (lambda completions, **_: [0.0] * len(completions),), lambda tok, row: row["prompt"])
    cfg = from_dict(dict(rollout=dict(batch_size=4, group_size=2, max_new_tokens=60, engine="vllm",
                                      vllm_gpu_memory=0.4)))
    assert engine_options(cfg.rollout, _peft(), Tok(), task, 4) == {"max_model_len": 192, "gpu_memory_utilization": 0.4}
    hf = from_dict(dict(rollout=dict(batch_size=4, group_size=2, engine="hf")))
    assert engine_options(hf.rollout, _peft(), Tok(), task, 4) == {}
    with pytest.raises(ConfigError, match="rollout.vllm_gpu_memory"):
        from_dict(dict(rollout=dict(vllm_gpu_memory=0.99)))
