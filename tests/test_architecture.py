"""The package's shape as data: every module of qerl_kit/ sits on one layer of ``LAYERS`` (low to high,
docs/architecture.md), every import (lazy ones inside functions included) points to the same or a
lower layer, and the whole import graph (lazy imports included) has no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "qerl_kit"

# The layer map, low to high: (name, module prefixes). A prefix takes the module it names and every
# module under it (``qerl_kit.kernels`` takes ``qerl_kit.kernels.routes``); the most specific prefix
# wins (``qerl_kit.rollout.types`` is the contract, ``qerl_kit.rollout`` its registry package).
# ``qerl_kit`` itself (the package's __init__) takes only itself.
LAYERS: list[tuple[str, list[str]]] = [
    ("values", ["qerl_kit.config_types", "qerl_kit.config_yaml", "qerl_kit.finite", "qerl_kit.divergence",
                "qerl_kit.threads", "qerl_kit.locks", "qerl_kit.file_writes", "qerl_kit.table"]),
    # plain-PyTorch reference math, and the CPU cache of the dense weights it computes
    ("formats", ["qerl_kit.fp4", "qerl_kit.nvfp4", "qerl_kit.mxfp4", "qerl_kit.nf4", "qerl_kit.dense_cache"]),
    ("kernels", ["qerl_kit.kernels"]),
    ("model", ["qerl_kit.linear", "qerl_kit.formats", "qerl_kit.quantize", "qerl_kit.adapter_files",
               "qerl_kit.lora", "qerl_kit.lora_layer", "qerl_kit.model_files", "qerl_kit.chat_tokens", "qerl_kit.export",
               "qerl_kit.export_dirs", "qerl_kit.ct_format", "qerl_kit.models", "qerl_kit.gguf_model",
               "qerl_kit.tiny", "qerl_kit.aqn", "qerl_kit.logprobs", "qerl_kit.memory_plan",
               "qerl_kit.dense_update", "qerl_kit.memory_terms"]),
    ("rollout contract", ["qerl_kit.rollout.types", "qerl_kit.rollout.base"]),
    ("rollout backends", ["qerl_kit.rollout.hf", "qerl_kit.rollout.static", "qerl_kit.rollout.vllm"]),
    ("rollout registry", ["qerl_kit.rollout.registry", "qerl_kit.rollout"]),
    ("training pieces", ["qerl_kit.data", "qerl_kit.rewards", "qerl_kit.math_equiv", "qerl_kit.explore",
                         "qerl_kit.tasks", "qerl_kit.scoring", "qerl_kit.grpo", "qerl_kit.sampling_filters",
                         "qerl_kit.optim", "qerl_kit.evaluate", "qerl_kit.old_policy"]),
    ("building", ["qerl_kit.config", "qerl_kit.build", "qerl_kit.checkpoint", "qerl_kit.trainer_state",
                  "qerl_kit.runs", "qerl_kit.distributed", "qerl_kit.grid_dir",
                  "qerl_kit.step_phases", "qerl_kit.engine_memory"]),
    ("loop", ["qerl_kit.trainer"]),
    ("entry", ["qerl_kit.cli", "qerl_kit.demo", "qerl_kit.experiments", "qerl_kit.experiment_views",
               "qerl_kit.kernel_report", "qerl_kit.plots", "qerl_kit.widgets", "qerl_kit"]),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str, modules=None) -> str | None:
    modules = MODULES if modules is None else modules
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def imports(module: str, import_time_only: bool = True, source: str | None = None, modules=None) -> set[str]:
    """The qerl_kit modules ``module`` imports: at import time (its top-level statements), or with
    ``import_time_only=False`` every import anywhere in it (inside functions and branches too).
    ``source`` and ``modules`` stand in for the file and the package (the checker's self-tests)."""
    modules = MODULES if modules is None else modules
    is_init = source is None and MODULES[module].name == "__init__.py"
    tree = ast.parse(MODULES[module].read_text() if source is None else source)
    out = set()
    for node in (tree.body if import_time_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            out.update(r for a in node.names if (r := _resolve(a.name, modules)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_init else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source_name = ".".join(base + ([node.module] if node.module else []))
            else:
                source_name = node.module or ""
            out.update(r for a in node.names
                       if (r := _resolve(f"{source_name}.{a.name}", modules) or _resolve(source_name, modules)))
    out.discard(module)
    return out


def layer_of(module: str, layers=LAYERS) -> int | None:
    """The index in ``layers`` of the layer whose most specific prefix takes ``module``; None if none does.
    The package root (a prefix without a dot) takes only itself."""
    best = None
    for i, (_, prefixes) in enumerate(layers):
        for p in prefixes:
            takes = module == p or ("." in p and module.startswith(p + "."))
            if takes and (best is None or len(p) > len(best[1])):
                best = (i, p)
    return None if best is None else best[0]


def map_problems(modules, layers=LAYERS) -> list[str]:
    """What is wrong with the map itself: a module no layer takes, a prefix listed twice, a prefix that
    names no module (a module moved or removed: its old prefix must go)."""
    listed = [p for _, prefixes in layers for p in prefixes]
    out = [f"{m} is on no layer: add it to LAYERS" for m in sorted(modules) if layer_of(m, layers) is None]
    out += [f"{p} is listed {listed.count(p)} times" for p in sorted(set(listed)) if listed.count(p) > 1]
    out += [f"{p} names no module: remove it from LAYERS" for p in sorted(set(listed))
            if not any(m == p or m.startswith(p + ".") for m in modules)]
    return out


def upward(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Every arrow of ``graph`` from a module to one on a higher layer, as 'a (layer) -> b (layer)'."""
    out = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            lo, hi = layer_of(m, layers), layer_of(d, layers)
            if lo is not None and hi is not None and hi > lo:
                out.append(f"{m} ({layers[lo][0]}) -> {d} ({layers[hi][0]})")
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _graph(import_time_only: bool = False) -> dict[str, set[str]]:
    """qerl_kit's import graph (lazy imports included unless ``import_time_only``)."""
    return {m: imports(m, import_time_only) for m in MODULES}


def test_every_module_is_on_exactly_one_layer():
    assert map_problems(MODULES) == []


@pytest.mark.parametrize("layer", [name for name, _ in LAYERS])
def test_a_lower_layer_never_imports_an_upper_one(layer):
    """Any import, lazy ones inside functions included."""
    graph = _graph()
    mine = {m: deps for m, deps in graph.items() if layer_of(m) is not None and LAYERS[layer_of(m)][0] == layer}
    assert upward(mine) == []


def test_no_import_cycles_lazy_imports_included():
    assert _cycles(_graph()) == []


def test_no_import_time_cycles():
    assert _cycles(_graph(import_time_only=True)) == []




def test_the_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert "qerl_kit.rollout.types" in imports("qerl_kit.rollout.base")


def test_the_checker_finds_an_upward_arrow_and_a_module_off_the_map():
    layers = [("low", ["p.a", "p.sub"]), ("mid", ["p.sub.top"]), ("high", ["p.b", "p"])]
    assert [layer_of(m, layers) for m in ("p.a", "p.sub.x", "p.sub.top", "p.sub.top.y", "p.b", "p", "p.c")] == \
        [0, 0, 1, 1, 2, 2, None]  # the most specific prefix wins; the root "p" takes only itself
    graph = {"p.a": {"p.b", "p.sub.x"}, "p.sub.x": {"p.sub.top"}, "p.sub.top": {"p.a"}, "p.b": {"p.a"}}
    assert upward(graph, layers) == ["p.a (low) -> p.b (high)", "p.sub.x (low) -> p.sub.top (mid)"]
    assert map_problems({"p.a", "p.c", "p.sub.x", "p.sub.top", "p.b", "p"}, layers) == [
        "p.c is on no layer: add it to LAYERS"]
    assert map_problems({"p.a", "p.sub", "p.b", "p"}, layers + [("extra", ["p.a", "p.gone"])]) == [
        "p.a is listed 2 times", "p.gone names no module: remove it from LAYERS", "p.sub.top names no module: "
        "remove it from LAYERS"]


def test_the_checker_sees_lazy_and_relative_imports():
    modules = {"p", "p.a", "p.b", "p.c", "p.d.e"}
    source = ("from p import a\nfrom .d import e\n\ndef f():\n    from p.b import thing\n    import p.c\n")
    assert imports("p.x", source=source, modules=modules) == {"p.a", "p.d.e"}
    assert imports("p.x", import_time_only=False, source=source, modules=modules) == {"p.a", "p.b", "p.c", "p.d.e"}


def test_the_values_layer_imports_no_qerl_kit_module_not_even_lazily():
    """config_types holds the rules every layer checks values with (rollout/types, aqn, lora, quantize
    import it), so it must sit below them all; the config, not it, checks names against the registries."""
    assert imports("qerl_kit.config_types", import_time_only=False) == set()


def test_the_rollout_backends_know_nothing_of_each_other():
    """hf, static and vllm sit on one layer and stay independent: each is replaceable alone."""
    backends = ("qerl_kit.rollout.hf", "qerl_kit.rollout.static", "qerl_kit.rollout.vllm")
    home = {m: next(b for b in backends if m == b or m.startswith(b + ".")) for m in MODULES
            if any(m == b or m.startswith(b + ".") for b in backends)}
    crossing = sorted(f"{m} -> {d}" for m in home for d in imports(m, import_time_only=False)
                      if d in home and home[d] != home[m])
    assert crossing == []


# ---- code size: modules and functions a reader can hold -------------------------------------------

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
LONG_REASON = "Long because:"  # a docstring line starting so explains a longer function


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, tuple[int, bool]]:
    """{qualified name: (lines from ``def`` to its last line, whether its docstring gives a
    ``Long because:`` reason)} for every function, method and nested function over ``limit``."""
    out = {}

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = child.end_lineno - child.lineno + 1
                if lines > limit:
                    doc = ast.get_docstring(child) or ""
                    reason = any(line.strip().startswith(LONG_REASON) for line in doc.splitlines())
                    out[prefix + child.name] = (lines, reason)
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return out


def _package_files() -> dict[str, str]:
    return {p.relative_to(ROOT.parent).as_posix(): p.read_text() for p in sorted(ROOT.rglob("*.py"))}


def test_no_module_over_500_lines():
    # the package and the benchmarks (bench/: scripts a reader opens as often as the package)
    bench = {p.relative_to(ROOT.parent).as_posix(): p.read_text() for p in sorted((ROOT.parent / "bench").glob("*.py"))}
    assert "bench/bench_step.py" in bench
    sizes = {path: len(text.splitlines()) for path, text in {**_package_files(), **bench}.items()}
    assert {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_no_function_over_60_lines_without_a_reason_in_its_docstring():
    unexplained = {f"{path}:{name}": lines for path, text in _package_files().items()
                   for name, (lines, reason) in long_functions(text).items() if not reason}
    assert unexplained == {}


def test_the_size_checker_measures_nested_functions_and_reads_the_reason():
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    source = (f"def short():\n{body[:40]}\n"
              f"class C:\n    def long(self):\n        '''Does it.\n\n        Long because: a table.'''\n"
              + body.replace("    ", "        ")
              + f"\ndef outer():\n    def inner():\n{body.replace('    ', '        ')}    return inner\n")
    assert long_functions(source) == {"C.long": (64, True), "outer": (63, False), "outer.inner": (61, False)}
