"""The import graph of the package, read from the source (no module is imported): its circles and
its layers.

An edge A -> B is an ``import`` in module A that names module B of the package, at any depth of
A's source (an import inside a function is a circle that waits for its first call), except under
``if TYPE_CHECKING:``. ``from P import name`` is an edge to ``P.name`` where that is a module, else
to ``P``. Importing ``P.Q.M`` also runs the ``__init__`` of ``P.Q`` and ``P``: those are edges
too, except to the importer's own enclosing packages (a package's ``__init__`` importing its
children is how packages are built, not a circle). A circle is a strongly connected component of
more than one module, or a module importing itself.

Run ``python tests/test_import_graph.py`` to print every circle and every arrow that leaves the
emulation layer.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "dmref"
#: The lowest layer: it imports nothing else of the package.
EMULATION = "dmref.emulation"

#: Circles outside the emulation layer known and accepted, each as the sorted modules of one strongly
#: connected component: none. A circle fails the test; one listed here and ended is noticed too.
KNOWN_CIRCLES: set[frozenset[str]] = set()


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """The Import and ImportFrom nodes of a module, outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """module -> the modules of the package it imports (module docstring)."""
    files = module_files(root, package)
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]  # the package relative imports start in
        targets = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            base = here
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = ".".join(p for p in (base if node.level else "", node.module or "") if p)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.add(sub if sub in files else source)
        for target in targets:
            while target and target not in files:  # ``import pkg.mod.name`` where name is no module
                target = target.rpartition(".")[0]
            if not target or target == name:
                continue
            graph[name].add(target)
            enclosing = set(_parents(name)) | ({name} if is_package else set())
            graph[name].update(p for p in _parents(target) if p in files and p not in enclosing)
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module, and the modules importing
    themselves (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
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
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(frozenset(component))
    return found


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_graph_sees_a_circle_through_a_function_level_import(tmp_path):
    """A lazy import closes a circle as surely as a top-level one; a parent package's
    ``__init__`` counts for whom imports its children from outside."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .sub.c import x\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "sub" / "__init__.py").write_text("from .c import x\nfrom .. import b\n")
    (pkg / "sub" / "c.py").write_text("x = 1\nfrom typing import TYPE_CHECKING\n"
                                      "if TYPE_CHECKING:\n    from .. import a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.c"}
    assert graph["pkg.sub.c"] == set()  # the TYPE_CHECKING import is no edge
    assert circles(graph) == [frozenset({"pkg.a", "pkg.b", "pkg.sub"})]


def test_the_emulation_layer_has_no_circle():
    found = [c for c in circles(import_graph()) if any(_in(m, EMULATION) for m in c)]
    assert not found, f"import circles in {EMULATION}: {[sorted(c) for c in found]}"


def test_the_emulation_layer_imports_nothing_above_it():
    graph = import_graph()
    up = sorted((a, b) for a, targets in graph.items() if _in(a, EMULATION)
                for b in targets if not _in(b, EMULATION))
    assert not up, f"{EMULATION} imports from the layers above it: {up}"


def test_the_gemm_model_is_data_without_torch():
    """The GEMM model (rules, schedules, ``HOPPER``) imports with torch unavailable: its packages'
    ``__init__`` files are skipped (they import the engines), every module the model needs is
    imported for real, and ``import torch`` raises."""
    code = textwrap.dedent("""
        import importlib, sys, types
        from pathlib import Path
        sys.modules["torch"] = None  # import torch raises ImportError
        root = Path(sys.argv[1])
        for name in ("dmref", "dmref.emulation", "dmref.emulation.gemm"):
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*name.split(".")))]
            sys.modules[name] = package
        model = importlib.import_module("dmref.emulation.gemm.model")
        rules = model.HOPPER
        print(rules.k_step, rules.term_frac_bits, rules.result_bits,
              model.triton_dot_schedule(64)["tile_k"], len(model.plan_k_tiles(256, 32, 128, 128)))
        print(sorted(m for m in sys.modules if m.startswith("dmref.")))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr.strip().splitlines()[-1:]
    values, modules = proc.stdout.strip().splitlines()
    assert values.split() == ["32", "13", "14", "64", "2"]
    assert "dmref.emulation.gemm.model" in modules and "dmref.emulation.formats" in modules


def test_the_circles_outside_the_emulation_layer_are_the_known_ones():
    found = set(circles(import_graph()))
    new = found - KNOWN_CIRCLES
    ended = KNOWN_CIRCLES - found
    assert not new, f"new import circles: {[sorted(c) for c in new]}"
    assert not ended, f"ended, remove from KNOWN_CIRCLES: {[sorted(c) for c in ended]}"


if __name__ == "__main__":
    graph = import_graph()
    for component in sorted(circles(graph), key=sorted):
        print("circle:", " <-> ".join(sorted(component)))
    for a in sorted(graph):
        for b in sorted(graph[a]):
            if _in(a, EMULATION) and not _in(b, EMULATION):
                print(f"up: {a} -> {b}")
    sys.exit(0)
