"""bench.common.profiled: the profile report names the host's read-backs with their Python call sites."""
import torch

from bench.common import profiled


def _reads_back(n: int):
    x = torch.randn(32, 32)
    total = 0.0
    for _ in range(n):
        total += (x @ x).sum().item()  # one aten::_local_scalar_dense per item()
    return total + len(torch.nonzero(x > 0))


def test_report_counts_each_read_back_at_its_call_site():
    result, text, rows = profiled(lambda: _reads_back(3), top=1000, stacks=True)  # every name: Python frames too
    assert isinstance(result, float)
    head = text.splitlines()[0]
    assert head.startswith("wall ") and "4 reads back or synchronizations" in head
    sites = [line.strip() for line in text.splitlines()[1:3]]
    assert sites[0].startswith("3 x aten::_local_scalar_dense: ") and sites[1].startswith("1 x aten::nonzero: ")
    assert "test_bench_profiled.py(" in sites[0] and "_reads_back" in sites[0]  # the Python frame that read back
    assert "by own CPU time:" in text and "aten::mm" in text
    assert any(name == "aten::mm" and calls == 3 for name, _, calls in rows)


def test_without_stacks_the_read_backs_are_counted_without_call_sites():
    _, text, _ = profiled(lambda: _reads_back(2), top=10)
    head, first = text.splitlines()[:2]
    assert "3 reads back or synchronizations" in head and "Python frames" not in head
    assert first.strip() == "2 x aten::_local_scalar_dense: (no Python frames)"


def test_a_pass_without_read_backs_reports_none():
    _, text, _ = profiled(lambda: torch.randn(8, 8) @ torch.randn(8, 8), top=5)
    assert "; 0 reads back or synchronizations" in text.splitlines()[0]


def test_an_unreadable_stack_profile_is_a_clear_error(monkeypatch):
    import pytest
    from torch.profiler import profile

    def broken(self, *a, **k):
        raise UnicodeDecodeError("utf-8", b"\xa0", 0, 1, "invalid start byte")

    monkeypatch.setattr(profile, "key_averages", broken)
    with pytest.raises(RuntimeError, match="profile without stacks"):
        profiled(lambda: torch.ones(2).sum(), top=5, stacks=True)
    with pytest.raises(UnicodeDecodeError):
        profiled(lambda: torch.ones(2).sum(), top=5)
