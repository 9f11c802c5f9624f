"""The qerl command line and the demo it runs."""

import pytest

from qerl_kit.cli import build_parser, main


def test_demo_command_runs_a_short_job(capsys, tmp_path):
    assert main(["demo", "--steps", "2", "--eval-size", "8", "--no-widgets",
                 "--output-dir", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "28 linear layers converted" in out and "held-out accuracy" in out
    assert (tmp_path / "demo" / "summary.json").is_file()


def test_quantize_command_prints_report(capsys):
    assert main(["quantize", "llama-tiny", "--format", "mxfp4"]) == 0
    out = capsys.readouterr().out
    assert "mxfp4: 14 linear layers converted" in out and "quantization scales" in out


def test_help_explains_each_option(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["quantize", "--help"])
    out = capsys.readouterr().out
    for flag in ("--format", "--skip", "--trust-remote-code"):
        assert flag in out
