"""The layout's promises, checked on the source: dependencies point one way between the top-level
packages, no module imports itself back through others (function-local imports count: a lazy import
only hides a cycle), nothing outside tests/ imports tests/, and no product package imports samples/
(the sample generators and crafted fixtures: dev and demo tooling, not installed). Imports under `if TYPE_CHECKING:`
are annotations, not dependencies, and do not count."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline_core", "spark_jobs", "training", "reports", "plugins", "dags", "samples", "bench", "tests")
PRODUCT = ("pipeline_core", "spark_jobs", "training", "reports", "plugins", "dags")

# which top-level packages each may import (itself always): the runtime layers point down to
# pipeline_core; samples (generators, fixtures) builds on pipeline_core only; bench and tests sit on
# top; nothing but tests imports tests, no product package imports samples.
ALLOWED = {
    "pipeline_core": set(),
    "spark_jobs": {"pipeline_core"},
    "training": {"pipeline_core"},
    "reports": {"pipeline_core", "spark_jobs"},
    "plugins": {"pipeline_core", "spark_jobs", "training", "reports"},
    "dags": {"pipeline_core", "plugins"},
    "samples": {"pipeline_core"},
    "bench": {"pipeline_core", "spark_jobs", "training", "reports", "plugins", "samples"},
    "tests": set(PACKAGES),
}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its body (not under TYPE_CHECKING)."""
    out: set[str] = set()
    is_pkg = path.name == "__init__.py"

    def resolve(target: str) -> None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    resolve(alias.name)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    package = name.split(".") if is_pkg else name.split(".")[:-1]
                    package = package[: len(package) - child.level + 1]
                    base = ".".join([*package, base] if base else package)
                resolve(base)
                for alias in child.names:
                    resolve(f"{base}.{alias.name}")
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_back():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_dependencies_point_one_way_between_packages():
    wrong = defaultdict(set)
    for module, targets in _graph().items():
        top = module.split(".")[0]
        for target in targets:
            if target.split(".")[0] not in ALLOWED[top] | {top}:
                wrong[module].add(target)
    assert dict(wrong) == {}


def test_the_layer_table_keeps_tests_and_samples_out_of_the_product_and_bench_off_tests():
    """The rules above that the layer test enforces, stated so that a widened table fails here."""
    assert all("samples" not in ALLOWED[p] and "tests" not in ALLOWED[p] for p in PRODUCT)
    assert "tests" not in ALLOWED["bench"] and "tests" not in ALLOWED["samples"]
    assert set(ALLOWED) == set(PACKAGES) and set(PRODUCT) < set(PACKAGES)


def test_a_bench_module_importing_tests_is_found(tmp_path):
    """The import scan sees a function-local `from tests...` in a bench module (as the guard benchmark had)."""
    bench = tmp_path / "bench" / "b.py"
    bench.parent.mkdir()
    bench.write_text("def f():\n    from tests.filter_helpers import KEEP\n    return KEEP\n")
    known = {"bench.b": bench, "tests.filter_helpers": tmp_path / "tests" / "filter_helpers.py"}
    assert _imports("bench.b", bench, known) == {"tests.filter_helpers"}
