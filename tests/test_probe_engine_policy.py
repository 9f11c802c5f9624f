"""bench.probe_engine_policy: the engine's log-probs of its own samples against a teacher-forced forward
(the GPU probe that told hold 8's collapsing policy from an engine fault), on the CPU's tiny model."""

import gzip
import json

import torch

from bench import probe_engine_policy as probe
from bench.common import with_lora
from qerl_kit.rollout import SamplingParams, StaticEngine
from qerl_kit.tiny import load_tiny


def _rollout(n_new: int = 6):
    model, tok = load_tiny()
    peft = with_lora(model, 4)
    g = StaticEngine(peft, tok).generate_ids(["12+7=", "3+4="], n=2, sampling=SamplingParams(max_new_tokens=n_new, seed=0))
    return peft, g


def test_the_gap_is_rounding_where_the_engine_samples_the_policy_and_large_where_a_log_prob_is_wrong():
    peft, g = _rollout()
    forced, prompt_lens = probe.teacher_forced(peft, g, batch=3)  # batches that split the rows unevenly
    assert len(forced) == 4 and sorted(set(prompt_lens)) == [4, 5]
    assert [f.shape[0] for f in forced] == g.completion_mask.sum(1).tolist()
    ok = probe.compare(g, forced)
    assert ok["engine_nonfinite"] == 0 and ok["gap_max"] < 1e-4 and ok["tokens"] == int(g.completion_mask.sum())
    g.logprobs[1, 0] -= 2.0  # a first token whose log-prob is not the policy's
    g.logprobs[2, 1] = float("nan")
    bad = probe.compare(g, forced)
    assert abs(bad["gap_max"] - 2.0) < 1e-3 and bad["gap_first"] > 0.4
    assert bad["engine_nonfinite"] == 1 and bad["gap_nonfinite"] == 1


def test_replay_saves_the_batch_and_names_the_micro_batch_whose_gradient_is_not_finite(tmp_path):
    peft, g = _rollout()
    assert probe.replay(peft, g, tmp_path, "none", micro=2)["default"] == "all finite"
    saved = torch.load(tmp_path / "batch-none.pt")
    assert torch.equal(saved["completion_ids"], g.completion_ids) and torch.equal(saved["logprobs"], g.logprobs)
    # rows 2-3 only: a prompt token id the embedding maps to NaN poisons their forward and backward
    emb = peft.get_base_model().get_input_embeddings().weight
    seen = set(g.prompt_ids[:2][g.prompt_mask[:2].bool()].tolist()) | set(g.completion_ids[:2][g.completion_mask[:2].bool()].tolist())
    poisoned = next(t for t in g.prompt_ids[2][g.prompt_mask[2].bool()].tolist() if t not in seen)
    base = peft.get_base_model()
    base.lm_head.weight = torch.nn.Parameter(emb.detach().clone(), requires_grad=False)  # untied: inputs only
    with torch.no_grad():
        emb[poisoned] = float("nan")
    found = probe.replay(peft, g, tmp_path, "none", micro=2)
    assert len(found["default"]) == 1 and found["default"][0].startswith("rows [2, 3] ")
    assert "logp finite False" in found["default"][0]
    assert all(p.grad is None for p in peft.parameters())  # it leaves no gradient behind


def test_the_cli_runs_the_variants_and_the_benchs_own_step_on_a_model_directory(tmp_path, monkeypatch):
    # the tiny model saved as a directory stands for the converted real model, a few GSM8K-shaped rows for the data
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
             "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a, b in ((3, 4), (5, 9), (12, 7), (2, 8))]
    for split in ("train", "test"):
        (data / f"gsm8k_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("QERL_DATA", str(data))
    model, tok = load_tiny()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    common = [str(tmp_path / "m"), "--device", "cpu", "--dtype", "float32", "--formats", "none", "--prompts", "2",
              "--n", "2", "--max-new", "4"]
    probe.main([*common, "--out", str(tmp_path / "v"), "--variants", "default", "graphs-off", "hf"])
    got = json.loads((tmp_path / "v" / "policy.json").read_text())
    assert [(r["variant"], r["call"]) for r in got] == [(v, c) for v in ("default", "graphs-off", "hf") for c in (0, 1)]
    # the adapter and the AQN noise change between calls; every engine still samples the model it reads
    assert all(r["gap_max"] < 1e-4 and r["engine_nonfinite"] == 0 and r["rows"] == 4 for r in got)
    assert "| none | hf | 1 |" in (tmp_path / "v" / "policy.md").read_text()
    probe.main([*common, "--out", str(tmp_path / "t"), "--trainer", "--steps", "2", "--engine-off", "compact"])
    steps = json.loads((tmp_path / "t" / "policy.json").read_text())
    assert [(r["variant"], r["call"]) for r in steps] == [("trainer -compact", 0), ("trainer -compact", 1)]
    assert all("error" not in r for r in steps)
    assert all(r["gap_max"] < 1e-4 and r["grad_norm"] is not None for r in steps)
    # --batch: the step on a saved rollout (a file from before `stopped` was saved), no engine sampling;
    # --layout padded: the training forward on the engine's masked layout
    _, g = _rollout(n_new=5)
    torch.save({k: getattr(g, k) for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                                           "logprobs")}, tmp_path / "batch.pt")
    assert torch.equal(probe.saved_generation(tmp_path / "batch.pt", [], "cpu").stopped,
                       g.completion_mask.sum(1) < g.completion_mask.shape[1])
    (tmp_path / "batch.pt.gz").write_bytes(gzip.compress((tmp_path / "batch.pt").read_bytes()))
    assert torch.equal(probe.saved_generation(tmp_path / "batch.pt.gz", [], "cpu").completion_ids, g.completion_ids)
    for lay in ("padded", "aligned"):
        probe.main([*common, "--out", str(tmp_path / lay), "--trainer", "--steps", "1", "--batch",
                    str(tmp_path / "batch.pt"), "--layout", lay])
        fed = json.loads((tmp_path / lay / "policy.json").read_text())
        assert len(fed) == 1 and "error" not in fed[0] and fed[0]["grad_norm"] == fed[0]["grad_norm"]  # finite
        assert fed[0]["len_mean"] == float(g.completion_mask.sum(1).float().mean())
    probe.main([*common, "--out", str(tmp_path / "h"), "--hunt", "sdpa", "eager"])
    hunted = json.loads((tmp_path / "h" / "policy.json").read_text())
    assert [r["variant"] for r in hunted] == ["hunt-sdpa", "hunt-eager"]
    assert all(r["first_nonfinite_forward"] == "none" and "error" not in r for r in hunted)


def test_differing_state_names_what_differs_from_a_fresh_load_and_leaves_the_adapter_aside():
    model, _ = load_tiny()
    fresh, _ = load_tiny()
    peft, other = with_lora(model, 4), with_lora(fresh, 4)  # two random adapters: never compared
    assert probe.differing_state(peft, other) == []
    base = peft.get_base_model()
    with torch.no_grad():
        base.model.layers[1].mlp.down_proj.weight[0, 0] += 1.0
        base.model.norm.weight[3] = float("nan")
    assert probe.differing_state(peft, other) == ["base_model.model.model.layers.1.mlp.down_proj.base_layer.weight",
                                                  "base_model.model.model.norm.weight"]
