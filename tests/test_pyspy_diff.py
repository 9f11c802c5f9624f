"""bench.pyspy_diff: two py-spy raw files compared frame by frame."""
import pytest

from bench import pyspy_diff

# py-spy's raw format: "frame;frame;... samples" per line, outermost frame first
A = """<module> (bench/x.py:9);build (bench/x.py:3) 40
<module> (bench/x.py:9);timed_pass (bench/x.py:5);forward (q/linear.py:10);0x7f00aa01 (libc.so.6) 6
<module> (bench/x.py:9);timed_pass (bench/x.py:5);forward (q/linear.py:12) 4
<module> (bench/x.py:9);timed_pass (bench/x.py:5);mm (libtorch.so) 10
"""
B = """<module> (bench/x.py:9);build (bench/x.py:3) 90
<module> (bench/x.py:9);timed_pass (bench/x.py:5);forward (q/linear.py:10);held (q/kernels.py:3);forward (q/linear.py:10) 5
<module> (bench/x.py:9);timed_pass (bench/x.py:5);forward (q/linear.py:11);0x7fbb0002 (libc.so.6) 15
<module> (bench/x.py:9);timed_pass (bench/x.py:5);mm (libtorch.so) 10
not a sample line
"""


def test_frames_lose_line_numbers_and_native_addresses_and_the_build_is_left_out():
    stacks = pyspy_diff.read_raw(A)
    assert sum(stacks.values()) == 20  # the 40 samples of build() are outside timed_pass
    leaf = ("<module> (bench/x.py)", "timed_pass (bench/x.py)", "forward (q/linear.py)", "? (libc.so.6)")
    assert stacks[leaf] == 6 and stacks[leaf[:3]] == 4  # two call sites of forward, one name
    assert sum(pyspy_diff.read_raw(A, within=None).values()) == 60


def test_inclusive_counts_a_recursive_frame_once_and_own_counts_leaves():
    inclusive, own = pyspy_diff.frame_samples(pyspy_diff.read_raw(B))
    assert inclusive["forward (q/linear.py)"] == 20  # 5 (forward -> held -> forward: once) + 15
    assert own["forward (q/linear.py)"] == 5 and own["? (libc.so.6)"] == 15 and inclusive["held (q/kernels.py)"] == 5
    assert inclusive["timed_pass (bench/x.py)"] == 30


def test_the_table_ranks_frames_by_the_difference_in_seconds():
    lines = pyspy_diff.diff_markdown(pyspy_diff.read_raw(A), pyspy_diff.read_raw(B), ("none", "nvfp4"), rate=10)
    assert lines[0] == "Sampled seconds: none 2.00, nvfp4 3.00 (nvfp4 - none: +1.00 s)"
    rows = [line for line in lines if line.startswith("| `")]
    # timed_pass: 2.0 -> 3.0 s (+1.0), forward 1.0 -> 2.0 (+1.0), then libc 0.6 -> 1.5 (+0.9), held +0.5, mm 0
    assert rows[0].startswith("| `<module> (bench/x.py)` | 2.000 | 3.000 | +1.000 |")
    assert "| `forward (q/linear.py)` | 1.000 | 2.000 | +1.000 | 0.400 | 0.500 |" in rows
    assert rows.index(next(r for r in rows if "libc" in r)) < rows.index(next(r for r in rows if "held" in r))
    assert rows[-1].startswith("| `mm (libtorch.so)` | 1.000 | 1.000 | +0.000 |")
    with pytest.raises(ValueError, match="rate must be"):
        pyspy_diff.diff_markdown(pyspy_diff.read_raw(A), pyspy_diff.read_raw(B), ("a", "b"), rate=0)


def test_the_command_writes_the_table_and_refuses_a_file_without_samples(tmp_path, capsys):
    a, b, empty, out = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "e.txt", tmp_path / "d" / "diff.md"
    a.write_text(A)
    b.write_text(B)
    empty.write_text("<module> (x.py:1);build (x.py:2) 5\n")  # no timed_pass in it
    pyspy_diff.main([str(a), str(b), "--labels", "none", "nvfp4", "--rate", "10", "--out", str(out)])
    text = out.read_text()
    assert text.startswith("# py-spy: nvfp4 against none") and "(stacks through `timed_pass`)" in text
    with pytest.raises(SystemExit):
        pyspy_diff.main([str(a), str(empty)])
    assert "e.txt: no sample passes through 'timed_pass'" in capsys.readouterr().err
