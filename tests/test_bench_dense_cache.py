"""bench.bench_dense_cache: one update pass with and without the dense cache, and --profile's tables."""
import sys

import pytest

from bench import bench_dense_cache


def test_smoke_run_times_both_modes_and_profiles_each_format(tmp_path, monkeypatch):
    out, prof = tmp_path / "table.md", tmp_path / "prof"
    monkeypatch.setattr(sys, "argv", ["bench_dense_cache", "--smoke", "--formats", "nvfp4", "none",
                                      "--out", str(out), "--profile", str(prof)])
    bench_dense_cache.main()
    table = out.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| nvfp4 ") or line.startswith("| none ")]
    # the cache (held path) gives the packed path's grads and the routed Function's
    assert len(rows) == 2 and rows[0].rstrip().endswith("| yes, yes |")
    cells = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert all(float(c) > 0 for c in cells[1:4]) and cells[5].endswith("x") and cells[6] == ""  # bf16 comes after
    md = (prof / "profile.md").read_text()
    assert "### nvfp4:" in md and "### none:" in md and "`aten::mm`" in md
    assert "_RoutedMatmul" not in md  # in the block the 4-bit layers take the held path: autograd's own linear
    for fmt in ("nvfp4", "none"):
        assert "Self CPU" in (prof / f"profile_{fmt}.txt").read_text()


def test_narrow_run_keeps_the_depth_and_compares_each_format_with_bf16(tmp_path, monkeypatch):
    out = tmp_path / "narrow.md"
    monkeypatch.setattr(sys, "argv", ["bench_dense_cache", "--model", "qwen2-tiny", "--narrow", "--formats", "none",
                                      "nvfp4", "--repeats", "1", "--micro-batches", "1", "--completion", "8",
                                      "--out", str(out)])
    bench_dense_cache.main()
    table = out.read_text()
    assert "narrowed (every width 64, vocabulary 512)" in table
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in table.splitlines() if line.startswith(("| nvfp4 ", "| none "))}
    assert rows["none"][6] == "1.00x" and rows["nvfp4"][6].endswith("x") and rows["nvfp4"][-1] == "yes, yes"


def test_paired_rounds_alternate_the_formats_and_divide_each_round_by_bf16s_pass(tmp_path, monkeypatch):
    order = []
    seconds = {"none": 2.0, "nvfp4": 2.5, "nf4": 4.0}

    def one_pass(policy, batches, mu, gib, routed, filled=False):
        order.append(policy + (" filled" if filled else ""))
        return seconds[policy] - (0.25 if filled else 0.0), 0.0, 7 if filled else 3, seconds[policy] / 2

    monkeypatch.setattr(bench_dense_cache, "one_pass", one_pass)
    times, allocs, host = bench_dense_cache.paired_passes({f: f for f in ("none", "nvfp4", "nf4")}, None, 1, None,
                                                          repeats=3)
    # a warm-up round, then each round starts one run later: no run always goes first; bf16 has no fill
    runs = ["none", "nvfp4", "nf4", "nvfp4 filled", "nf4 filled"]
    assert order == runs + runs + runs[1:] + runs[:1] + runs[2:] + runs[:2]
    assert times == {"none": [2.0] * 3, "nvfp4": [2.5] * 3, "nf4": [4.0] * 3, "nvfp4 filled": [2.25] * 3,
                     "nf4 filled": [3.75] * 3}
    assert allocs["nvfp4"] == [3] * 3 and allocs["nvfp4 filled"] == [7] * 3 and host["nf4"] == [2.0] * 3
    times["nvfp4"] = [2.5, 2.0, 4.0]  # per-round ratios 0.8, 1.0, 0.5
    allocs["nvfp4"] = [3, 9, 5]
    host["nvfp4"] = [2.5, 1.0, 1.0]  # the host thread busy 100%, 50%, 25% of each pass
    rows = {line.split("|")[1].strip(): line
            for line in bench_dense_cache.paired_markdown(times, allocs, host) if line.startswith("| n")}
    assert "| 2.500 | 0.80x [0.50-1.00x] | 5 | 1.000 (50%) |" in rows["nvfp4"]
    assert "| 1.00x [1.00-1.00x] | 3 | 1.000 (50%) |" in rows["none"]
    assert "| 2.250 | 0.89x [0.89-0.89x] | 7 | 1.250 (56%) |" in rows["nvfp4 filled"]
    assert bench_dense_cache.paired_markdown(times)[-1].endswith("| nan | – |")  # no counts given


def test_a_filled_pass_leaves_the_fill_out_of_its_time(monkeypatch):
    """one_pass(filled=True) makes the block's dense weights before the clock starts: the timed part
    dequantizes nothing (the cache's misses all happen before it) and gives the unfilled pass's grads."""
    import torch
    from qerl_kit import dense_cache

    policy = bench_dense_cache.make_policy("qwen2-tiny", "nvfp4", "cpu", 4, False)
    g = torch.Generator().manual_seed(3)
    batches = [tuple(torch.randint(10, 200, (2, n), generator=g) for n in (8, 24))]
    seen = []
    real_update = bench_dense_cache.update_pass
    monkeypatch.setattr(bench_dense_cache, "update_pass",
                        lambda *a: seen.append(dense_cache.block_stats()["misses"]) or real_update(*a))
    bench_dense_cache.one_pass(policy, batches, 1, None, False)
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    seconds, gib, allocs, host = bench_dense_cache.one_pass(policy, batches, 1, None, False, True)
    assert seen[0] == 0 and seen[1] > 0 and seconds > 0 and gib > 0 and allocs == 0  # no CUDA here
    assert 0 < host <= seconds * 1.05  # the thread's own CPU time: all of a CPU pass, never much more
    assert all(torch.equal(p.grad, grads[n]) for n, p in policy.named_parameters() if p.grad is not None)


def test_paired_without_bf16_is_refused_before_anything_runs(monkeypatch, capsys):
    monkeypatch.setattr(bench_dense_cache, "make_policy", lambda *a, **k: pytest.fail("a model was built"))
    monkeypatch.setattr(sys, "argv", ["bench_dense_cache", "--smoke", "--formats", "nvfp4", "--paired"])
    with pytest.raises(SystemExit):
        bench_dense_cache.main()
    assert "list none among --formats (got nvfp4)" in capsys.readouterr().err


def test_a_paired_run_adds_the_alternating_table(tmp_path, monkeypatch):
    out = tmp_path / "paired.md"
    monkeypatch.setattr(sys, "argv", ["bench_dense_cache", "--smoke", "--formats", "none", "nvfp4", "--paired",
                                      "--out", str(out)])
    bench_dense_cache.main()
    paired = out.read_text().split("## Paired")[1]
    assert "| none |" in paired and "| nvfp4 |" in paired and "| nvfp4 filled |" in paired
    assert "1.00x [1.00-1.00x] | 0 |" in paired  # no cudaMalloc on the CPU


def test_modes_time_only_the_passes_asked_for(tmp_path, monkeypatch):
    """--modes dense times the trainer's pass alone (for a sampling profiler); the others read "–"."""
    out, seen = tmp_path / "dense.md", []
    real = bench_dense_cache.one_pass
    monkeypatch.setattr(bench_dense_cache, "one_pass", lambda *a, **k: seen.append((a[3], a[4])) or real(*a, **k))
    monkeypatch.setattr(sys, "argv", ["bench_dense_cache", "--smoke", "--formats", "nvfp4", "--modes", "dense",
                                      "--out", str(out)])
    bench_dense_cache.main()
    assert seen and all(gib is None and not routed for gib, routed in seen)  # never packed (gib 0) or routed
    row = [c.strip() for c in next(line for line in out.read_text().splitlines()
                                   if line.startswith("| nvfp4 ")).split("|")[1:-1]]
    assert row[1] == row[3] == row[4] == row[5] == "–" and float(row[2]) > 0 and row[-1] == "–, –"


def test_modes_without_the_dense_pass_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(bench_dense_cache, "make_policy", lambda *a, **k: pytest.fail("a model was built"))
    monkeypatch.setattr(sys, "argv", ["bench_dense_cache", "--smoke", "--modes", "packed"])
    with pytest.raises(SystemExit):
        bench_dense_cache.main()
    assert "--modes must include dense" in capsys.readouterr().err


def test_only_the_timed_passes_run_under_timed_pass(monkeypatch):
    """The warm-up pass per mode (compilation, first calls) runs outside ``timed_pass``, the frame a sampling
    profiler keeps (bench.pyspy_diff's default --within); every timed pass runs inside it."""
    seen = []
    real = bench_dense_cache.timed_pass
    monkeypatch.setattr(bench_dense_cache, "one_pass", lambda *a, **k: seen.append("pass") or (1.0, 0.0, 0, 1.0))
    monkeypatch.setattr(bench_dense_cache, "timed_pass", lambda *a, **k: seen.append("timed") or real(*a, **k))
    monkeypatch.setattr(bench_dense_cache.torch.cuda, "is_available", lambda: False)

    class Policy:  # the parameters time_modes reads the LoRA gradients from
        def named_parameters(self):
            return iter(())

    bench_dense_cache.time_modes(Policy(), None, 1, {"dense": (None, False), "packed": (0, False)}, repeats=3)
    assert seen == ["pass", "pass"] + ["timed", "pass"] * 6  # a warm-up per mode, then 3 rounds of both, timed


def test_after_engine_rolls_out_first_and_keeps_the_engine_while_the_passes_run(tmp_path, monkeypatch):
    """--after-engine: our StaticEngine generates for every prompt of the batches first (its cache held),
    the passes then train through the same policy (LoRA gradients flow), and the table says so."""
    import torch

    policy = bench_dense_cache.make_policy("qwen2-tiny", "nvfp4", "cpu", 4, False)
    g = torch.Generator().manual_seed(3)
    batches = [tuple(torch.randint(10, 200, (2, n), generator=g) for n in (6, 5)) for _ in range(2)]
    engine = bench_dense_cache.engine_rollout(policy, batches, 4)
    assert engine._state is not None  # the KV cache and its state kept, as with the Trainer's keep_cache
    assert policy.training
    bench_dense_cache.update_pass(policy, batches, 1)
    grads = [p.grad for n, p in policy.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    out = tmp_path / "t.md"
    seen = []
    real = bench_dense_cache.engine_rollout
    monkeypatch.setattr(bench_dense_cache, "engine_rollout", lambda *a: seen.append(a[2]) or real(*a))
    monkeypatch.setattr(sys, "argv", ["bench_dense_cache", "--smoke", "--formats", "none", "--modes", "dense",
                                      "--after-engine", "3", "--out", str(out)])
    bench_dense_cache.main()
    assert seen == [3] and "after our StaticEngine generated 3 tokens per prompt" in out.read_text()
    assert any(line.startswith("| none ") for line in out.read_text().splitlines())
    note = next(line for line in out.read_text().splitlines() if line.startswith("- none, the dense-cache pass"))
    assert "(median of 1)" in note and " 0 cudaMalloc calls" in note and "host-thread CPU time" in note  # CPU: none


def test_a_negative_after_engine_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_dense_cache", "--smoke", "--after-engine", "-1"])
    with pytest.raises(SystemExit):
        bench_dense_cache.main()
    assert "--after-engine must be an int >= 0" in capsys.readouterr().err
