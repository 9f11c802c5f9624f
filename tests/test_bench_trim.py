"""bench.bench_trim: one update pass over a realistic-length batch, micro-batches trimmed vs padded."""
from bench import bench_trim


def test_tokens_count_each_micro_batch_at_its_own_width():
    batch = bench_trim.make_batch(4, 3, [5, 1, 2, 2], vocab=100, device="cpu")
    assert batch[2].shape == (4, 5) and batch[3].sum(1).tolist() == [5, 1, 2, 2]
    assert bench_trim.tokens(batch, 2, "padded") == 4 * (3 + 5)
    assert bench_trim.tokens(batch, 2, "trimmed") == 2 * (3 + 5) + 2 * (3 + 2)
    assert bench_trim.tokens(batch, 2, "sorted") == 2 * (3 + 2) + 2 * (3 + 5)  # rows 1, 2 | 3, 0 ... by length
    batch = bench_trim.make_batch(4, 3, [5, 1, 1, 5], vocab=100, device="cpu")
    assert bench_trim.tokens(batch, 2, "sorted") == 2 * (3 + 1) + 2 * (3 + 5) < bench_trim.tokens(batch, 2, "trimmed")


def test_smoke_run_writes_each_mode_per_format_with_matching_gradients(tmp_path):
    out = tmp_path / "trim.md"
    bench_trim.main(["--model", "qwen2-tiny", "--formats", "nvfp4", "none", "--lengths", "lognormal:12:0.8:40",
                     "--rows", "8", "--micro-batch", "2", "--prompt", "6", "--lora-r", "4", "--repeats", "1",
                     "--out", str(out)])
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.read_text().splitlines()
            if line.startswith(("| nvfp4", "| none"))]
    assert [(r[0], r[1]) for r in rows] == [(f, m) for f in ("nvfp4", "none") for m in ("padded", "trimmed", "sorted",
                                                                                        "packed")]
    for fmt in ("nvfp4", "none"):
        tok = {r[1]: int(r[3]) for r in rows if r[0] == fmt}
        mbs = {r[1]: int(r[2]) for r in rows if r[0] == fmt}
        assert tok["sorted"] <= tok["trimmed"] < tok["padded"]  # fewer tokens each way
        assert mbs["packed"] <= mbs["sorted"] == mbs["padded"] == 4  # 8 rows, 2 per micro-batch; packed: fewer
        assert all(float(r[6]) < 1e-3 and float(r[7]) < 1e-3 for r in rows if r[0] == fmt)  # the same up to rounding


def test_grad_diff_reports_the_worst_tensor_and_the_norm_over_all():
    import torch

    ref = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.5, 0.0])}
    got = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.5, 0.25])}
    worst, norm = bench_trim.grad_diff(got, ref)
    assert worst == 0.5  # b: 0.25 / 0.5
    assert abs(norm - 0.25 / (1 + 4 + 0.25) ** 0.5) < 1e-7
    assert bench_trim.grad_diff(ref, ref) == (0.0, 0.0)


def test_repeats_add_the_padded_pass_against_its_own_earlier_repeat(tmp_path):
    out = tmp_path / "trim.md"
    bench_trim.main(["--model", "qwen2-tiny", "--formats", "none", "--lengths", "lognormal:12:0.8:40", "--rows", "4",
                     "--micro-batch", "2", "--prompt", "6", "--lora-r", "4", "--repeats", "2", "--out", str(out)])
    again = [line for line in out.read_text().splitlines() if line.startswith("| none | padded again")]
    assert len(again) == 1
    assert again[0].split("|")[8].strip() == "0.0e+00"  # the CPU's backward is deterministic


def test_modes_choose_what_is_timed_and_the_first_is_the_reference(tmp_path):
    out = tmp_path / "trim.md"
    bench_trim.main(["--model", "qwen2-tiny", "--formats", "none", "--lengths", "lognormal:12:0.8:40", "--rows", "8",
                     "--micro-batch", "2", "--prompt", "6", "--lora-r", "4", "--repeats", "1", "--modes", "sorted",
                     "packed", "--out", str(out)])
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.read_text().splitlines() if line.startswith("| none")]
    assert [r[1] for r in rows] == ["sorted", "packed"] and rows[0][5] == "1.00x"
    assert "diff from sorted" in out.read_text()
