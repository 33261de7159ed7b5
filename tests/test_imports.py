"""The import graph of a package: no cycles, and no edge into a package it must never use.

Every `import` statement counts, wherever it is (module top, inside a function, under
`if TYPE_CHECKING:`): a lazy import still means the two modules know each other, and a cycle
hidden behind one breaks as soon as someone moves it to the top. Implicit parent-package
imports (`import a.b` also runs `a/__init__.py`) are not edges.

`import_graph` and `find_cycles` take any package under the repository root, so the same
check serves other packages (parametrize `PACKAGES`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PACKAGES = ["workers", "cluster"]
# package -> packages it must never import
FORBIDDEN = {"workers": ["cluster"]}


def module_files(package: str, root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `package` (packages by __init__)."""
    base = root / package.replace(".", "/")
    modules: dict[str, Path] = {}
    for path in sorted(base.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_statements(module: str, path: Path) -> list[tuple[str, list[str]]]:
    """Every import statement of `module` as (absolute module, names imported from it):
    `import a.b` is ("a.b", []), `from a import b, c` is ("a", ["b", "c"])."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    statements: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            statements.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                # Relative: level 1 is the module's own package.
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            statements.append((base, [alias.name for alias in node.names]))
    return statements


def import_graph(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """module -> modules of `package` it imports. `from pkg import name` is an edge to the
    submodule `pkg.name` when there is one, else to `pkg` itself."""
    modules = module_files(package, root)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges: set[str] = set()
        for base, names in import_statements(module, path):
            targets = [base] if not names else []
            for name in names:
                sub = f"{base}.{name}"
                targets.append(sub if sub in modules else base)
            edges.update(t for t in targets if t in modules and t != module)
        graph[module] = edges
    return graph


def external_imports(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """module -> every top-level package name it imports (stdlib and third party included)."""
    return {
        module: {base.split(".")[0] for base, _ in import_statements(module, path) if base}
        for module, path in module_files(package, root).items()
    }


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package: str) -> None:
    graph = import_graph(package)
    assert len(graph) > 1, f"found no modules under {package}/"
    assert find_cycles(graph) == []


@pytest.mark.parametrize("package", [p for p in PACKAGES if p in FORBIDDEN])
def test_never_imports_forbidden_packages(package: str) -> None:
    bad = {
        module: sorted(names & set(FORBIDDEN[package]))
        for module, names in external_imports(package).items()
        if names & set(FORBIDDEN[package])
    }
    assert bad == {}


def test_the_cycle_finder_finds_a_lazy_import_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (pkg / "c.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from pkg import a\n")
    (pkg / "d.py").write_text("from pkg.a import x\n")
    graph = import_graph("pkg", tmp_path)
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert find_cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert external_imports("pkg", tmp_path)["pkg.c"] == {"typing", "pkg"}
