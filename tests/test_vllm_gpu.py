"""vLLM as the Trainer's rollout engine, on a real GPU with vLLM installed (issue #26).

Skipped unless CUDA is available and ``import vllm`` works (markers ``gpu`` and ``vllm``). Run on
the H200, after the vLLM install exports, with::

    QERL_GPU_RESULTS=$OUT python3 -m pytest tests/test_vllm_gpu.py -m "gpu and vllm" -q -s -rA

One ``vllm.LLM`` for the whole module (a start costs 30-60 s): the ``vllm_setup`` fixture exports
the tiny NVFP4 base once and every test syncs its own policy's adapter into that engine (the base
of every policy built here is bit-identical, which ``_policy`` checks). What the tests assert:

1. ``test_trainer_on_vllm_learns_like_the_static_engine``: GRPO on the shipped tiny model with the
   ``tiny-cpu`` preset (the demo's recipe, 30 steps, AQN on), same seeds, once with the
   StaticEngine and once with vLLM driven by the Trainer: held-out greedy accuracy ~25% before and
   >= 90% after, for both; AQN noise reached vLLM's norms at every noisy step; per-step curves.
2. ``test_aqn_noise_reaches_vllm``: after a sync with AQN, vLLM's own norm vectors hold exactly the
   noisy values and its (seeded) outputs change; a sync without noise restores the clean norms and
   exactly the clean outputs.
3. ``test_vllm_serves_the_current_adapter_not_a_stale_one``: vLLM's sampled-token log-probs match
   the HF policy (with LoRA) before and after an optimizer step, and after the step they match the
   new policy much better than the old one.
4. ``test_sleep_frees_and_wake_restores_memory``: sleep frees most of vLLM's KV cache
   (``torch.cuda.mem_get_info``), wake takes it back, and greedy outputs after wake equal before.
5. ``test_adapter_sync_time``: the cost of a sync (upload, LoRA load on first use, full
   wake/upload/sleep cycle) measured; the Trainer's per-step ``time/sync`` is recorded by test 1.

Every number goes to ``$QERL_GPU_RESULTS/vllm_gpu_tests.json`` (default: a fresh temporary
directory, printed), rewritten after each record so a crash keeps what was measured. Settings:
``QERL_VLLM_GPU_UTIL`` (default 0.1 of the GPU: ~14 GiB on an H200, the tiny model needs MBs),
``QERL_VLLM_EAGER=1`` (no torch.compile / CUDA graphs; default off, as the Trainer runs it).
"""

from __future__ import annotations

import functools
import gc
import json
import math
import os
import platform
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

# Before vLLM is imported: its engine core in this process (LLM.apply_model reaches the model),
# and the PyTorch sampler (the install exports set this too).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    try:
        import vllm  # noqa: F401
    except Exception as err:  # noqa: BLE001 - an ImportError, or a broken install: skip either way
        return f"needs vLLM ({type(err).__name__}: {str(err)[:200]})"
    return None


SKIP = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

DEVICE = "cuda"
SEED = 0
VLLM_KW = dict(gpu_memory_utilization=float(os.environ.get("QERL_VLLM_GPU_UTIL", "0.1")),
               enforce_eager=os.environ.get("QERL_VLLM_EAGER", "0") == "1", seed=SEED,
               max_num_seqs=128)  # every batch here is <= 64 sequences: fewer CUDA graphs to capture at start
# Limits. Log-probs: HF (our NVFP4 layers + peft LoRA, bf16) and vLLM (Marlin FP4 + punica LoRA,
# bf16) round differently; 0.05 nats mean |diff| per token is generous, the stale-adapter and
# AQN checks below compare against the size of the change, not only against this.
LOGP_TOL = 0.05
AQN_SIGMA = 0.2   # test 2's noise: 20x the preset's sigma_start, well below where the tiny model breaks (~0.7)
LORA_STD = 0.1    # the probes' LoRA B ~ N(0, LORA_STD) (0 at init), so that the adapter itself shows in the log-probs
STEP_LR = 5e-3    # test 3's Adam step: big enough to move the sampled tokens' log-probs by far more than LOGP_TOL


# ---- results: one JSON file, rewritten after every record ------------------------------------------
class Results:
    def __init__(self, path: Path):
        self.path, self.data = path, {"meta": self._meta()}
        self.write()
        print(f"\n[vllm-gpu] results: {self.path}")

    @staticmethod
    def _meta() -> dict:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
                "python": platform.python_version(), "settings": {**VLLM_KW, "seed": SEED, "logp_tol": LOGP_TOL,
                                                                   "aqn_sigma": AQN_SIGMA, "lora_std": LORA_STD,
                                                                   "step_lr": STEP_LR}}
        try:
            import vllm

            meta["vllm"] = vllm.__version__
            meta["device"] = torch.cuda.get_device_name()
            meta["gpu_total_bytes"] = torch.cuda.mem_get_info()[1]
        except Exception as err:  # noqa: BLE001 - metadata only
            meta["meta_error"] = repr(err)
        return meta

    def record(self, name: str, values: dict) -> None:
        self.data.setdefault(name, {}).update(values)
        self.write()
        short = {k: v for k, v in values.items() if not isinstance(v, list)}  # curves stay in the file
        print(f"[vllm-gpu] {name}: {json.dumps(short, default=str)}")

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=_jsonable))


def _jsonable(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return str(x)


def _optional(results: Results, section: str, key: str, fn):
    """Run an extra measurement; its failure is recorded, never hides the test's own assertions."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001
        results.record(section, {f"{key}_error": f"{type(err).__name__}: {err}"[:500]})
        traceback.print_exc()
        return None


@pytest.fixture(scope="module")
def results():
    out = Path(os.environ.get("QERL_GPU_RESULTS") or tempfile.mkdtemp(prefix="qerl-gpu-results-"))
    out.mkdir(parents=True, exist_ok=True)
    rec = Results(out / "vllm_gpu_tests.json")
    yield rec
    rec.write()


# ---- the policy, the task, the config --------------------------------------------------------------
def _config(engine: str, output_dir: Path):
    """The demo's recipe (``tiny-cpu``: 30 steps of 64 completions, lr 2e-3, AQN 1e-2 -> 5e-4) with
    the rollout engine switched; no checkpoints."""
    from qerl_kit.config import preset

    return preset("tiny-cpu", rollout=dict(engine=engine), seed=SEED, save_every=0, output_dir=str(output_dir))


@functools.lru_cache(maxsize=1)
def _task():
    """The arithmetic task of the preset (20000 generated training rows, 200 held-out), built once."""
    from qerl_kit.tasks import make_task

    return make_task(_config("static", Path("unused")).data)


_BASE_BUFFERS: dict = {}


def _policy(seed: int = SEED, lora_std: float = 0.0):
    """The tiny model on the GPU in bf16, NVFP4, LoRA r16 (as the experiments grid builds it).
    ``lora_std > 0`` draws B ~ N(0, lora_std) (B is 0 at init) so the adapter changes the outputs.
    Every policy's packed base must equal the first one's: that base is what vLLM was given."""
    from qerl_kit.build import build_policy

    torch.manual_seed(seed)
    policy, tok, _ = build_policy(_config("static", Path("unused")).model, device=DEVICE, dtype=torch.bfloat16,
                                  seed=seed)
    if lora_std:
        gen = torch.Generator().manual_seed(1000 + seed)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * lora_std)
    buffers = {n: b for n, b in policy.named_buffers() if "inv_freq" not in n}
    if not _BASE_BUFFERS:
        _BASE_BUFFERS.update({n: b.detach().clone() for n, b in buffers.items()})
    else:
        assert buffers.keys() == _BASE_BUFFERS.keys(), "the policies' bases have different tensors"
        differ = [n for n, b in buffers.items() if not torch.equal(b, _BASE_BUFFERS[n])]
        if differ:  # not expected (quantization is deterministic); then vLLM's base goes in, and it is said
            print(f"[vllm-gpu] WARNING: {len(differ)} base tensors differ between builds ({differ[:3]}); "
                  "copying the exported base's into this policy")
            with torch.no_grad():
                for n in differ:
                    buffers[n].copy_(_BASE_BUFFERS[n])
    return policy.eval(), tok


def _free_cuda() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _kv_cache_bytes(engine) -> int | None:
    """The bytes of vLLM's KV cache: blocks x block size x layers x (K, V) x kv heads x head dim x 2."""
    try:
        cfg = engine.llm.llm_engine.vllm_config
        hf = cfg.model_config.hf_config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        per_token = hf.num_hidden_layers * 2 * hf.num_key_value_heads * head_dim * 2  # bf16
        return int(cfg.cache_config.num_gpu_blocks) * int(cfg.cache_config.block_size) * per_token
    except Exception:  # noqa: BLE001 - vLLM internals; the caller falls back to what vLLM took at start
        traceback.print_exc()
        return None


@pytest.fixture(scope="module")
def vllm_setup(results):
    """One VLLMEngine for the module, on the exported NVFP4 base of ``policy`` (seed 0, untouched
    until test 1 trains it)."""
    from qerl_kit.rollout.vllm import VLLMEngine

    policy, tok = _policy(SEED)
    _free_cuda()
    free_before = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    engine = VLLMEngine.from_policy(policy, tok, **VLLM_KW)
    start_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    free_after = torch.cuda.mem_get_info()[0]
    start = {"start_seconds": start_s, "held_bytes": free_before - free_after, "kv_cache_bytes": _kv_cache_bytes(engine),
             "logprobs_mode": engine.logprobs_mode, "max_lora_rank": engine.max_lora_rank}
    results.record("engine", start)
    yield SimpleNamespace(engine=engine, policy=policy, tok=tok, start=start)
    try:
        engine.close()
        shutdown = getattr(getattr(engine.llm, "llm_engine", None), "engine_core", None)
        if shutdown is not None and hasattr(shutdown, "shutdown"):
            shutdown.shutdown()
    except Exception:  # noqa: BLE001 - teardown only
        traceback.print_exc()
    del engine
    _free_cuda()


# ---- helpers on rollouts -----------------------------------------------------------------------
def _hf_logprobs(model, rollouts) -> torch.Tensor:
    """The HF policy's log-probs (T = 1) of the rollouts' completion tokens, [rows, C] on the CPU."""
    from qerl_kit.logprobs import batched_logprobs

    model.eval()
    return batched_logprobs(model, rollouts.to(DEVICE), 1.0, 64).float().cpu()


def _mad(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean |a - b| over the completion tokens."""
    m = mask.float().cpu()
    return float(((a.float().cpu() - b.float().cpu()).abs() * m).sum() / m.sum().clamp(min=1))


def _max_ad(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.bool().cpu()
    return float((a.float().cpu() - b.float().cpu()).abs()[m].max()) if m.any() else 0.0


def _same_tokens(a, b) -> bool:
    return a.completion_id_lists() == b.completion_id_lists()


class _ReadNorms:
    """Reads norm vectors off vLLM's model (for ``LLM.apply_model``); small CPU float32 copies."""

    def __init__(self, names):
        self.names = list(names)

    def __call__(self, model):
        return {n: model.get_submodule(n).weight.detach().float().cpu() for n in self.names}


def _norm_names(policy) -> tuple[list, list[str]]:
    from qerl_kit.aqn import find_noise_norms
    from qerl_kit.rollout.vllm import hf_norm_names, vllm_norm_names

    norms = find_noise_norms(policy)
    return norms, vllm_norm_names(hf_norm_names(policy, norms))


def _vllm_norms(engine, names) -> dict[str, torch.Tensor]:
    return engine._apply_to_model(_ReadNorms(names))[0]


def _eval_prompts(tok, rows):
    return _task().encode(tok, rows)


# ---- 1. the Trainer on vLLM learns like on the StaticEngine ---------------------------------------------
CURVE_KEYS = ("step", "reward", "accuracy", "entropy", "loss", "grad_norm", "aqn/sigma", "aqn/norms",
              "completions/mean_length", "sampling/sampling_logp_difference/mean",
              "sampling/importance_sampling_ratio/mean", "time/step", "time/rollout", "time/logprob", "time/update",
              "time/sync", "time/wake", "time/upload", "time/sleep", "rollout/tokens_per_s")


def _train(name: str, policy, tok, output_dir: Path, results: Results, engine=None) -> dict:
    """Base accuracy, 30 GRPO steps, final accuracy (greedy, 200 held-out problems, through the
    trainer's own engine); the curves go to the results as they are."""
    from qerl_kit.trainer import Trainer

    cfg = _config(name, output_dir)
    trainer = Trainer(policy, tok, _task(), cfg, engine=engine, progress="none")
    t0 = time.perf_counter()
    base = trainer.evaluate(batch_size=64)
    t_eval = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.train()
    t_train = time.perf_counter() - t0
    final = trainer.evaluate(batch_size=64)
    curve = [{k: row.get(k) for k in CURVE_KEYS if k in row} for row in trainer.history]
    summary = {"engine": name, "base_accuracy": base.accuracy, "final_accuracy": final.accuracy,
               "steps": trainer.step, "train_seconds": t_train, "eval_seconds": t_eval,
               "eval_problems": base.num_problems,
               "mean_reward_last_10": sum(r["reward"] for r in trainer.history[-10:]) / len(trainer.history[-10:]),
               "seconds_per_step": t_train / max(trainer.step, 1), "curve": curve}
    for key in ("time/sync", "time/wake", "time/upload", "time/sleep", "time/rollout"):
        vals = [r[key] for r in trainer.history if key in r]
        if vals:
            summary[f"mean_{key.replace('/', '_')}_s"] = sum(vals) / len(vals)
    results.record(f"train_{name}", summary)
    summary["trainer"] = trainer
    return summary


@pytest.fixture(scope="module")
def static_run(results, tmp_path_factory):
    """The reference: the same recipe on our StaticEngine (run before vLLM starts, then freed). A
    failure is returned, not raised, so that the vLLM run is still made and recorded."""
    try:
        policy, tok = _policy(SEED)
        summary = _train("static", policy, tok, tmp_path_factory.mktemp("static"), results)
        summary.pop("trainer")
        del policy
    except Exception as err:  # noqa: BLE001 - reported by the test's assertion
        traceback.print_exc()
        summary = {"error": f"{type(err).__name__}: {err}"[:1000]}
        results.record("train_static", summary)
    _free_cuda()
    return summary


def test_trainer_on_vllm_learns_like_the_static_engine(static_run, vllm_setup, results, tmp_path_factory):
    from qerl_kit.evaluate import evaluate_task
    from qerl_kit.rollout.hf import HFEngine

    engine, policy, tok = vllm_setup.engine, vllm_setup.policy, vllm_setup.tok
    run = _train("vllm", policy, tok, tmp_path_factory.mktemp("vllm"), results, engine=engine)
    trainer = run.pop("trainer")
    # The trained policy's accuracy measured without vLLM too (transformers' generate on the policy).
    cross = _optional(results, "train_vllm", "hf_eval", lambda: evaluate_task(
        _task(), policy, tok, engine=HFEngine(policy, tok), temperature=0.0, batch_size=64, max_new_tokens=64).accuracy)
    results.record("train_vllm", {"final_accuracy_hf_engine": cross, "norms_clean_after_eval": not engine.noisy_norms})
    keys = ("base_accuracy", "final_accuracy", "mean_reward_last_10")
    results.record("training_comparison", {"static": {k: static_run.get(k) for k in keys},
                                           "vllm": {k: run[k] for k in keys}})

    # the vLLM run on its own
    assert run["base_accuracy"] <= 0.5, f"the quantized base starts near 25%, not {run['base_accuracy']:.3f}"
    assert run["final_accuracy"] >= 0.9, f"vLLM-driven training reached only {run['final_accuracy']:.3f}"
    history = trainer.history
    assert len(history) == trainer.config.total_steps and all("time/sync" in r for r in history), \
        "the sync is timed at every step"
    noisy = [r for r in history if r["aqn/sigma"] > 0]
    assert noisy and all(r["aqn/norms"] == engine.last_norm_count > 0 for r in noisy), "AQN reached vLLM's norms"
    assert all(r["aqn/norms"] == 0 for r in history if r["aqn/sigma"] == 0)
    assert not engine.noisy_norms, "the last evaluation ran on clean norms"
    # against the StaticEngine's run of the same recipe and seeds
    assert "error" not in static_run, f"the StaticEngine run failed: {static_run.get('error')}"
    assert static_run["base_accuracy"] <= 0.5
    assert abs(run["base_accuracy"] - static_run["base_accuracy"]) <= 0.1, "vLLM serves the same NVFP4 base"
    assert static_run["final_accuracy"] >= 0.9, f"static engine reached only {static_run['final_accuracy']:.3f}"


# ---- 2. AQN noise reaches vLLM ------------------------------------------------------------------------
def test_aqn_noise_reaches_vllm(vllm_setup, results):
    """Noise must land in vLLM's own norm weights (read back) and change its outputs; the next clean
    sync must restore clean norms and exactly the clean outputs (same seed)."""
    from qerl_kit.aqn import AQN
    from qerl_kit.rollout import SamplingParams

    engine = vllm_setup.engine
    probe, tok = _policy(seed=1, lora_std=LORA_STD)
    norms, names = _norm_names(probe)
    clean_hf = {n: m.weight.detach().float().cpu() for n, m in zip(names, norms)}
    make_aqn = lambda: AQN(sigma_start=AQN_SIGMA, sigma_end=AQN_SIGMA, stages=3, total_steps=3, seed=5)  # noqa: E731
    aqn, step = make_aqn(), 1  # step 1 = stage 1: sigma = AQN_SIGMA
    with make_aqn().noise(probe, step):  # a twin with the same seed draws the same noise
        noisy_hf = {n: m.weight.detach().float().cpu() for n, m in zip(names, norms)}
    prompts = _eval_prompts(tok, _task().eval[:16])
    sampling = SamplingParams(max_new_tokens=48, temperature=1.0, seed=1234)

    with engine.sync(probe):
        clean = engine.generate(prompts, 2, sampling)
        v_clean = _vllm_norms(engine, names)
    with engine.sync(probe, noise=aqn, step=step) as info:
        noisy = engine.generate(prompts, 2, sampling)
        v_noisy = _vllm_norms(engine, names)
    with engine.sync(probe):  # no noise: the clean norms go back
        restored = engine.generate(prompts, 2, sampling)
        v_restored = _vllm_norms(engine, names)

    rows_changed = sum(a != b for a, b in zip(clean.completion_id_lists(), noisy.completion_id_lists())) / len(clean)
    same = [i for i, (a, b) in enumerate(zip(clean.completion_id_lists(), noisy.completion_id_lists())) if a == b]
    lp_shift = _mad(noisy.logprobs[same], clean.logprobs[same], clean.completion_mask[same]) if same else float("inf")
    restore_lp = _mad(restored.logprobs, clean.logprobs, clean.completion_mask) if _same_tokens(clean, restored) \
        else float("inf")
    norm_dev = max(float((v_noisy[n] - clean_hf[n]).abs().max()) for n in names)
    rec = {"norms": len(names), "aqn_norms_reported": info.get("aqn/norms"), "sigma": AQN_SIGMA,
           "max_noise_in_vllm_norms": norm_dev, "rows_changed_by_noise": rows_changed,
           "logp_shift_same_rows": lp_shift, "restored_tokens_equal": _same_tokens(clean, restored),
           "restored_logp_mad": restore_lp,
           "restored_logp_max": _max_ad(restored.logprobs, clean.logprobs, clean.completion_mask)
           if _same_tokens(clean, restored) else None, "sync_seconds": info.get("sync/seconds")}
    results.record("aqn", rec)

    # vLLM's HF-comparable numbers under the same noise (recorded; asserted only when decisive)
    def hf_match():
        with make_aqn().noise(probe, step):
            hf_noisy = _hf_logprobs(probe, noisy)
        hf_clean = _hf_logprobs(probe, noisy)
        out = {"vllm_noisy_vs_hf_noisy": _mad(noisy.logprobs, hf_noisy, noisy.completion_mask),
               "vllm_noisy_vs_hf_clean": _mad(noisy.logprobs, hf_clean, noisy.completion_mask),
               "hf_noisy_vs_hf_clean": _mad(hf_noisy, hf_clean, noisy.completion_mask)}
        results.record("aqn", out)
        return out
    match = _optional(results, "aqn", "hf_match", hf_match)

    assert all(torch.equal(v_clean[n], clean_hf[n]) for n in names), "vLLM's norms were not clean before the noise"
    assert info["aqn/norms"] == len(names) > 0
    for n in names:  # the exact noisy values (bf16, copied as they are)
        torch.testing.assert_close(v_noisy[n], noisy_hf[n], atol=0, rtol=0, msg=f"vLLM's {n} lacks the AQN noise")
    assert norm_dev > 0.1 * AQN_SIGMA, "the noise in vLLM's norms is far smaller than sigma"
    floor = restore_lp if math.isfinite(restore_lp) else 0.0  # vLLM's run-to-run noise, 0 when deterministic
    assert rows_changed > 0 or lp_shift > max(1e-4, 10 * floor), "vLLM's outputs ignore the noisy norms"
    assert all(torch.equal(v_restored[n], clean_hf[n]) for n in names), "a clean sync left noise in vLLM's norms"
    assert _same_tokens(clean, restored), "clean norms re-synced, but vLLM's outputs differ from the clean run"
    assert restore_lp <= 1e-3, f"clean outputs restored with log-probs {restore_lp} off"
    if match is not None and match["hf_noisy_vs_hf_clean"] > 4 * match["vllm_noisy_vs_hf_noisy"]:
        assert match["vllm_noisy_vs_hf_noisy"] < match["vllm_noisy_vs_hf_clean"], "vLLM matches the clean HF model"


# ---- 3. the adapter is never stale ------------------------------------------------------------------
def test_vllm_serves_the_current_adapter_not_a_stale_one(vllm_setup, results):
    from qerl_kit.logprobs import completion_logprobs
    from qerl_kit.rollout import SamplingParams

    engine = vllm_setup.engine
    probe, tok = _policy(seed=2, lora_std=LORA_STD)
    prompts = _eval_prompts(tok, _task().eval[16:32])
    sampling = SamplingParams(max_new_tokens=48, temperature=1.0, seed=99)
    with engine.sync(probe):
        before = engine.generate(prompts, 4, sampling)
    hf_before = _hf_logprobs(probe, before)
    with probe.disable_adapter():
        base_before = _hf_logprobs(probe, before)

    # One Adam step that lowers the sampled tokens' probability: a clearly different adapter.
    trainable = [p for p in probe.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in trainable]
    opt = torch.optim.Adam(trainable, lr=STEP_LR)
    probe.train()
    b = before.to(DEVICE)
    logp = completion_logprobs(probe, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask, 1.0)
    loss = (logp * b.completion_mask).sum() / b.completion_mask.sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    probe.eval()
    change = float(torch.stack([(p.detach() - s).norm() for p, s in zip(trainable, saved)]).norm())

    with engine.sync(probe):
        after = engine.generate(prompts, 4, sampling)
    hf_after = _hf_logprobs(probe, after)
    with torch.no_grad():  # the pre-step adapter, for the stale comparison, then back
        current = [p.detach().clone() for p in trainable]
        for p, s in zip(trainable, saved):
            p.copy_(s)
        hf_stale = _hf_logprobs(probe, after)
        for p, c in zip(trainable, current):
            p.copy_(c)

    m0, m1 = before.completion_mask, after.completion_mask
    rec = {"rows": len(before), "tokens_before": int(m0.sum()), "tokens_after": int(m1.sum()),
           "adapter_change_norm": change,
           "before_vllm_vs_hf": _mad(before.logprobs, hf_before, m0),
           "before_vllm_vs_hf_max": _max_ad(before.logprobs, hf_before, m0),
           "before_vllm_vs_base_without_lora": _mad(before.logprobs, base_before, m0),
           "before_lora_effect_hf": _mad(hf_before, base_before, m0),
           "after_vllm_vs_hf_after": _mad(after.logprobs, hf_after, m1),
           "after_vllm_vs_hf_after_max": _max_ad(after.logprobs, hf_after, m1),
           "after_vllm_vs_hf_before_step": _mad(after.logprobs, hf_stale, m1),
           "after_step_effect_hf": _mad(hf_after, hf_stale, m1),
           "tokens_changed_by_step": not _same_tokens(before, after)}
    results.record("stale_adapter", rec)

    assert rec["before_vllm_vs_hf"] < LOGP_TOL, "vLLM's log-probs do not match the HF policy with LoRA"
    assert rec["after_vllm_vs_hf_after"] < LOGP_TOL, "after the step vLLM does not match the updated HF policy"
    assert rec["after_step_effect_hf"] > 4 * rec["after_vllm_vs_hf_after"], "the step is too small to tell apart"
    assert rec["after_vllm_vs_hf_after"] < 0.5 * rec["after_vllm_vs_hf_before_step"], "vLLM serves a stale adapter"
    if rec["before_lora_effect_hf"] > 4 * rec["before_vllm_vs_hf"]:  # the adapter itself reached vLLM
        assert rec["before_vllm_vs_hf"] < 0.5 * rec["before_vllm_vs_base_without_lora"], "vLLM ignores the LoRA"


def test_vllm_texts_match_the_tokenizers_decode(vllm_setup, results):
    """Rewards read the texts: vLLM's detokenizer must give what our tokenizer decodes from the ids."""
    from qerl_kit.rollout import SamplingParams
    from qerl_kit.rollout.base import decode_completions

    engine, tok = vllm_setup.engine, vllm_setup.tok
    with engine.sync(vllm_setup.policy):
        out = engine.generate(_eval_prompts(tok, _task().eval[:32]), 2, SamplingParams(max_new_tokens=64, seed=7))
    ours = decode_completions(tok, out.completion_ids, out.completion_mask, torch.tensor(
        [r == "stop" for r in out.finish_reasons]))
    bad = [i for i, (a, b) in enumerate(zip(out.texts, ours)) if a != b]
    results.record("texts", {"rows": len(ours), "mismatches": len(bad),
                             "examples": [[out.texts[i], ours[i]] for i in bad[:3]],
                             "stopped_share": sum(r == "stop" for r in out.finish_reasons) / len(out)})
    assert not bad, f"vLLM's text differs from the tokenizer's decode in {len(bad)} of {len(ours)} rows"


# ---- 5. what a sync costs ---------------------------------------------------------------------------
def test_adapter_sync_time(vllm_setup, results):
    """_upload_adapter alone (write to tmpfs, drop the old id), with AQN norms, the LoRA load on the
    next generate, and full sync cycles (wake, upload, sleep) as the Trainer runs them."""
    from qerl_kit.aqn import AQN
    from qerl_kit.rollout import SamplingParams

    engine = vllm_setup.engine
    probe, tok = _policy(seed=3, lora_std=LORA_STD)
    aqn = AQN(sigma_start=1e-2, sigma_end=1e-2, stages=3, total_steps=3, seed=9)
    one = _eval_prompts(tok, _task().eval[:1])
    tiny = SamplingParams(max_new_tokens=1, temperature=0.0, seed=0)
    timings: dict[str, list[float]] = {k: [] for k in ("upload", "upload_with_norms", "generate_same_adapter",
                                                        "generate_new_adapter", "cycle_total")}
    engine.wake_up()
    try:
        engine._upload_adapter(probe)  # clean norms in vLLM: the uploads below send the LoRA files only
        engine.generate(one, 1, tiny)
        for _ in range(8):
            t0 = time.perf_counter()
            engine._upload_adapter(probe)
            timings["upload"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            engine.generate(one, 1, tiny)  # loads the new adapter first
            timings["generate_new_adapter"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            engine.generate(one, 1, tiny)  # the adapter is loaded now
            timings["generate_same_adapter"].append(time.perf_counter() - t0)
        for _ in range(8):  # the adapter plus AQN's noisy norms through LLM.apply_model
            t0 = time.perf_counter()
            engine._upload_adapter(probe, aqn=aqn, step=1)
            timings["upload_with_norms"].append(time.perf_counter() - t0)
    finally:
        engine.sleep()
    cycles = []
    for _ in range(5):
        t0 = time.perf_counter()
        with engine.sync(probe, noise=aqn, step=1) as info:
            engine.generate(one, 1, tiny)
        timings["cycle_total"].append(time.perf_counter() - t0)
        cycles.append({k: v for k, v in info.items() if k.startswith("sync/")})

    def stats(v):
        v = sorted(v)
        return {"median": v[len(v) // 2], "max": v[-1], "mean": sum(v) / len(v), "n": len(v)}
    rec = {k: stats(v) for k, v in timings.items()}
    rec["lora_load_estimate_s"] = rec["generate_new_adapter"]["median"] - rec["generate_same_adapter"]["median"]
    rec["cycles"] = cycles
    rec["adapter_bytes"] = sum((Path(engine.lora_request.lora_path) / f).stat().st_size
                               for f in os.listdir(engine.lora_request.lora_path))
    results.record("sync_time", rec)
    assert all(c["sync/upload_seconds"] >= 0 and "sync/sleep_seconds" in c for c in cycles)
    assert rec["upload_with_norms"]["max"] < 10 and rec["cycle_total"]["max"] < 30, "a sync takes implausibly long"


# ---- 4. sleep frees memory, wake brings it back --------------------------------------------------------
def test_sleep_frees_and_wake_restores_memory(vllm_setup, results):
    from qerl_kit.rollout import SamplingParams

    engine, tok = vllm_setup.engine, vllm_setup.tok
    prompts = _eval_prompts(tok, _task().eval[:16])
    greedy = SamplingParams(max_new_tokens=64, temperature=0.0, seed=0)
    with engine.sync(vllm_setup.policy):
        before = engine.generate(prompts, 1, greedy)
    assert engine.asleep  # sync puts it back to sleep
    engine.wake_up()
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    engine.sleep()
    t_sleep = time.perf_counter() - t0
    torch.cuda.synchronize()
    free_asleep = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    engine.wake_up()
    t_wake = time.perf_counter() - t0
    torch.cuda.synchronize()
    free_woken = torch.cuda.mem_get_info()[0]
    try:
        after = engine.generate(prompts, 1, greedy)  # same adapter, weights back from the CPU
    finally:
        engine.sleep()
    kv = vllm_setup.start["kv_cache_bytes"]
    held = vllm_setup.start["held_bytes"]
    freed, retaken = free_asleep - free_awake, free_asleep - free_woken
    rec = {"free_awake": free_awake, "free_asleep": free_asleep, "free_woken": free_woken, "freed_bytes": freed,
           "retaken_bytes": retaken, "kv_cache_bytes": kv, "held_at_start_bytes": held,
           "freed_share_of_kv": freed / kv if kv else None, "freed_share_of_held": freed / held if held else None,
           "sleep_seconds": t_sleep, "wake_seconds": t_wake, "outputs_equal_after_wake": _same_tokens(before, after)}
    results.record("sleep_wake", rec)
    reference = kv if kv else held
    assert reference and freed > 0.5 * reference, f"sleep freed {freed / 2**30:.2f} GiB of {reference / 2**30:.2f}"
    assert retaken > 0.5 * freed, "wake-up did not take the memory back"
    assert _same_tokens(before, after), "greedy outputs after wake-up differ from before sleep"
