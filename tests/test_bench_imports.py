"""bench/ has no import circle: the graph of its modules importing each other (lazy imports inside
functions included) is acyclic; shared helpers live in bench/common.py."""
import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_imports(source: str) -> set[str]:
    """The bench modules one module's source imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "bench":
                found |= {a.name for a in node.names}
            elif node.module.startswith("bench."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("bench.")}
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_find_cycle_sees_a_lazy_circle():
    a = "def f():\n    from bench.b import g\n"
    graph = {"a": bench_imports(a), "b": bench_imports("from bench import a\n")}
    assert find_cycle(graph) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_bench_has_no_import_circle():
    graph = {p.stem: bench_imports(p.read_text()) for p in BENCH.glob("*.py")}
    assert "common" in graph and graph["common"] == set()
    assert find_cycle(graph) is None, f"import circle in bench/: {' -> '.join(find_cycle(graph))}"
