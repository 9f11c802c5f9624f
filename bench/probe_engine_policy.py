"""Does a rollout engine sample the model's policy? Its log-probs of its own sampled tokens against a
teacher-forced forward of the same rows (the training forward's), per StaticEngine feature switched off.

An engine that samples another policy than the one trained makes a fast rollout meaningless, and on a
real model that shows in the completions' lengths before anything else (the reason this exists: hold 8's
real 0.5B completions were a quarter as long on our engine as on vLLM; hold 9 found the bench's learning
rate collapsing the policy, not the engine, bench/results/step_h200.md). The variants run the bench's
conditions: GSM8K chat prompts of the real model (16 x 8 rows, T = 1, up to 512 tokens), the bench's
random adapter, AQN noise redrawn and the adapter changed in place between two calls of one engine, as a
training step changes them; per call, the lengths and the gap between the engine's log-prob of each
sampled token and the forward's (bf16's rounding gives about 0.01 nats, transformers' ``generate`` too).

``--trainer`` runs the step bench's own steps (``bench.step_group``: policy, engine, GSM8K task, Trainer)
and checks each rollout the same way; after a step with non-finite gradients it saves the batch,
backpropagates it per micro-batch under each SDPA backend, compares the model's tensors with a fresh
load and replays the batch on that load. ``--hunt`` runs one bf16 step under autograd's anomaly mode
with a finite check on every module's output (the hooks send the engine down its eager path).

    python -m bench.probe_engine_policy MODEL_DIR --out DIR [--formats none nvfp4] [--variants ...]
    python -m bench.probe_engine_policy MODEL_DIR --out DIR --trainer --formats none [--engine-off cuda_graphs]
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import time
from pathlib import Path

import torch

from bench.bench_step import ENGINE_SWITCHES

VARIANTS = {
    "default": {},
    "graphs-off": {"cuda_graphs": False},
    "compact-off": {"compact": False},
    "prefix-off": {"shared_prefix": False},
    "fused-off": {"fused": False},
    "dense-off": {"dense_decode": "off"},
    "attn-torch": {"attention": "torch"},
    "attn-sdpa": {"attention": "sdpa", "shared_prefix": False},
    "all-off": {"cuda_graphs": False, "compact": False, "shared_prefix": False, "fused": False,
                "dense_decode": "off", "attention": "torch"},
    "hf": None,  # transformers' generate through HFEngine: the lengths' reference
}


def teacher_forced(peft, g, batch: int = 32) -> tuple[list[torch.Tensor], list[int]]:
    """Per row: the training forward's log-probs of its completion tokens (``qerl_kit.logprobs.
    completion_logprobs``, as the Trainer computes them: left-padded prompts, positions from the mask),
    ``batch`` rows per forward; and each row's prompt length."""
    from qerl_kit.logprobs import completion_logprobs

    dev = next(peft.parameters()).device
    out = []
    with torch.no_grad():
        for s in range(0, g.completion_ids.shape[0], batch):
            sl = slice(s, s + batch)
            logp = completion_logprobs(peft, *(getattr(g, k)[sl].to(dev) for k in (
                "prompt_ids", "prompt_mask", "completion_ids", "completion_mask")))
            out += [row[:int(n)].float().cpu() for row, n in zip(logp, g.completion_mask[sl].sum(1))]
    return out, g.prompt_mask.sum(1).tolist()


def compare(g, forced: list[torch.Tensor]) -> dict:
    """The rollout's lengths and the engine-vs-forward log-prob gap: mean and max over the finite gaps,
    non-finite ones counted; by position too (the first token, from the prefill; 2-33; 34 on)."""
    eng, gaps, first, early, late = [], [], [], [], []
    for r, lp in enumerate(forced):
        n = lp.shape[0]
        e = g.logprobs[r, :n].float().cpu()
        eng.append(e)
        gap = (e - lp).abs()
        gaps.append(gap)
        if n:
            first.append(gap[0])
            early.append(gap[1:33])
            late.append(gap[33:])
    allg = torch.cat(gaps)
    alle = torch.cat(eng)
    finite = torch.isfinite(allg)
    lengths = g.completion_mask.sum(1).float()
    return {"rows": len(forced), "len_mean": float(lengths.mean()), "len_min": int(lengths.min()),
            "stopped": float(g.stopped.float().mean()), "tokens": int(allg.numel()),
            "engine_nonfinite": int((~torch.isfinite(alle)).sum()), "gap_nonfinite": int((~finite).sum()),
            "gap_mean": _finite_mean(allg), "gap_max": float(allg[finite].max()) if finite.any() else float("nan"),
            "gap_gt1": float((allg[finite] > 1).float().mean()), "gap_first": _finite_mean(_flat(first)),
            "gap_2_33": _finite_mean(_flat(early)), "gap_34_on": _finite_mean(_flat(late)),
            "engine_lp_mean": _finite_mean(alle), "forced_lp_mean": _finite_mean(torch.cat(forced))}


def _flat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in parts]) if parts else torch.zeros(0)


def _finite_mean(x: torch.Tensor) -> float:
    """The mean of the finite values (NaN where there are none): non-finite ones are counted apart."""
    x = x[torch.isfinite(x)]
    return float(x.mean()) if x.numel() else float("nan")


def engine_for(name: str, peft, tok):
    from qerl_kit.rollout import StaticEngine
    from qerl_kit.rollout.hf import HFEngine

    if VARIANTS[name] is None:
        return HFEngine(peft, tok)
    return StaticEngine(peft, tok, keep_cache=True, **VARIANTS[name])


def replay(peft, g, out: Path, fmt: str, micro: int = 8) -> dict:
    """After a step with non-finite gradients: its rollout saved (``batch-<fmt>.pt``), then each of the
    Trainer's micro-batches (``micro_batch_plan``: ``micro`` rows sorted by length, each on its own width)
    backpropagated alone (loss: its completion log-probs' sum, as the Trainer's forward computes them)
    under every SDPA backend: which rows and which attention kernel make the NaN."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from qerl_kit import logprobs

    torch.save({k: getattr(g, k).cpu() for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                                                 "logprobs", "stopped")}, out / f"batch-{fmt}.pt")
    lora = [(n, p) for n, p in peft.named_parameters() if p.requires_grad]
    dev = next(peft.parameters()).device
    found = {}
    plan = logprobs.micro_batch_plan(g.prompt_mask, g.completion_mask, micro)
    for backend in ("default", "MATH", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "FLASH_ATTENTION"):
        bad = []
        for sl, bound in zip(*plan):
            for _, p in lora:
                p.grad = None
            try:
                ctx = sdpa_kernel(getattr(SDPBackend, backend)) if backend != "default" else torch.enable_grad()
                with ctx:
                    logp = logprobs.completion_logprobs(peft, *(getattr(g, k)[sl].to(dev) for k in (
                        "prompt_ids", "prompt_mask", "completion_ids", "completion_mask")), bounds=bound)
                    logp.sum().backward()
            except RuntimeError as e:  # a backend that refuses the mask or dtype
                bad.append(f"refused: {str(e)[:120]}")
                break
            grads = [n for n, p in lora if p.grad is not None and not torch.isfinite(p.grad).all()]
            if grads or not torch.isfinite(logp).all():
                rows = sl.tolist() if torch.is_tensor(sl) else list(range(g.completion_ids.shape[0])[sl])
                bad.append(f"rows {rows} {bound}: logp finite "
                           f"{bool(torch.isfinite(logp).all())}, {len(grads)} non-finite grads, first {grads[:1]}")
        found[backend] = bad or "all finite"
        print(f"replay {fmt} {backend}: {found[backend]}", flush=True)
    for _, p in lora:
        p.grad = None
    return found


def differing_state(model, fresh) -> list[str]:
    """Names of ``model``'s parameters and buffers (LoRA's aside) whose values differ from ``fresh``'s, the
    same model loaded anew, or are not finite: what a rollout engine may have written into the model."""
    theirs = dict(fresh.named_parameters()) | dict(fresh.named_buffers())
    out = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if "lora_" in name or name not in theirs:
            continue
        other = theirs[name]
        if t.shape != other.shape or not torch.equal(t, other.to(t.device)) or (
                t.is_floating_point() and not torch.isfinite(t).all()):
            out.append(name)
    return out


def saved_generation(path: Path, stop_ids, device):
    """The rollout ``replay`` saved (``batch-<fmt>.pt``, or gzipped: ``.pt.gz``) as a ``Generation`` on
    ``device``; a file from before ``stopped`` was saved gets it from the rows (shorter than the width, or
    ending on a stop token)."""
    from qerl_kit.rollout.types import Generation

    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    b = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if "stopped" not in b:
        n = b["completion_mask"].sum(1)
        last = b["completion_ids"].gather(1, (n - 1).clamp(min=0)[:, None])[:, 0]
        b["stopped"] = (n < b["completion_mask"].shape[1]) | torch.isin(last, torch.tensor(list(stop_ids)))
    return Generation(**{k: v.to(device) for k, v in b.items()})


def bench_trainer(a, fmt: str, steps: int, aqn: bool, tag: str, engine_off=(), attention: str | None = None):
    """(policy, engine, Trainer) as the step bench builds them for a real model at its own lengths
    (``bench.step_group``: LoRA r 16, mu 4, micro-batches of 8, checkpointing off, the dense cache all).
    With ``a.batch`` the engine's rollout is that saved one (``saved_generation``): the step on the
    same rows with no engine kernel run before it."""
    from bench import step_group as sg

    peft, tok = sg.build_policy(a.model, fmt, a.device, 16, dtype=getattr(torch, a.dtype))
    if attention:
        peft.get_base_model().set_attn_implementation(attention)
    engine = sg.forced_static(peft, tok, ignore_eos=False, keep_cache=True, max_rows=None, dense_decode="auto",
                              share_weights=False, **{k: False for k in engine_off})
    task = sg.make_task(a.model, peft, 256, a.prompts * a.n, 0)
    if getattr(a, "batch", None):
        saved = saved_generation(Path(a.batch), engine.stop_token_ids, a.device)
        engine.generate_ids = lambda *_args, **_kw: saved
    s = dict(steps=steps, lora_r=16, dense_cache="all", prompts=a.prompts, group=a.n)
    case = dict(format=fmt, gradient_checkpointing=False, model=a.model, seed=0, mu=4, micro_batch=8, aqn=aqn)
    return peft, engine, sg.trainer_for(peft, tok, task, engine, case, s, a.max_new, Path(a.out) / tag)


def trainer_probe(a, fmt: str, results: list) -> None:
    """The bench's own step (``bench.step_group``: its policy, engine, GSM8K task and Trainer, mu 4, AQN
    as bench_step's auto) with the engine's output compared to a teacher-forced forward at each rollout."""
    from bench import step_group as sg

    peft, engine, trainer = bench_trainer(a, fmt, a.steps, fmt == "nvfp4", f"run-{fmt}", a.engine_off)
    spied, gens = [], []
    generate = engine.generate_ids

    def spy(*args, **kw):
        g = generate(*args, **kw)
        gens.append(g)
        forced, _ = teacher_forced(peft, g)
        spied.append(compare(g, forced))
        return g

    engine.generate_ids = spy
    keys = ("reward", "loss", "grad_norm", "entropy", "completions/mean_length", "sampling/sampling_logp_difference/mean",
            "sampling/importance_sampling_ratio/max", "time/step")
    variant = "trainer" + "".join(f" -{k}" for k in a.engine_off)
    for step in range(a.steps):
        spied.clear()
        gens.clear()
        try:
            m = trainer.train_step()
            row = {"format": fmt, "variant": variant, "call": step, **(spied[0] if spied else {}),
                   **{k: m.get(k) for k in keys}}
        except Exception as e:  # noqa: BLE001 - a failed step is a result too
            row = {"format": fmt, "variant": variant, "call": step, **(spied[0] if spied else {}),
                   "error": repr(e)[:300]}
        if "error" in row and gens:
            row["replay"] = replay(peft, gens[0], Path(a.out), fmt)
            # the same batch through a model the engine never ran: does the NaN follow the batch or the state?
            fresh, _ = sg.build_policy(a.model, fmt, a.device, 16, dtype=getattr(torch, a.dtype))
            row["state_differs"] = differing_state(peft, fresh)
            fresh.load_state_dict({k: v for k, v in peft.state_dict().items() if "lora_" in k}, strict=False)
            row["replay_fresh"] = replay(fresh, gens[0], Path(a.out), f"{fmt}-fresh")["default"]
            del fresh
        print(json.dumps(row), flush=True)
        results.append(row)
        if "error" in row:
            break


def nan_hunt(a, fmt: str, variant: str, results: list) -> None:
    """One bench Trainer step with every module's forward output checked for non-finite values, under
    autograd's anomaly mode (its error names the backward op that made the first NaN and the forward
    line that recorded it); ``variant``: ``sdpa`` (as the bench runs), ``eager`` attention, or ``peft``'s
    LoRA forward instead of ``FusedLoraLinear``'s."""
    import traceback
    import warnings

    from bench import step_group as sg

    peft, engine, trainer = bench_trainer(a, fmt, 1, False, f"hunt-{fmt}-{variant}", (),
                                          attention="eager" if variant == "eager" else None)
    first: list[str] = []

    def watch(name):
        def hook(_module, _inputs, output):
            t = output[0] if isinstance(output, tuple) else getattr(output, "logits", output)
            if not first and torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all():
                bad = ~torch.isfinite(t)
                first.append(f"{name}: {int(bad.sum())} of {t.numel()} non-finite, shape {tuple(t.shape)}, "
                             f"first at {bad.nonzero()[0].tolist()}")
        return hook

    handles = [m.register_forward_hook(watch(n)) for n, m in peft.named_modules() if n]
    row = {"format": fmt, "variant": f"hunt-{variant}", "call": 0}
    with warnings.catch_warnings(record=True) as caught, sg.lora_forward("peft" if variant == "peft" else "fused"):
        warnings.simplefilter("always")
        try:
            with torch.autograd.detect_anomaly(check_nan=True):
                m = trainer.train_step()
            row.update(grad_norm=m.get("grad_norm"), reward=m.get("reward"))
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:600]
            print(traceback.format_exc()[-3000:], flush=True)
    for h in handles:
        h.remove()
    row["first_nonfinite_forward"] = first[0] if first else "none"
    forward_tb = [str(w.message) for w in caught if "Traceback of forward call" in str(w.message)]
    if forward_tb:
        print("anomaly forward traceback:\n" + forward_tb[-1][-4000:], flush=True)
    print(json.dumps(row), flush=True)
    results.append(row)
    del trainer, engine, peft
    torch.cuda.empty_cache()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--formats", nargs="+", default=["none", "nvfp4"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--aqn", type=float, default=0.01, help="AQN sigma redrawn before each call (0: none)")
    ap.add_argument("--budget", type=float, default=480, help="seconds after which no new variant starts")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--trainer", action="store_true", help="the bench's Trainer steps instead of the variants")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--engine-off", nargs="*", default=[], choices=ENGINE_SWITCHES,
                    help="with --trainer: these StaticEngine features off (as bench_step --engine-off)")
    ap.add_argument("--hunt", nargs="*", default=None, choices=["sdpa", "eager", "peft"],
                    help="the non-finite gradient's hunt (nan_hunt) per variant, instead of the variants")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--layout", default="aligned", choices=["aligned", "padded"],
                    help="with --trainer or --hunt: the training forward's layout (completion_logprobs' aligned)")
    ap.add_argument("--batch", help="with --trainer or --hunt: the step on this saved rollout (batch-<fmt>.pt) "
                                    "instead of the engine's")
    a = ap.parse_args(argv)

    from bench import step_group as sg
    from bench.common import with_lora
    from qerl_kit.aqn import AQN
    from qerl_kit.build import load_base, quantize_base
    from qerl_kit.config import ModelConfig
    from qerl_kit.data import chat_prompt, load_gsm8k
    from qerl_kit.rollout.types import SamplingParams

    t0 = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = list(load_gsm8k("train", limit=a.prompts * a.calls))
    results = []
    for fmt in a.formats if a.hunt else ():
        for variant in a.hunt:
            with sg.training_layout(a.layout):
                nan_hunt(a, fmt, variant, results)
    for fmt in a.formats if a.trainer and not a.hunt else ():
        with sg.training_layout(a.layout):
            trainer_probe(a, fmt, results)
        torch.cuda.empty_cache()
    for fmt in a.formats if not (a.trainer or a.hunt) else ():
        torch.manual_seed(0)
        base, tok = load_base(ModelConfig(name=a.model), device=a.device, dtype=getattr(torch, a.dtype))
        quantize_base(base, fmt)
        peft = with_lora(base, 16)
        prompts = [chat_prompt(tok, r) for r in rows]
        lora_b = [p for n, p in peft.named_parameters() if "lora_B" in n]
        for name in a.variants:
            if time.time() - t0 > a.budget:
                print(f"budget: {fmt} {name} not run", flush=True)
                continue
            engine = engine_for(name, peft, tok)
            aqn = AQN(seed=0) if a.aqn else None
            for call in range(a.calls):
                if aqn:
                    aqn.apply(peft, step=1, sigma=a.aqn)
                t = time.time()
                try:
                    g = engine.generate_ids(prompts[call * a.prompts:(call + 1) * a.prompts], n=a.n,
                                            sampling=SamplingParams(max_new_tokens=a.max_new, temperature=1.0,
                                                                    seed=call))
                except Exception as e:  # noqa: BLE001 - a variant that fails is a result too
                    row = {"format": fmt, "variant": name, "call": call, "error": repr(e)[:300]}
                    print(json.dumps(row), flush=True)
                    results.append(row)
                    break
                secs = time.time() - t
                forced, plens = teacher_forced(peft, g)
                row = {"format": fmt, "variant": name, "call": call, "seconds": round(secs, 2),
                       "prompt_len_min": min(plens), "prompt_len_max": max(plens), **compare(g, forced)}
                print(json.dumps(row), flush=True)
                if call == 0:
                    row["sample"] = tok.decode(g.completion_ids[0, :int(g.completion_mask[0].sum())].tolist())[:400]
                results.append(row)
                with torch.no_grad():  # an optimizer step's in-place change of the adapter
                    for p in lora_b:
                        p.add_(torch.randn_like(p) * 0.002)
            if aqn:
                aqn.restore(peft)
            del engine
            torch.cuda.empty_cache()
        del peft, base
        torch.cuda.empty_cache()
    (out / "policy.json").write_text(json.dumps(results, indent=1))
    cols = ["format", "variant", "call", "seconds", "len_mean", "len_min", "stopped", "engine_nonfinite",
            "gap_nonfinite", "gap_mean", "gap_max", "gap_gt1", "gap_first", "gap_2_33", "gap_34_on",
            "engine_lp_mean", "forced_lp_mean", "reward", "grad_norm", "completions/mean_length",
            "sampling/sampling_logp_difference/mean", "error"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        cells = [r.get(c, "") for c in cols]
        lines.append("| " + " | ".join(f"{x:.4g}" if isinstance(x, float) else str(x) for x in cells) + " |")
    (out / "policy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
