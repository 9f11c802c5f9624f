"""The package's shape: no import-time cycles between its modules, and the layers of
docs/architecture.md (the rollout contract knows nothing of training, the static engine nothing of
the registry or the other backends, the kernels nothing of rollouts, the formats nothing of models)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "qerl_kit"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    parts = name.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def imports(module: str, import_time_only: bool = True) -> set[str]:
    """The qerl_kit modules ``module`` imports (at import time: its top-level statements)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    out = set()
    for node in (tree.body if import_time_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            out.update(r for a in node.names if (r := _resolve(a.name)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            out.update(r for a in node.names if (r := _resolve(f"{source}.{a.name}") or _resolve(source)))
    out.discard(module)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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


def test_no_import_time_cycles():
    graph = {m: imports(m) for m in MODULES}
    assert _cycles(graph) == []


def test_the_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "qerl_kit.rollout.types" in imports("qerl_kit.rollout.base")


@pytest.mark.parametrize("lower, upper", [
    ("qerl_kit.rollout", ("qerl_kit.trainer", "qerl_kit.grpo", "qerl_kit.tasks", "qerl_kit.config")),
    ("qerl_kit.rollout.static", ("qerl_kit.rollout.registry", "qerl_kit.rollout.hf", "qerl_kit.rollout.vllm",
                                 "qerl_kit.trainer", "qerl_kit.tasks", "qerl_kit.evaluate")),
    ("qerl_kit.kernels", ("qerl_kit.rollout", "qerl_kit.trainer")),
    ("qerl_kit.tasks", ("qerl_kit.trainer", "qerl_kit.rollout.hf", "qerl_kit.rollout.static")),
    ("qerl_kit.nvfp4", ("qerl_kit.linear", "qerl_kit.quantize", "qerl_kit.rollout", "qerl_kit.trainer")),
    ("qerl_kit.grpo", ("qerl_kit.trainer", "qerl_kit.rollout", "qerl_kit.config")),
])
def test_a_lower_layer_never_imports_an_upper_one(lower, upper):
    """Any import, lazy ones inside functions included."""
    below = [m for m in MODULES if m == lower or m.startswith(lower + ".")]
    bad = {m: sorted(d for d in imports(m, import_time_only=False) if any(d == u or d.startswith(u + ".") for u in upper))
           for m in below}
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_values_layer_imports_no_qerl_kit_module_at_import_time():
    """config_types holds the rules every layer checks values with (rollout/types, aqn, lora, quantize
    import it), so it must sit below them all: its registry lookups are lazy."""
    assert imports("qerl_kit.config_types") == set()
