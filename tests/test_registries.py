"""Every registry is the one source of its names, read only from above.

For each kind (format, loss, task, rollout backend, kernel) a new entry is registered at runtime in
the registry's own module and nothing else is touched; the test then shows it is a valid value
everywhere that kind is named: the config (``qerl_kit.config``), the CLI's choices and help
(``qerl_kit.cli.build_parser()``), the experiment grid, and what the entry is for (a format's layer
class in ``quantize_model``, a task's rows in ``make_task``, a backend's factory and options in
``make_engine`` / ``engine_options``, a kernel's family in the backend switch). That the arrows point
down (``config_types`` imports nothing, ``tasks/`` never the config) is tests/test_architecture.py's.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from qerl_kit import formats, grpo, nf4
from qerl_kit.cli import build_parser
from qerl_kit.config import ConfigError, DataConfig, LossConfig, ModelConfig, RolloutConfig, from_dict
from qerl_kit.experiments import Budget, GridConfig, train_config
from qerl_kit.linear import NF4Linear
from tests.test_architecture import imports

ROOT = Path(__file__).resolve().parents[1]


def _parses(argv: list[str]) -> bool:
    try:
        build_parser().parse_args(argv)
    except SystemExit:
        return False
    return True


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


# ---- the arrows ------------------------------------------------------------------------------------
def test_the_generic_rollout_registry_holds_nothing_of_vllm():
    """vLLM's options (its context length, the GPU memory share from rollout.vllm_gpu_memory or the
    memory planner) live in rollout/vllm.py; the registry only dispatches to them."""
    def attributes(path):
        return {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}

    assert "vllm_gpu_memory" not in attributes(ROOT / "qerl_kit" / "rollout" / "registry.py")
    assert "vllm_gpu_memory" in attributes(ROOT / "qerl_kit" / "rollout" / "vllm.py")
    assert "qerl_kit.memory_plan" not in imports("qerl_kit.rollout.registry", import_time_only=False)
    assert "qerl_kit.memory_plan" in imports("qerl_kit.rollout.vllm", import_time_only=False)


# ---- a weight format --------------------------------------------------------------------------------
class Fake4Linear(NF4Linear):
    """A new format's frozen layer (NF4's math under another name)."""

    fmt = "fake4"


FAKE4 = formats.Format("fake4", nf4.BLOCK_SIZE, nf4.BITS_PER_WEIGHT, nf4.quantize, nf4.dequantize,
                       "a test format", Fake4Linear)


@pytest.fixture
def fake4():
    yield lambda: formats.register_format(FAKE4)  # the one change
    formats.FORMATS.pop("fake4", None)


def test_a_new_format_is_one_register_format_call(fake4, capsys):
    with pytest.raises(ConfigError, match=r"model\.format must be one of"):
        ModelConfig(format="fake4")
    assert not _parses(["eval", "--format", "fake4"])
    with pytest.raises(ValueError, match="format must be one of"):
        GridConfig("fake4-lora", "fake4", False, 1e-3)

    assert fake4() is FAKE4
    assert ModelConfig(format="fake4").format == "fake4"
    assert from_dict(dict(model=dict(format="fake4"))).model.format == "fake4"
    for argv in (["demo", "--format", "fake4"], ["eval", "--format", "fake4"], ["quantize", "tiny", "--format", "fake4"]):
        assert _parses(argv), argv
    assert "{nvfp4,mxfp4,nf4,fake4,none}" in _help("eval", capsys)
    grid = GridConfig("fake4-lora", "fake4", False, 1e-3)
    assert grid.label == "FAKE4-LoRA"
    assert train_config(grid, 0, Budget(2, 8, 4, 8, (0,))).model.format == "fake4"

    from qerl_kit.quantize import quantize_model

    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 64))
    w, b = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    report = quantize_model(model, fmt="fake4")
    assert report.fmt == "fake4" and [type(model[0]), type(model[2])] == [Fake4Linear, Fake4Linear]
    x = torch.randn(3, 128)
    assert torch.allclose(model[0](x), x @ nf4.quantize(w).dequantize(torch.float32).T + b, atol=1e-5)

    from peft import LoraConfig

    from qerl_kit.lora import QuantLoraLinear, register_quant_layers

    config = register_quant_layers(LoraConfig(r=4, target_modules=["0"]))
    assert config._custom_modules[Fake4Linear] is QuantLoraLinear  # LoRA wraps the new layer class too


@pytest.mark.parametrize("bad, error, match", [
    ("not a Format", TypeError, "takes a qerl_kit.formats.Format; got str"),
    (FAKE4.__class__(**{**FAKE4.__dict__, "name": "none"}), ValueError, "other than 'none'"),
    (FAKE4.__class__(**{**FAKE4.__dict__, "name": "Fake4"}), ValueError, "lowercase identifier.*'Fake4'"),
    (FAKE4.__class__(**{**FAKE4.__dict__, "linear": nn.Linear}), TypeError, "QuantLinear subclass"),
])
def test_register_format_refuses_what_could_not_work(bad, error, match):
    before = dict(formats.FORMATS)
    with pytest.raises(error, match=match):
        formats.register_format(bad)
    assert formats.FORMATS == before  # nothing registered


def test_the_format_rows_carry_their_layer_classes_and_every_name_list_reads_them(capsys):
    from qerl_kit.linear import MXFP4Linear, NVFP4Linear

    assert {n: f.linear for n, f in formats.FORMATS.items()} == {"nvfp4": NVFP4Linear, "mxfp4": MXFP4Linear,
                                                                "nf4": NF4Linear}
    assert all(f.linear.fmt == n for n, f in formats.FORMATS.items())
    assert formats.format_names() == ("nvfp4", "mxfp4", "nf4", "none")
    assert formats.format_names(dense=False) == ("nvfp4", "mxfp4", "nf4")
    assert "{nvfp4,mxfp4,nf4}" in _help("quantize", capsys)
    assert not _parses(["quantize", "tiny", "--format", "none"])  # quantize needs a 4-bit format


# ---- a loss ------------------------------------------------------------------------------------------
def test_a_new_loss_is_one_register_loss_call(monkeypatch):
    with pytest.raises(ConfigError, match=r"loss\.loss must be one of"):
        LossConfig(loss="mine")
    monkeypatch.setattr(grpo, "LOSSES", dict(grpo.LOSSES))  # register_loss writes here; restored after
    spec = grpo.register_loss("mine", grpo.grpo_loss, "sequences")
    cfg = from_dict(dict(loss=dict(loss="mine")))
    assert cfg.loss.loss == "mine" and grpo.LOSSES[cfg.loss.loss] is spec


# ---- a task -------------------------------------------------------------------------------------------
def test_a_new_task_is_one_register_task_call(monkeypatch, capsys):
    from qerl_kit.experiments import _task_budget
    from qerl_kit.tasks import Task, make_task, registry

    with pytest.raises(ConfigError, match=r"data\.dataset must be one of"):
        DataConfig(dataset="mine")
    seen = []

    def factory(cfg, seed):
        seen.append((cfg.dataset, cfg.eval_size, seed))
        rows = [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(cfg.eval_size)]
        return Task("mine", rows, rows, (lambda prompts, completions, **kw: [1.0] * len(completions),),
                    lambda tok, row: row["prompt"], max_new_tokens=7)

    monkeypatch.setattr(registry, "TASKS", dict(registry.TASKS))  # register_task writes here; restored after
    registry.register_task("mine", factory)
    assert from_dict(dict(data=dict(dataset="mine", eval_size=3))).data.dataset == "mine"
    task = make_task(DataConfig(dataset="mine", eval_size=3), seed=5)
    assert task.name == "mine" and len(task.eval) == 3 and seen == [("mine", 3, 5)]
    assert "arith, countdown, gsm8k, math500 or mine" in _help("eval", capsys)
    assert "mine or a GSM8K-style .jsonl" in _help("demo", capsys)
    assert _task_budget("mine") == 7  # the experiment grid reads the task's completion budget
    assert train_config(GridConfig("x", "nvfp4", False, 1e-3), 0, Budget(2, 8, 4, 3, (0,)),
                        dataset="mine").data.dataset == "mine"

    from qerl_kit.cli import _eval_size
    from qerl_kit.config_types import DATA_ROWS_MAX

    eval_args = build_parser().parse_args(["eval", "--dataset", "mine"])
    assert _eval_size(eval_args) == DataConfig().eval_size  # a generated task: "all rows" has no end
    monkeypatch.setattr(registry, "FILE_TASKS", set(registry.FILE_TASKS))
    registry.register_task("mine", factory, from_file=True)  # its rows come from a file: qerl eval takes all
    assert _eval_size(eval_args) == DATA_ROWS_MAX and "mine" in registry.FILE_TASKS


def test_make_task_takes_any_object_with_data_configs_fields():
    """tasks/ sits below the config: a factory receives DataConfig duck-typed, and the default is
    DataConfig's own (its defaults are read from tasks.registry)."""
    from types import SimpleNamespace

    from qerl_kit.tasks import make_task

    cfg = SimpleNamespace(dataset="arith", eval_dataset=None, eval_size=4, train_size=6)
    task = make_task(cfg)
    assert (len(task.train), len(task.eval)) == (6, 4)
    assert make_task().eval == make_task(DataConfig()).eval and len(make_task().eval) == DataConfig().eval_size


# ---- a rollout backend -----------------------------------------------------------------------------
def test_a_new_rollout_backend_is_one_register_engine_call(monkeypatch, capsys):
    from qerl_kit.rollout import registry

    with pytest.raises(ConfigError, match=r"rollout\.engine must be one of"):
        RolloutConfig(engine="mine")
    monkeypatch.setattr(registry, "ENGINES", dict(registry.ENGINES))  # restored after the test
    monkeypatch.setattr(registry, "ENGINE_OPTIONS", dict(registry.ENGINE_OPTIONS))
    registry.register_engine("mine", lambda policy, tokenizer, **kw: ("built", kw),
                             options=lambda rollout, policy, tok, task, lora_r, sample: {"n": rollout.batch_size,
                                                                                         "r": lora_r})
    cfg = from_dict(dict(rollout=dict(engine="mine", batch_size=8, group_size=4)))
    assert cfg.rollout.engine == "mine"
    assert "auto, hf, static, vllm or mine" in _help("train", capsys)
    assert _parses(["train", "--engine", "mine"]) and _parses(["eval", "--engine", "mine"])
    policy = nn.Linear(2, 2)
    options = registry.engine_options(cfg.rollout, policy, None, None, lora_r=4)
    assert options == {"n": 8, "r": 4}
    assert registry.make_engine(cfg.rollout.engine, policy, None, **options) == ("built", {"n": 8, "r": 4})
    registry.register_engine("mine", lambda policy, tokenizer, **kw: "plain")  # no options: none are given
    assert registry.engine_options(cfg.rollout, policy, None, None, lora_r=4) == {}


def test_vllms_options_come_from_its_own_module(monkeypatch):
    from qerl_kit.rollout import registry, vllm

    monkeypatch.setattr(vllm, "vllm_options", lambda *a, **kw: {"from": "rollout.vllm", **kw})
    rollout = RolloutConfig(engine="vllm", batch_size=8, group_size=4)
    assert registry.engine_options(rollout, nn.Linear(2, 2), None, None, lora_r=4, sample=3) == \
        {"from": "rollout.vllm", "lora_r": 4, "sample": 3}


# ---- a kernel ----------------------------------------------------------------------------------------
def test_the_kernel_registry_is_what_the_switch_the_report_and_the_docs_read(monkeypatch):
    from qerl_kit import kernels
    from qerl_kit.kernels import routes
    from qerl_kit.kernels.backend import Backend

    assert set(routes.BACKENDS) == {b.value for b in Backend}  # the switch's names: one list
    forward = {r.kernel for r in routes.ROUTES if r.op == "forward"}
    assert set(kernels._FORWARD) | set(kernels._LUT4_FORWARD) == forward and \
        set(kernels._DGRAD) | set(kernels._LUT4_DGRAD) | {"reference"} == {r.kernel for r in routes.ROUTES if r.op == "dgrad"}
    lut4 = {r.kernel for r in routes.ROUTES if set(r.formats) & set(routes.LUT4)}  # NF4/MXFP4 rows: their launchers
    assert lut4 == set(kernels._LUT4_FORWARD) | set(kernels._LUT4_DGRAD)
    assert routes.kernels_markdown() in (ROOT / "docs" / "kernels.md").read_text()
    assert routes.allowed("reference") == {"reference"}
    assert routes.allowed("ours") == routes.OURS | {"reference"} and "humming" not in routes.allowed("ours")

    mine = routes.Kernel("mine", "triton", "Mine", "ours, Triton", "a test kernel", "`mine.py`")
    with pytest.raises(ValueError, match="kernel 'mine' is not one of"):
        routes.check_table((routes.Route("mine"), routes.Route("reference"), routes.Route("reference", op="dgrad")))
    monkeypatch.setitem(routes.KERNELS, "mine", mine)  # the one registry change
    routes.check_table((routes.Route("mine"), routes.Route("reference"), routes.Route("reference", op="dgrad")))
    assert {"mine"} <= routes.allowed("triton") & routes.allowed("ours") & routes.allowed("auto")
    assert "mine" not in routes.allowed("reference")
    assert "| `mine` | ours, Triton | a test kernel | `mine.py` |" in routes.kernels_markdown()

    from qerl_kit.kernel_report import KernelReport

    report = KernelReport(backend="auto", device="cpu", kernels=(), rows=(1,), layers=(("q", 64, 64, ("mine",)),))
    assert "Mine" in str(report)  # the report's label comes from the registry row


def test_the_formats_table_of_the_docs_is_the_registry():
    """docs/formats.md's table has one row per ``FORMATS`` row, with its block size and bits per weight."""
    rows = {}
    for line in (ROOT / "docs" / "formats.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[-1].startswith("`qerl_kit."):
            rows[cells[0].lower()] = cells
    assert set(rows) == set(formats.FORMATS)
    for name, fmt in formats.FORMATS.items():
        _, _, block, _, bits, module = rows[name]
        assert int(block) == fmt.block_size and float(bits.split()[0]) == fmt.bits_per_weight, name
        assert module == f"`qerl_kit.{name}`"
