"""The import graph of a package: no cycles, and no edge into a package it must never use.

Every `import` statement that runs counts, wherever it is (module top, inside a function): a
lazy import still means the two modules know each other, and a cycle hidden behind one breaks
as soon as someone moves it to the top. Imports under `if TYPE_CHECKING:` never run: they only
let a signature name a type (`cfg: ServeConfig` in a module its config imports), so they are
not edges. Implicit parent-package imports (`import a.b` also runs `a/__init__.py`) are not
edges either.

`import_graph` and `find_cycles` take any package under the repository root, so the same
check serves other packages (parametrize `PACKAGES`).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PACKAGES = ["workers", "cluster"]
# package -> packages it must never import
FORBIDDEN = {"workers": ["cluster"]}

# The tree says which process runs what (docs/internals.md, "Where code runs"); these rules
# keep it true. Subpackage -> subpackages (or modules) of the same top package it must never
# import, with the reason a newcomer would give.
LAYOUT_RULES: dict[str, tuple[list[str], str]] = {
    # The engine core reaches devices only through the executor's interface.
    "workers.core": (
        ["workers.device", "workers.executor.ray_executor", "workers.frontend"],
        "the core reaches devices only through workers.executor.base",
    ),
    "workers.frontend": (
        ["workers.device", "workers.executor"],
        "the caller's side talks to an engine core, never to a device",
    ),
    "workers.device": (
        ["workers.frontend", "workers.executor", "workers.core"],
        "a worker answers its executor with workers.messages; it does not know who drives it",
    ),
    "workers.executor": (
        ["workers.frontend", "workers.core"],
        "the executor runs under the core and speaks to it in workers.messages",
    ),
    # The boundary messages are plain data both sides import (messages.core carries the
    # core's report types, EngineStats and KvEvent, from workers.core).
    "workers.messages": (
        ["workers.frontend", "workers.executor", "workers.device"],
        "messages are data both sides of a boundary import",
    ),
    # Ingress replicas host the router in their handle; neither runs an engine.
    "cluster.routing": (
        ["cluster.replica", "cluster.http", "cluster.grpc_api"],
        "runs in the caller",
    ),
    "cluster.http": (["cluster.replica"], "the HTTP ingress runs no engine"),
    "cluster.grpc_api": (["cluster.replica"], "the gRPC ingress runs no engine"),
    "cluster.ingress": (["cluster.replica"], "the ingresses run no engine"),
    "cluster.replica": (
        ["cluster.routing", "cluster.http", "cluster.grpc_api", "cluster.ingress"],
        "an engine replica serves requests; it neither routes nor parses them",
    ),
    "cluster.controller": (
        ["cluster.replica", "cluster.routing", "cluster.http", "cluster.grpc_api"],
        "Serve's controller imports the policy alone",
    ),
}
# Subpackages whose modules never import torch, at any depth of their own statements.
TORCH_FREE = [
    "workers.core",
    "workers.frontend",
    "workers.messages",
    "workers.executor.base",
    "cluster.routing",
]
MAX_LINES = 400


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
    for node in _runtime_nodes(tree):
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


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree` but those under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`);
    an `else:` of such an `if` does run, so it is kept."""
    nodes: list[ast.AST] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return nodes


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


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
    (pkg / "c.py").write_text("import typing\ndef h():\n    from pkg import a\n")
    (pkg / "d.py").write_text("from pkg.a import x\n")
    graph = import_graph("pkg", tmp_path)
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert find_cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert external_imports("pkg", tmp_path)["pkg.c"] == {"typing", "pkg"}


def test_type_checking_imports_are_not_edges(tmp_path: Path) -> None:
    """A module may name a type of a module that imports it: that import never runs."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text(
        "import typing\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg import a\n"
        "if typing.TYPE_CHECKING:\n    import pkg.a\nelse:\n    import pkg.c\n"
    )
    (pkg / "c.py").write_text("")
    graph = import_graph("pkg", tmp_path)
    assert graph["pkg.b"] == {"pkg.c"}  # the else branch runs
    assert find_cycles(graph) == []


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@pytest.mark.parametrize("subpackage", sorted(LAYOUT_RULES))
def test_the_tree_says_which_process_runs_what(subpackage: str) -> None:
    forbidden, why = LAYOUT_RULES[subpackage]
    graph = import_graph(subpackage.split(".")[0])
    modules = [m for m in graph if _within(m, subpackage)]
    assert modules, f"no modules under {subpackage}"
    bad = {m: sorted(t for t in graph[m] if any(_within(t, f) for f in forbidden)) for m in modules}
    bad = {m: ts for m, ts in bad.items() if ts}
    assert bad == {}, f"{subpackage}: {why}"


@pytest.mark.parametrize("subpackage", TORCH_FREE)
def test_torch_free_modules_import_no_torch(subpackage: str) -> None:
    imports = external_imports(subpackage.split(".")[0])
    bad = sorted(m for m, names in imports.items() if _within(m, subpackage) and "torch" in names)
    assert bad == []


def test_the_engine_core_and_frontend_load_without_torch() -> None:
    """Not only their own statements: everything they import at module level stays torch-free
    (config resolution and the executor import torch lazily, when an engine is built)."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import workers.core, workers.frontend\n"
        "for pkg in (workers.core, workers.frontend):\n"
        "    for m in pkgutil.iter_modules(pkg.__path__):\n"
        "        importlib.import_module(pkg.__name__ + '.' + m.name)\n"
        "importlib.import_module('workers.executor.base')\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


def test_no_source_file_is_over_the_size_limit() -> None:
    files = [
        p
        for package in [*PACKAGES, "tests", "monitoring"]
        for p in (ROOT / package).rglob("*.py")
        if "_pb2" not in p.name
    ]
    long = {
        str(p.relative_to(ROOT)): n
        for p in files
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"over {MAX_LINES} lines: split by concept"


def test_the_layout_rules_catch_a_forbidden_import(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "core").mkdir(parents=True)
    (tmp_path / "pkg" / "device").mkdir()
    for d in ("pkg", "pkg/core", "pkg/device"):
        (tmp_path / d / "__init__.py").write_text("")
    (tmp_path / "pkg" / "device" / "gpu.py").write_text("import torch\n")
    (tmp_path / "pkg" / "core" / "sched.py").write_text(
        "def f():\n    from pkg.device import gpu\n"
    )
    graph = import_graph("pkg", tmp_path)
    assert graph["pkg.core.sched"] == {"pkg.device.gpu"}
    assert external_imports("pkg", tmp_path)["pkg.device.gpu"] == {"torch"}
