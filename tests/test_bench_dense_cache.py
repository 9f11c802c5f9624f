"""bench.bench_dense_cache: one update pass with and without the dense cache, and --profile's tables."""
import sys

from bench import bench_dense_cache


def test_smoke_run_times_both_modes_and_profiles_each_format(tmp_path, monkeypatch):
    out, prof = tmp_path / "table.md", tmp_path / "prof"
    monkeypatch.setattr(sys, "argv", ["bench_dense_cache", "--smoke", "--formats", "nvfp4", "none",
                                      "--out", str(out), "--profile", str(prof)])
    bench_dense_cache.main()
    table = out.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| nvfp4 ") or line.startswith("| none ")]
    assert len(rows) == 2 and rows[0].rstrip().endswith("| yes |")  # the cache gives the packed path's grads
    md = (prof / "profile.md").read_text()
    assert "### nvfp4:" in md and "### none:" in md and "`aten::mm`" in md
    assert "_RoutedMatmul" in md.split("### none:")[0]  # the 4-bit pass goes through the routed matmul
    assert "_RoutedMatmul" not in md.split("### none:")[1]
    for fmt in ("nvfp4", "none"):
        assert "Self CPU" in (prof / f"profile_{fmt}.txt").read_text()
