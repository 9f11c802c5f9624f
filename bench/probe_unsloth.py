"""One-shot probe: does Unsloth's own GRPO rollout path (FastLanguageModel 4-bit + vLLM ``fast_generate``
+ a LoRA request) run on this machine, and how fast is it? Random Qwen2.5-shaped weights, no downloads.

    python -m bench.probe_unsloth --out DIR [--model Qwen2.5-7B] [--batches 8 64] [--new 128]
                                  [--prompt 256] [--lora-r 32] [--budget 240]

Stages env, checkpoint, load [load_no_vllm], lora, generate_vllm | generate_hf, train_step each run in a
try block and rewrite DIR/unsloth_probe.json, so a crash or a kill keeps what was learnt (``in_progress``
names the stage that was running; DIR/stacks.txt gets the Python stacks of a hang past the budget).
The ~15 GB checkpoint goes to $TMPDIR (or /tmp) and is removed at the end; TMPDIR=/dev/shm skips the disk.

Wheels to carry (`pip install --no-deps --target /tmp/site *.whl`, then PYTHONPATH=/tmp/site), read off
unsloth / unsloth_zoo 2026.10.9 and checked by importing them with UNSLOTH_ALLOW_CPU=1 (their CPU-CI switch
onto the GPU import path) while hiding every package that the H200 image lacks:
  unsloth, unsloth_zoo, bitsandbytes   the packages themselves
  datasets (hard)  unsloth_zoo/tokenizer_utils.py:32 and training_utils.py:19 `import datasets`;
                   unsloth_zoo/dataset_utils.py `from datasets import (Dataset, IterableDataset,)`;
                   unsloth/dataprep/raw_text.py:19 `from datasets import Dataset`
  dill, multiprocess (hard, imported by datasets; its pyarrow, pandas, xxhash, fsspec, httpx are in the image)
  trl (hard)       unsloth/models/_utils.py `from trl import __version__ as trl_version`;
                   unsloth/tokenizer_utils.py `import trl`, `from trl.trainer.sft_trainer import *`;
                   unsloth/models/rl.py, rl_replacements.py `from trl import __version__ as trl_version_raw`
Optional (inside try/except or behind find_spec): xformers (else PyTorch SDPA), torchao, cut_cross_entropy
(unsloth_zoo/loss_utils.py), pydantic. Not imported on this path: diffusers, tyro, hf_transfer. msgspec
(unsloth_zoo/vllm_lora_request.py, fast_inference only) is one of vLLM's own dependencies.
"""

import os

# No network on the H200 machine: hub, telemetry and usage-stat calls must stay local (before transformers).
for _k, _v in dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
                   HF_HUB_ENABLE_HF_TRANSFER="0", UNSLOTH_DISABLE_STATISTICS="1",  # name read by unsloth get_statistics
                   VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1").items():
    os.environ.setdefault(_k, _v)

import argparse, datetime, faulthandler, gc, json, platform, random, shutil  # noqa: E401,E402
import subprocess, sys, tempfile, time, traceback  # noqa: E401,E402
import importlib.metadata as md  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402  (torch before unsloth is fine; transformers/peft/trl must not be)

from bench.random_checkpoint import BYTES, word, write_random_checkpoint  # noqa: E402  (imports no HF module)

T0 = time.perf_counter()
REPORT: dict = {"meta": {}, "stages": []}
ARGS = None
TMP: list = []  # temp dirs removed at the end (the 7B checkpoint is ~15 GB)
IMPORT_CHECKS = ["vllm", "bitsandbytes", "unsloth_zoo", "trl", "datasets", "xformers", "diffusers", "torchao", "tyro"]
DISTS = ["torch", "transformers", "peft", "accelerate", "triton", "vllm", "bitsandbytes", "unsloth", "unsloth_zoo",
         "trl", "datasets", "dill", "multiprocess", "xformers", "diffusers", "torchao", "tyro", "cut_cross_entropy",
         "huggingface_hub", "tokenizers", "safetensors", "torchvision"]


def elapsed():
    return time.perf_counter() - T0


def save():
    """Rewrite the report atomically: a kill mid-write must not leave broken JSON."""
    path = Path(ARGS.out) / "unsloth_probe.json"
    path.with_suffix(".tmp").write_text(json.dumps(REPORT, indent=1, default=str))
    path.with_suffix(".tmp").replace(path)


def err(e):
    return {"error": repr(e)[:2000], "traceback": "".join(traceback.format_exception(e)).splitlines()[-30:]}


def gib(n):
    return round(n / 2**30, 2)


def sync():
    torch.cuda.synchronize()


def free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def stage(name, fn, *a):
    """Run ``fn(rec, *a)``; record ok, seconds, error and whatever fn put in ``rec``. Returns (ok, result)."""
    rec = {"stage": name}
    if elapsed() > ARGS.budget:
        rec.update(ok=False, skipped=f"budget: {elapsed():.0f} s used of --budget {ARGS.budget:.0f} s")
        REPORT["stages"].append(rec)
        save()
        print(f"[probe] {name:14s} SKIPPED ({rec['skipped']})", flush=True)
        return False, None
    REPORT["in_progress"] = name
    save()
    t, result = time.perf_counter(), None
    try:
        result = fn(rec, *a)
        rec["ok"] = True
    except (Exception, SystemExit) as e:  # SystemExit: some libraries exit on a failed init
        rec.update(ok=False, **err(e))
    rec["seconds"] = round(time.perf_counter() - t, 2)
    REPORT["stages"].append(rec)
    REPORT.pop("in_progress", None)
    save()
    nums = {k: v for k, v in rec.items() if type(v) in (int, float)}
    print(f"[probe] {name:14s} ok={rec['ok']} {nums} {rec.get('error', '')[:300]}", flush=True)
    return rec["ok"], result


# -- stages -------------------------------------------------------------------------------------
def env(rec):
    """CUDA, versions, which packages import; then ``import unsloth`` (an exception here stops the probe)."""
    # Each import check runs in a child process, all in parallel: importing trl/peft/vllm in this process
    # before unsloth would defeat unsloth's patches, and the children overlap with unsloth's own import.
    code = "import importlib,sys; m=importlib.import_module(sys.argv[1]); print(getattr(m,'__version__','?'))"
    child_env = dict(os.environ, UNSLOTH_IS_PRESENT="1")  # unsloth_zoo refuses to import without it
    procs = {n: subprocess.Popen([sys.executable, "-c", code, n], env=child_env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for n in IMPORT_CHECKS}
    rec.update(torch=torch.__version__, cuda_available=torch.cuda.is_available())
    imports = rec["imports"] = {}
    try:
        if not rec["cuda_available"]:
            raise RuntimeError("no CUDA device: torch.cuda.is_available() is False; nothing to probe")
        REPORT["meta"]["gpu"] = torch.cuda.get_device_name(0)
        imports["unsloth"] = {"ok": False, "error": "see this stage's error"}
        import unsloth  # the first HF-stack import of this process, as Unsloth asks
        from unsloth import import_fixes

        imports["unsloth"] = {"ok": True, "version": getattr(unsloth, "__version__", "?")}
        rec["vllm_disabled_reason"] = getattr(import_fixes, "VLLM_DISABLED_REASON", None)  # unsloth turned vLLM off
    finally:
        for n, p in procs.items():
            try:
                out, errtxt = p.communicate(timeout=max(5.0, 180 - elapsed()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                out, errtxt = "", "import timed out"
            lines = errtxt.strip().splitlines() or [f"exit code {p.returncode}"]
            imports[n] = ({"ok": True, "version": (out.strip().splitlines() or ["?"])[-1]} if p.returncode == 0
                          else {"ok": False, "error": lines[-1][:2000], "traceback": lines[-8:]})
        for n in ("transformers", "peft", "triton"):  # the loaded module's version where unsloth imported it
            rec[n] = getattr(sys.modules.get(n), "__version__", None) or REPORT["meta"]["versions"].get(n)
        rec["missing"] = sorted(n for n, v in imports.items() if not v["ok"])


def checkpoint(rec):
    """A random bf16 checkpoint of --model's shape plus a tokenizer that covers all its ids, in a temp dir
    (``bench.random_checkpoint``: token ``BYTES + i`` is " " + word(i))."""
    d = tempfile.mkdtemp(prefix="probe_unsloth_ckpt_")
    TMP.append(d)
    rec.update(dir=d, **write_random_checkpoint(ARGS.model, d, "cuda"))
    free()
    torch.cuda.reset_peak_memory_stats()
    return d


def load(rec, ckpt, fast):
    from unsloth import FastLanguageModel

    model, tok = FastLanguageModel.from_pretrained(
        model_name=ckpt, max_seq_length=ARGS.prompt + ARGS.new + 64, load_in_4bit=True, fast_inference=fast,
        max_lora_rank=ARGS.lora_r, gpu_memory_utilization=0.5, dtype=None)
    free_b, total_b = torch.cuda.mem_get_info()
    rec.update(max_memory_allocated_gib=gib(torch.cuda.max_memory_allocated()), gpu_used_gib=gib(total_b - free_b),
               has_vllm_engine=hasattr(model, "vllm_engine"), model_class=type(model).__name__)
    return model, tok


def lora(rec, model):
    from unsloth import FastLanguageModel

    model = FastLanguageModel.get_peft_model(
        model, r=ARGS.lora_r, lora_alpha=ARGS.lora_r, random_state=0, use_gradient_checkpointing="unsloth",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    rec["trainable_m"] = round(sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6, 2)
    rec.update(has_save_lora=hasattr(model, "save_lora"), has_load_lora=hasattr(model, "load_lora"))
    return model


def lora_request(rec, model):
    """The adapter handed to vLLM. Unsloth's GRPO trainer calls ``load_lora(name, load_tensors=True)`` before
    each rollout; the notebooks use ``save_lora(dir)`` + ``load_lora(dir)``. Try both, prefer the GRPO one."""
    tries, got = rec.setdefault("lora_request", {}), {}
    d = tempfile.mkdtemp(prefix="probe_unsloth_lora_")
    TMP.append(d)
    for how, call in (("save_lora+load_lora(dir)", lambda: (model.save_lora(d), model.load_lora(d))[1]),
                      ("load_lora(load_tensors=True)", lambda: model.load_lora("probe_lora", load_tensors=True))):
        t = time.perf_counter()
        try:
            got[how] = call()
            tries[how] = {"ok": True, "seconds": round(time.perf_counter() - t, 3), "type": type(got[how]).__name__}
        except Exception as e:  # AttributeError too, where save_lora / load_lora are missing
            tries[how] = {"ok": False, **err(e)}
    how = next((h for h in ("load_lora(load_tensors=True)", "save_lora+load_lora(dir)") if h in got), None)
    rec["lora_request_used"] = how or "None: both failed, rollouts see the base weights only"
    return got.get(how)


def generate_vllm(rec, model):
    import vllm

    req = lora_request(rec, model)
    hi = model.config.vocab_size - 2  # word tokens only: above the byte symbols, below eos / pad

    def run(b, n, fmt, lr):  # fresh random prompts each call, so vLLM's prefix cache cannot skip the prefill
        ids = [[random.randrange(BYTES, hi) for _ in range(ARGS.prompt)] for _ in range(b)]
        prompts = [{"prompt_token_ids": x} if fmt == "token_ids" else "".join(" " + word(i - BYTES) for i in x)
                   for x in ids]
        sp = vllm.SamplingParams(n=1, max_tokens=n, min_tokens=n, ignore_eos=True, temperature=1.0, logprobs=0)
        sync()
        t = time.perf_counter()
        outs = model.fast_generate(prompts, sampling_params=sp, lora_request=lr, use_tqdm=False)
        sync()
        return time.perf_counter() - t, [len(o.outputs[0].token_ids) for o in outs]

    # Token-id prompts first (what GRPO sends), then text; then both again without the LoRA request.
    fails = rec["format_errors"] = {}
    combos = [("token_ids", req), ("text", req)] + ([("token_ids", None), ("text", None)] if req is not None else [])
    for fmt, lr in combos:
        try:
            run(1, 1, fmt, lr)  # also the very first call's warm-up
            rec.update(prompt_format=fmt, with_lora=lr is not None)
            break
        except Exception as e:
            fails[f"{fmt}/lora={lr is not None}"] = err(e)
    else:
        raise RuntimeError(f"fast_generate failed for every prompt format / LoRA combination: {list(fails)}")
    lr, rows, bad = (req if rec["with_lora"] else None), rec.setdefault("batches", []), []
    for b in ARGS.batches:
        if elapsed() > ARGS.budget:
            rows.append({"batch": b, "skipped": "budget"})
            continue
        run(b, 1, rec["prompt_format"], lr)  # warm-up at this batch size
        t1, _ = run(b, 1, rec["prompt_format"], lr)
        tn, lens = run(b, ARGS.new, rec["prompt_format"], lr)
        ms = (tn - t1) / (ARGS.new - 1) * 1000
        rows.append(dict(batch=b, t_1_s=round(t1, 4), t_new_s=round(tn, 4), ms_per_step=round(ms, 3),
                         decode_tok_s=round(b * 1000 / ms, 1) if ms > 0 else None, total_tok_s=round(b * ARGS.new / tn, 1),
                         min_len=min(lens), max_len=max(lens), lengths_ok=all(x == ARGS.new for x in lens)))
        print(f"[probe]   vllm {rows[-1]}", flush=True)
        bad += [] if rows[-1]["lengths_ok"] else [b]
    rec["max_memory_allocated_gib"] = gib(torch.cuda.max_memory_allocated())
    if bad:
        raise RuntimeError(f"generated token count != --new {ARGS.new} at batch {bad}")


def generate_hf(rec, model, tok):
    """Fallback: Unsloth's own HF generate (for_inference), batch 8, 1 vs 32 new tokens."""
    from unsloth import FastLanguageModel

    FastLanguageModel.for_inference(model)
    ids = torch.randint(BYTES, model.config.vocab_size - 2, (8, ARGS.prompt), device="cuda")

    def run(n):
        sync()
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=True, pad_token_id=tok.pad_token_id)
        sync()
        return time.perf_counter() - t, out.shape[1] - ids.shape[1]

    run(1)  # warm-up (compiles)
    (t1, _), (tn, got) = run(1), run(32)
    rec.update(batch=8, t_1_s=round(t1, 4), t_32_s=round(tn, 4), ms_per_step=round((tn - t1) / 31 * 1000, 3),
               new_tokens=got)
    if got != 32:
        raise RuntimeError(f"generated {got} tokens, asked for 32")


def train_step(rec, model):
    """Forward+backward of the PEFT model on [8, prompt+new] random ids, labels = ids (a second one, if
    the budget allows, since the first also compiles)."""
    from unsloth import FastLanguageModel

    FastLanguageModel.for_training(model)
    ids = torch.randint(BYTES, model.config.vocab_size - 2, (8, ARGS.prompt + ARGS.new), device="cuda")
    steps = rec.setdefault("steps", [])
    while len(steps) < 2 and not (steps and elapsed() > ARGS.budget):
        torch.cuda.reset_peak_memory_stats()
        sync()
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        sync()
        steps.append(dict(seconds=round(time.perf_counter() - t, 3), loss=round(float(loss), 4),
                          peak_gib=gib(torch.cuda.max_memory_allocated())))
        model.zero_grad(set_to_none=True)
    rec.update(step_s=steps[-1]["seconds"], peak_gib=steps[-1]["peak_gib"])


def run_stages():
    if not stage("env", env)[0]:
        return  # no CUDA, or unsloth does not import: the report says which
    ok, ckpt = stage("checkpoint", checkpoint)
    if not ok:
        return
    ok, loaded = stage("load", load, ckpt, True)
    if not ok:  # a retry without vLLM tells whether vLLM or the 4-bit load itself fails
        free()
        ok, loaded = stage("load_no_vllm", load, ckpt, False)
    if not ok:
        return
    fast = getattr(loaded[0], "vllm_engine", None) is not None
    (model, tok), loaded = loaded, None
    ok, model = stage("lora", lora, model)
    if not ok:
        return
    vllm_ok = fast and stage("generate_vllm", generate_vllm, model)[0]
    if not fast:
        REPORT["stages"].append({"stage": "generate_vllm", "ok": False, "skipped": "no vLLM engine was loaded"})
    if not vllm_ok:
        stage("generate_hf", generate_hf, model, tok)
    stage("train_step", train_step, model)


def main(argv=None):
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for unsloth_probe.json and stacks.txt")
    ap.add_argument("--model", default="Qwen2.5-7B", help="a qerl_kit.models preset (random weights)")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64], help="rollout batch sizes")
    ap.add_argument("--new", type=int, default=128, help="new tokens per rollout")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    ap.add_argument("--lora-r", type=int, default=32)
    ap.add_argument("--budget", type=float, default=240, help="seconds since start; later stages are skipped")
    ARGS = ap.parse_args(argv)
    Path(ARGS.out).mkdir(parents=True, exist_ok=True)
    versions = {}
    for dist in DISTS:  # package metadata only: nothing imported
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    REPORT["meta"] = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          python=platform.python_version(), gpu=None, versions=versions, args=vars(ARGS))
    stacks = open(Path(ARGS.out) / "stacks.txt", "w")
    faulthandler.dump_traceback_later(ARGS.budget + 30, repeat=True, file=stacks)  # where a hang hangs
    try:
        run_stages()
    finally:
        faulthandler.cancel_dump_traceback_later()
        for d in TMP:
            shutil.rmtree(d, ignore_errors=True)
        REPORT["total_seconds"] = round(elapsed(), 1)
        save()
        print(f"[probe] report: {Path(ARGS.out) / 'unsloth_probe.json'} ({elapsed():.0f} s)", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # vLLM's engine can hang interpreter teardown; the report is written


if __name__ == "__main__":
    main()
