"""The qerl command line and the demo it runs."""

import pytest

from qerl_kit.cli import build_parser, main


def test_demo_command_runs_a_short_job(capsys, tmp_path):
    assert main(["demo", "--steps", "1", "--eval-size", "8", "--no-widgets",
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


def test_train_from_yaml_resumes_and_eval_applies_the_adapter(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    out = tmp_path / "run"
    cfg.write_text(f"preset: tiny-cpu\ntotal_steps: 3\nsave_every: 2\noutput_dir: {out}\n"
                   "rollout: {{batch_size: 16, group_size: 4, max_new_tokens: 48}}\n"
                   "data: {{eval_size: 8, train_size: 200}}\naqn: {{stages: 3}}\n".replace("{{", "{").replace("}}", "}"))
    assert main(["train", "--config", str(cfg), "--steps", "2", "--no-widgets"]) == 0
    assert (out / "checkpoint-2" / "adapter_model.safetensors").is_file()
    assert (out / "config.yaml").is_file()
    assert main(["train", "--config", str(cfg), "--no-widgets"]) == 0  # resumes at step 2, runs 1 more
    out_text = capsys.readouterr().out
    assert "resumed from step 2" in out_text
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert main(["eval", "--adapter", str(out / "checkpoint-3"), "--limit", "8", "--max-new-tokens", "48"]) == 0
    assert "accuracy" in capsys.readouterr().out


def test_train_and_eval_help(capsys):
    for cmd, flags in (("train", ("--config", "--preset", "--steps", "--fresh", "--output-dir")),
                       ("eval", ("--adapter", "--samples", "--temperature", "--dataset"))):
        with pytest.raises(SystemExit):
            build_parser().parse_args([cmd, "--help"])
        out = capsys.readouterr().out
        assert all(flag in out for flag in flags), cmd


def test_train_engine_flag_overrides_the_config_and_refuses_unknown_names(tmp_path, capsys):
    out = tmp_path / "run"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"preset: tiny-cpu\ntotal_steps: 3\nsave_every: 1\noutput_dir: {out}\n"
                   "rollout: {batch_size: 8, group_size: 4, max_new_tokens: 16, engine: static}\n"
                   "data: {eval_size: 8, train_size: 100}\naqn: {stages: 3}\n")
    assert main(["train", "--config", str(cfg), "--engine", "nope", "--no-widgets"]) == 2
    err = capsys.readouterr().err
    assert "--engine nope" in err and "'vllm'" in err and not out.exists()  # nothing written
    assert main(["train", "--config", str(cfg), "--engine", "hf", "--steps", "1", "--no-widgets"]) == 0
    assert "engine: hf" in (out / "config.yaml").read_text()


def test_quantize_skip_typo_is_said_before_the_output_head(capsys):
    """`qerl quantize tiny-arith --skip mpl`: the name that matches nothing is the error (status 2),
    not the tied output head that --skip (which replaces the default lm_head) leaves to be quantized."""
    from qerl_kit.tiny import TINY_DIR

    assert main(["quantize", str(TINY_DIR), "--skip", "mpl"]) == 2
    err = capsys.readouterr().err
    assert "'mpl' matches no linear layer" in err and "tied" not in err
