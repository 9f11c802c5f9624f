"""vLLM rollouts on an exported NVFP4 checkpoint, with LoRA hot-swap and AQN on vLLM's own norms.

``VLLMEngine(checkpoint_dir, tokenizer)`` starts ``vllm.LLM`` in this process on a checkpoint
written by ``qerl_kit.export.save_nvfp4`` (vLLM runs it with its W4A16-FP4 Marlin kernels) with
LoRA enabled, and implements the rollout interface of ``qerl_kit.rollout``:
``with engine.sync(policy, noise=aqn, step=step):`` (wake up, upload the adapter and the step's
norms) then ``generate(prompts, n, sampling) -> Rollouts`` with each sampled token's log-prob.
``VLLMEngine.from_policy(policy, tokenizer)`` exports the policy's NVFP4 base to a temporary
directory first; ``make_engine("vllm", policy, tokenizer)`` (``rollout.engine: vllm``) calls it.

* ``sync`` uploads after each update (``_upload_adapter``, ``_upload_norms``: its private steps):
  the LoRA matrices go to a fresh directory on tmpfs (``/dev/shm``) and the next ``generate`` uses
  a ``LoRARequest`` with a fresh int id; the previous id is removed from vLLM and its directory
  deleted. The base is never rewritten. Trained norms (``train_norms=True``) and AQN noise go into vLLM's norm weights, found
  by structure on the HF side (``qerl_kit.aqn``) and resolved by name on vLLM's model, with the
  count asserted (the official code matched transformers' class names and never hit vLLM's own).
* ``sleep()`` / ``wake_up()`` (or ``with engine.awake():``) free vLLM's memory while training.

Run on vLLM 0.26.0 (``tests/test_vllm_gpu.py`` on an H200, which is what ``qerl_kit[vllm]`` pins);
written for vLLM >= 0.10.1 (``CompressedTensorsW4A16Fp4`` + Marlin on Hopper, ``logprobs_mode``
from 0.10.2 used when present). CI has no vLLM: there ``tests/test_vllm_backend.py`` covers
everything around it with a fake ``vllm`` module (docs/export-vllm.md).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from qerl_kit.rollout.base import Engine, _vocab_size, check_stop_ids, decode_completions
from qerl_kit.rollout.types import Generation, Prompts, SamplingParams, as_prompts, check_n

__all__ = ["VLLMEngine", "AdapterWriter", "vllm_norm_names", "hf_norm_names", "resolve_norms",
           "import_vllm", "require_cuda", "vllm_options"]

INSTALL_HINT = "pip install 'qerl_kit[vllm]'"
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def import_vllm():
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"the vLLM rollout backend needs vLLM >= 0.10.1 and a CUDA GPU: {INSTALL_HINT} "
                          "(or use qerl_kit.rollout.HFEngine, which runs anywhere)") from err
    return vllm


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("the vLLM rollout backend needs a CUDA GPU and none is visible; on this machine "
                           "use qerl_kit.rollout.HFEngine")


# ---- norm names: HF (peft) -> vLLM ------------------------------------------------------------
def vllm_options(rollout, policy, tokenizer, task, lora_r: int, sample: int = 2000) -> dict:
    """The keyword arguments ``VLLMEngine.from_policy`` takes from a run (``rollout``, a RolloutConfig):
    ``max_model_len`` = the longest prompt of the task (its first ``sample`` train and eval rows, as the
    task formats them) + ``max_new_tokens``, and ``gpu_memory_utilization`` = ``rollout.vllm_gpu_memory``
    or the share the memory planner gives for that length and ``rollout.batch_size``
    (``memory_plan.vllm_memory_share``). ``rollout.registry.engine_options`` calls it for ``vllm``."""
    longest = task.longest_prompt(tokenizer, sample)
    max_len = -(-(longest + rollout.max_new_tokens) // 64) * 64
    share = rollout.vllm_gpu_memory
    if share is None:
        from qerl_kit.memory_plan import vllm_memory_share

        if not torch.cuda.is_available():  # VLLMEngine refuses to start without one, with its own message
            return {"max_model_len": max_len}
        config = getattr(policy, "config", None)
        share = vllm_memory_share(config, torch.cuda.get_device_properties(0).total_memory, lora_r=lora_r,
                                  rollout_batch=rollout.batch_size, max_model_len=max_len)
    return {"max_model_len": max_len, "gpu_memory_utilization": share}


def vllm_norm_names(hf_norm_names: Sequence[str]) -> list[str]:
    """Module names on vLLM's model of the HF norms: peft's prefix and wrappers stripped.

    vLLM's Qwen2/Qwen3/Llama keep HF's names (``model.layers.{i}.input_layernorm``), so
    ``base_model.model.model.layers.3.input_layernorm.modules_to_save.default`` maps to
    ``model.layers.3.input_layernorm``. Order is kept, duplicates dropped.
    """
    out: list[str] = []
    for name in hf_norm_names:
        parts = name.split(".")
        if parts[:2] == ["base_model", "model"]:
            parts = parts[2:]
        if "modules_to_save" in parts:
            parts = parts[:parts.index("modules_to_save")]
        parts = [p for p in parts if p != "original_module"]
        clean = ".".join(parts)
        if clean not in out:
            out.append(clean)
    return out


def hf_norm_names(model: nn.Module, norms: Sequence[nn.Module]) -> list[str]:
    """Names of ``norms`` inside ``model``."""
    names = {id(m): n for n, m in model.named_modules()}
    if any(id(m) not in names for m in norms):
        raise ValueError("some norm modules are not inside the model")
    return [names[id(m)] for m in norms]


def resolve_norms(model: nn.Module, names: Sequence[str], expected: int) -> list[nn.Module]:
    """The modules ``names`` on (vLLM's) ``model``; each must have a 1-D weight, and the count must be
    ``expected`` (the number of norms found on the HF side), else AQN would silently do less."""
    modules = []
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"vLLM's model has no module {name!r}; its norm names differ from the HF "
                             "model's (pass a name_map to VLLMEngine)") from None
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.ndim != 1:
            raise ValueError(f"{name!r} on vLLM's model is a {type(module).__name__} without a 1-D weight")
        modules.append(module)
    if len(modules) != expected:
        raise ValueError(f"found {len(modules)} norms on vLLM's model, expected {expected} (HF side)")
    return modules


class _LoadNorms:
    """Copies norm vectors into (vLLM's) model; a picklable callable for ``LLM.apply_model``."""

    def __init__(self, values: dict[str, torch.Tensor], expected: int):
        self.values, self.expected = values, expected

    def __call__(self, model: nn.Module) -> int:
        modules = resolve_norms(model, list(self.values), self.expected)
        with torch.no_grad():
            for module, value in zip(modules, self.values.values()):
                module.weight.data.copy_(value.to(module.weight.device, module.weight.dtype))
        return len(modules)


# ---- adapters on tmpfs --------------------------------------------------------------------------
class AdapterWriter:
    """Writes each adapter version to a fresh directory (tmpfs when there is one) with a fresh int id."""

    def __init__(self, root: str | Path | None = None):
        if root is None:
            root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.root = Path(tempfile.mkdtemp(prefix="qerl-lora-", dir=root))
        self._ids = itertools.count(1)  # vLLM wants lora_int_id > 0
        self.current: tuple[int, Path] | None = None

    def write(self, peft_model, adapter_name: str = "default") -> tuple[int, Path]:
        """Save the LoRA matrices (not modules_to_save copies: norms go separately) as a peft adapter."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        lora_id = next(self._ids)
        path = self.root / f"adapter-{lora_id}"
        path.mkdir()
        state = get_peft_model_state_dict(peft_model, adapter_name=adapter_name)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in sorted(state.items()) if "lora_" in k}
        if not tensors:
            raise ValueError("the peft model has no LoRA tensors to send to vLLM")
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = peft_model.peft_config[adapter_name]
        saved, config.modules_to_save = config.modules_to_save, None
        try:
            config.save_pretrained(str(path))
        finally:
            config.modules_to_save = saved
        previous, self.current = self.current, (lora_id, path)
        if previous is not None:
            shutil.rmtree(previous[1], ignore_errors=True)
        return lora_id, path

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.current = None


def _checkpoint_vocab(checkpoint_dir: str | Path) -> int | None:
    """``vocab_size`` of a checkpoint's config.json; None when it cannot be read (vLLM says why later)."""
    import json

    try:
        size = json.loads((Path(checkpoint_dir) / "config.json").read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


# ---- the engine ---------------------------------------------------------------------------------
def _row_lengths(stop_after: Sequence[int], rows: int) -> list[int]:
    """``stop_after`` checked as ``StaticEngine.generate_ids`` checks it: one int >= 1 per row."""
    lengths = [int(x) for x in stop_after]
    if len(lengths) != rows or min(lengths, default=0) < 1:
        raise ValueError(f"stop_after needs one length >= 1 per row ({rows}); got {len(lengths)} values, "
                         f"smallest {min(lengths, default=None)}")
    return lengths


class VLLMEngine(Engine):
    """``vllm.LLM`` on an exported NVFP4 checkpoint; ``generate`` fills ``qerl_kit.rollout.Rollouts``."""

    batches_rows = True  # evaluate() may send every problem in one call (rows are batched and compacted here)

    def __init__(self, checkpoint_dir: str | Path, tokenizer, *, gpu_memory_utilization: float = 0.3,
                 max_lora_rank: int = 64, enable_sleep_mode: bool = True, max_model_len: int | None = None,
                 seed: int = 0, dtype: str = "bfloat16", logprobs_mode: str | None = "processed_logprobs",
                 stop_token_ids: Sequence[int] | None = None, add_special_tokens: bool = False,
                 adapter_root: str | Path | None = None, name_map=None, ignore_eos: bool = False, **llm_kwargs):
        # checked before vLLM starts: ids in the checkpoint's vocabulary (config.json's vocab_size)
        stop_token_ids = check_stop_ids(stop_token_ids, _checkpoint_vocab(checkpoint_dir))
        vllm = import_vllm()
        require_cuda()
        from vllm.lora.request import LoRARequest

        self._vllm, self._LoRARequest = vllm, LoRARequest
        self.tokenizer, self.add_special_tokens = tokenizer, add_special_tokens
        self.max_lora_rank = next((r for r in VLLM_LORA_RANKS if r >= max_lora_rank), max_lora_rank)
        eos, pad = getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad if pad is not None else (eos if eos is not None else 0))
        self.stop_token_ids = stop_token_ids
        self.ignore_eos = ignore_eos  # benchmarks: every row runs to max_new_tokens (as StaticEngine's)
        # ``skip_tokenizer_init=True``: vLLM starts without a tokenizer (a checkpoint without one, or a
        # tokenizer vLLM cannot load); the completions are then decoded here with ``tokenizer``
        self.decode_here = bool(llm_kwargs.get("skip_tokenizer_init", False))
        self.name_map = name_map or (lambda name: name)  # HF-side clean name -> vLLM module name
        self.enable_sleep_mode, self.asleep = enable_sleep_mode, False
        self.adapters = AdapterWriter(adapter_root)
        self.lora_request = None
        self.last_norm_count = 0
        self.noisy_norms = False  # vLLM's norms hold AQN noise from the last sync (re-synced clean next time)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: apply_model
        kwargs = dict(model=str(checkpoint_dir), enable_lora=True, max_lora_rank=self.max_lora_rank,
                      max_loras=1, gpu_memory_utilization=gpu_memory_utilization,
                      enable_sleep_mode=enable_sleep_mode, dtype=dtype, seed=seed, trust_remote_code=False)
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if logprobs_mode is not None:
            kwargs["logprobs_mode"] = logprobs_mode
        kwargs.update(llm_kwargs)
        try:
            self.llm = vllm.LLM(**kwargs)
        except TypeError as err:  # vLLM 0.10.1 has no logprobs_mode: raw log-probs (temperature 1)
            if "logprobs_mode" not in str(err):
                raise
            kwargs.pop("logprobs_mode")
            self.llm = vllm.LLM(**kwargs)
        self.logprobs_mode = kwargs.get("logprobs_mode", "raw_logprobs")
        self._export_dir: Path | None = None  # a base exported by from_policy, removed by close()

    @classmethod
    def from_policy(cls, policy: nn.Module, tokenizer, *, export_dir: str | Path | None = None,
                    **kwargs) -> "VLLMEngine":
        """Export ``policy``'s NVFP4 base (``qerl_kit.export.save_nvfp4``) to ``export_dir`` (default: a
        fresh temporary directory, removed by ``close``) and start vLLM on it, with ``max_lora_rank``
        the adapter's rank unless given. The adapter and norms reach vLLM at every ``sync``."""
        from qerl_kit.export import save_nvfp4

        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        check_stop_ids(kwargs.get("stop_token_ids"), _vocab_size(base))  # a stop id it could never generate
        import_vllm()  # fail before minutes of exporting
        require_cuda()
        temporary = export_dir is None
        path = Path(tempfile.mkdtemp(prefix="qerl-vllm-base-")) if temporary else Path(export_dir)
        save_nvfp4(policy, path, tokenizer=tokenizer)
        config = getattr(policy, "peft_config", {}).get("default")
        if config is not None:
            kwargs.setdefault("max_lora_rank", config.r)
        engine = cls(path, tokenizer, **kwargs)
        engine._export_dir = path if temporary else None
        return engine

    # -- the step before a rollout -----------------------------------------------------------------
    @contextlib.contextmanager
    def sync(self, policy: nn.Module | None = None, *, noise=None, step: int = 0) -> Iterator[dict]:
        """Wake vLLM, send it ``policy``'s adapter and norms (with ``noise``'s AQN at ``step``), run the
        block, then put vLLM back to sleep (with sleep mode on), so training has the memory back.

        ``info`` holds ``aqn/norms``, ``sync/seconds`` (wake-up + upload), ``sync/wake_seconds``,
        ``sync/upload_seconds`` and, once the block has exited, ``sync/sleep_seconds``."""
        if noise is not None and policy is None:
            raise ValueError("VLLMEngine.sync with noise needs the policy whose norms carry it")
        start = time.perf_counter()
        self.wake_up()
        info: dict[str, Any] = {"sync/wake_seconds": time.perf_counter() - start}
        try:
            if policy is not None:
                t0 = time.perf_counter()
                self._upload_adapter(policy, aqn=noise, step=step)
                info["sync/upload_seconds"] = time.perf_counter() - t0
                if noise is not None:
                    info["aqn/norms"] = self.last_norm_count if noise.sigma(step) > 0 else 0
            info["sync/seconds"] = time.perf_counter() - start  # wake-up + upload
            yield info
        finally:  # read after the block by whoever holds ``info`` (the Trainer logs it as time/sleep)
            t0 = time.perf_counter()
            self.sleep()
            info["sync/sleep_seconds"] = time.perf_counter() - t0

    # -- weights ---------------------------------------------------------------------------------
    def _upload_adapter(self, peft_model, *, aqn=None, step: int | None = None, adapter_name: str = "default"):
        """Send the current adapter (and norms: trained copies and/or AQN noise) to vLLM."""
        rank = peft_model.peft_config[adapter_name].r
        if rank > self.max_lora_rank:
            raise ValueError(f"the adapter's rank {rank} exceeds the engine's max_lora_rank {self.max_lora_rank}")
        lora_id, path = self.adapters.write(peft_model, adapter_name)
        old, self.lora_request = self.lora_request, self._LoRARequest(f"qerl-{lora_id}", lora_id, str(path))
        if old is not None:
            self._remove_lora(old.lora_int_id)
        # Norms go over when they carry something (trained copies, this step's noise) and also when
        # the last sync left noise in vLLM's: a sync without AQN (an evaluation) then puts the clean
        # norms back instead of generating with the previous rollout's noise.
        if aqn is not None or peft_model.peft_config[adapter_name].modules_to_save or self.noisy_norms:
            self._upload_norms(peft_model, aqn=aqn, step=step)
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()
        return self.lora_request

    def _remove_lora(self, lora_id: int) -> None:
        for owner in (self.llm, getattr(self.llm, "llm_engine", None)):
            if owner is not None and hasattr(owner, "remove_lora"):
                owner.remove_lora(lora_id)
                return

    def _upload_norms(self, hf_model: nn.Module, *, aqn=None, step: int | None = None) -> int:
        """Copy the HF model's projection norms (plus AQN noise at ``step``) into vLLM's; returns the count."""
        from qerl_kit.aqn import find_noise_norms

        norms = aqn.norms(hf_model) if aqn is not None else find_noise_norms(hf_model)
        names = [self.name_map(n) for n in vllm_norm_names(hf_norm_names(hf_model, norms))]
        if aqn is not None and step is None:
            raise ValueError("uploading norms with AQN noise needs the training step (for the noise schedule)")
        context = aqn.noise(hf_model, step) if aqn is not None else contextlib.nullcontext()
        with context as perturbed:  # noise is drawn around clean weights and removed from the HF model after
            values = {n: m.weight.detach().to("cpu", copy=True) for n, m in zip(names, norms)}
        self.noisy_norms = True  # until the copy below has landed, assume vLLM's norms are not clean
        counts = self._apply_to_model(_LoadNorms(values, expected=len(norms)))
        if any(c != len(norms) for c in counts):
            raise RuntimeError(f"vLLM workers updated {counts} norms, expected {len(norms)} each")
        self.noisy_norms = bool(perturbed)  # nullcontext yields None; AQN yields the count it perturbed
        self.last_norm_count = len(norms)
        return len(norms)

    def _apply_to_model(self, fn) -> list:
        if hasattr(self.llm, "apply_model"):
            return list(self.llm.apply_model(fn))
        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner  # vLLM 0.10.x, V0
        return [fn(runner.model)]

    # -- memory ----------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        if self.enable_sleep_mode and not self.asleep:
            self.llm.sleep(level=level)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    @contextlib.contextmanager
    def awake(self):
        """``with engine.awake(): engine._upload_adapter(...); engine.generate(...)``; sleeps after."""
        self.wake_up()
        try:
            yield self
        finally:
            self.sleep()

    # -- rollouts --------------------------------------------------------------------------------
    def _generate_texts(self, prompts: Prompts, n: int, sampling: SamplingParams,
                        stop_after: Sequence[int] | None = None) -> tuple[Generation, list[str]]:
        """One ``LLM.generate`` call: the Generation and the texts vLLM decoded (its detokenizer,
        special tokens skipped). ``stop_after`` (one length per row, prompt-major, as
        ``StaticEngine.generate_ids`` takes it) sends every row as its own request capped at its
        length (``min_tokens`` too under ``ignore_eos``: the row runs to exactly that length)."""
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep; call wake_up() (or generate inside `with engine.sync(...)`"
                               " / `with engine.awake():`)")
        extra = dict(ignore_eos=True) if self.ignore_eos else {}
        if self.decode_here:
            extra["detokenize"] = False
        common = dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or -1, logprobs=0,
                      skip_special_tokens=True, stop_token_ids=self.stop_token_ids or None, **extra)
        requests = list(prompts.ids)
        if stop_after is None:
            params = self._vllm.SamplingParams(n=n, max_tokens=sampling.max_new_tokens, seed=sampling.seed, **common)
        else:
            lengths = _row_lengths(stop_after, len(requests) * n)
            requests = [p for p in requests for _ in range(n)]  # one request per row, prompt-major
            params = [self._vllm.SamplingParams(n=1, max_tokens=length, seed=None if sampling.seed is None
                                                else sampling.seed + i, **common,
                                                **(dict(min_tokens=length) if self.ignore_eos else {}))
                      for i, length in enumerate(lengths)]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in requests], params,
                                    lora_request=self.lora_request, use_tqdm=False)
        p_ids, c_ids, logprobs, stopped, texts = [], [], [], [], []
        for prompt_ids, out in zip(requests, outputs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                toks = list(c.token_ids)
                if c.logprobs is None or len(c.logprobs) != len(toks):
                    raise RuntimeError("vLLM returned no per-token log-probs (SamplingParams.logprobs=0)")
                p_ids.append(list(prompt_ids))
                c_ids.append(toks)
                logprobs.append([float(lp[t].logprob) for lp, t in zip(c.logprobs, toks)])
                stopped.append(c.finish_reason == "stop")
                texts.append(c.text)
        gen = Generation.from_lists(p_ids, c_ids, logprobs, stopped, self.pad_token_id)
        if self.decode_here:  # vLLM has no tokenizer: its texts are empty
            texts = decode_completions(self.tokenizer, gen.completion_ids, gen.completion_mask, gen.stopped)
        return gen, texts

    def generate_ids(self, prompts: Prompts | Sequence[Sequence[int]], n: int = 1,
                     sampling: SamplingParams | None = None, stop_after: Sequence[int] | None = None) -> Generation:
        return self._generate_texts(as_prompts(prompts, self.tokenizer, self.add_special_tokens), check_n(n),
                                    sampling or SamplingParams(), stop_after)[0]

    def close(self) -> None:
        """Remove the adapter directories (and a base ``from_policy`` exported to a temporary directory)."""
        self.adapters.cleanup()
        if self._export_dir is not None:
            shutil.rmtree(self._export_dir, ignore_errors=True)
            self._export_dir = None
