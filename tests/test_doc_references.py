"""Every repository path and every dotted ``dmref.`` name that the docs and the code cite exists.

Read: the docs (README.md, docs/*.md, dmref/proofs/*.md, examples/README.md, captures/README.md,
dev/README.md), pyproject.toml, and the docstrings and comments of every Python file of the
package (dmref/, its subpackages included) and of tests/.

- A path is a token ending in a known file extension (``docs/gemm.md``, ``tests/data/x.npz``,
  ``kernel_inputs.py``); it resolves when it names a file or folder git tracks: from the
  repository root, from the citing file's folder, or (a bare file name) as the name of a tracked
  file anywhere. Not references: URLs, absolute paths, patterns (``*``, ``<...>``, ``{...}``),
  placeholders (``FILE.npz``, ``OUT/...``), a file a command writes (after ``--out``), and the
  paths of other repositories in :data:`EXTERNAL_PATHS`.
- A dotted name is ``dmref.a.b...``, ``Class.attribute`` of a class of :data:`CLASS_HOMES`
  (``KernelSpec.reference_recipe``), or a Sphinx role target (``:func:`name```,
  ``:class:`~mod.Name```) in a docstring. It resolves when the longest prefix that imports as a
  module has the rest as attributes; a role target is looked up first in the citing class and
  module (a test file: its top-level names).

``KNOWN_BROKEN`` lists the references that their owners have still to fix, each with who; a
reference listed there that resolves, or one missing from it that does not, fails the test.

Also what the docs say of the project itself: ``.ci/run`` runs the README's two commands as the
README writes them, before it installs the extras; the number of the oracle's standard cases that
README.md and docs/oracle.md state is ``make_cases``'; the slow set's minutes in README.md and
pyproject.toml agree.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/*.md", "dmref/proofs/*.md", "examples/README.md", "captures/README.md", "dev/README.md",
        "pyproject.toml")
PACKAGES = {"dmref": "dmref"}  #: source folder -> import name
SOURCES = (*PACKAGES, "tests")
SELF = "tests/test_doc_references.py"  # its docstrings hold examples

#: (citing file, reference) pairs their owners fix; the lead empties it. Key: owner.
KNOWN_BROKEN: dict[str, set[tuple[str, str]]] = {}

#: Paths in other repositories that the docs cite with the repository named beside them.
EXTERNAL_PATHS = {
    "test/python/sdpa/fp8.py": "NVIDIA/cudnn-frontend",
    "tests/pytorch/references/quantize_scale_calc.py": "NVIDIA/TransformerEngine",
    "mx/mx_ops.py": "microsoft/microxcaling",
    "triton/backends/nvidia/compiler.py": "triton-lang/triton",
    "triton/runtime/interpreter.py": "triton-lang/triton",
    "transformers/integrations/sdpa_attention.py": "huggingface/transformers",
    "integrations/sdpa_attention.py": "huggingface/transformers",
    "config.json": "each model's configuration on the Hugging Face hub",
}
#: Classes whose ``Class.attribute`` the docs and docstrings cite without the module.
CLASS_HOMES = {"KernelSpec": "dmref.kernels.config", "Recipe": "dmref.recipes", "QuantPoint": "dmref.recipes",
               "Format": "dmref.emulation.formats", "Block": "dmref.emulation.blocked",
               "ScaleRule": "dmref.emulation.blocked"}

_EXTENSIONS = "py|md|toml|json|npz|pt|txt|csv|png|svg|yaml|yml|cfg|ini|sh|ipynb"
_PATH = re.compile(rf"(?<![\w./:~$-])((?:\.\.?/)*(?:[\w.-]+/)*[\w-][\w.-]*\.(?:{_EXTENSIONS}))(?![\w/-])")
_OUTPUT_OPTION = re.compile(r"(?:--out|--output|-o|>)\s*$")  # a file a command writes: not a reference
_PLACEHOLDER = re.compile(r"^[A-Z]+(?:/|\.(?!md$))")  # FILE.npz, OUT/x.json
_DOTTED = re.compile(r"(?<![\w.])(dmref(?:\.\w+)+)(?![\w-])")
_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj):`~?(\.?[\w.]+)`")
_CLASS_ATTRIBUTE = re.compile(rf"``?((?:{'|'.join(CLASS_HOMES)})\.\w+)(?:\([^`]*\))?``?")


@functools.lru_cache(maxsize=None)
def tracked() -> tuple[frozenset[str], frozenset[str]]:
    """(tracked paths and their folders, tracked file names)."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs a git checkout of the repository (the list of its files)")
    paths = set(out)
    for p in out:
        paths.update(str(parent) for parent in Path(p).parents if str(parent) != ".")
    return frozenset(paths), frozenset(Path(p).name for p in out)


def path_resolves(ref: str, citing: str) -> bool:
    """Whether the path ``ref`` cited in the file ``citing`` names a tracked file or folder."""
    paths, names = tracked()
    if "/" not in ref and ref in names:
        return True
    for base in (Path("."), Path(citing).parent):
        try:
            normal = (ROOT / base / ref).resolve().relative_to(ROOT)
        except ValueError:  # outside the repository: never one of the project's own files
            continue
        if str(normal) in paths:
            return True
    return False


def name_resolves(name: str, namespace: dict | None = None) -> bool:
    """Whether a dotted name resolves: in ``namespace`` (a module's or class's names), as
    ``Class.attribute`` of a class in :data:`CLASS_HOMES`, or as module.attribute... from the
    longest importable prefix."""
    parts = name.split(".")
    if namespace is not None and parts[0] in namespace:
        return _has_attributes(namespace[parts[0]], parts[1:])
    if parts[0] in CLASS_HOMES:
        return _has_attributes(getattr(importlib.import_module(CLASS_HOMES[parts[0]]), parts[0]), parts[1:])
    for i in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return _has_attributes(module, parts[i:])
    return False


def _has_attributes(obj, attributes) -> bool:
    for attribute in attributes:
        if not hasattr(obj, attribute):
            # a dataclass field without a class-level default is still an attribute of the class
            return attribute in getattr(obj, "__dataclass_fields__", {}) and attribute == attributes[-1]
        obj = getattr(obj, attribute)
    return True


def references_in_text(text: str) -> tuple[set[str], set[str]]:
    """(paths, dotted names) cited in a piece of prose."""
    text = re.sub(r"https?://\S+", " ", text)
    paths = set()
    for m in _PATH.finditer(text):
        token = m[1].rstrip(".")
        if token in EXTERNAL_PATHS or _PLACEHOLDER.match(token) or _OUTPUT_OPTION.search(text[:m.start()]):
            continue
        paths.add(token)
    names = {m[1] for m in _DOTTED.finditer(text)} | {m[1] for m in _CLASS_ATTRIBUTE.finditer(text)}
    return paths, names


def _module_name(path: Path) -> str | None:
    rel = path.relative_to(ROOT)
    package = PACKAGES.get(rel.parts[0])
    if package is None or rel.stem == "__main__":  # importing __main__ runs the command line
        return None
    stem = [] if rel.stem == "__init__" else [rel.stem]
    return ".".join([package, *rel.parts[1:-1], *stem])


def _static_names(tree: ast.Module) -> dict:
    """The names a test file binds at its top level (it is not imported here)."""
    names = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    names[target.id] = node
    return names


def _docstrings(tree: ast.Module) -> list[tuple[str, str | None]]:
    """(docstring, enclosing class name or None) for the module, its classes and functions, and
    string statements (attribute docstrings)."""
    out = []

    def visit(node, cls):
        doc = ast.get_docstring(node, clean=False) if isinstance(
            node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else None
        if doc:
            out.append((doc, cls))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant) and isinstance(child.value.value, str):
                if child.value.value != doc:
                    out.append((child.value.value, cls))
            visit(child, child.name if isinstance(child, ast.ClassDef) else cls)

    visit(tree, None)
    return out


def _comments(source: str) -> list[str]:
    return [line.split("#", 1)[1] for line in source.splitlines() if "#" in line]


def _role_resolves(target: str, module_name: str | None, namespace: dict, cls: str | None) -> bool:
    if target.startswith("."):  # relative to the module's package
        package = module_name.rsplit(".", 1)[0] if module_name else ""
        return name_resolves(package + target)
    if target.startswith("dmref"):
        return name_resolves(target)
    if module_name is None:  # a test file: its own top-level names
        return target.split(".")[0] in namespace
    if cls is not None and cls in namespace and _has_attributes(namespace[cls], target.split(".")):
        return True
    return name_resolves(target, namespace)


def broken_references() -> set[tuple[str, str]]:
    """Every (citing file, reference) that does not resolve."""
    broken = set()
    for doc in sorted({p for pattern in DOCS for p in ROOT.glob(pattern)}):
        rel = str(doc.relative_to(ROOT))
        paths, names = references_in_text(doc.read_text())
        broken |= {(rel, p) for p in paths if not path_resolves(p, rel)}
        broken |= {(rel, n) for n in names if not name_resolves(n)}
    for folder in SOURCES:
        for source_file in sorted((ROOT / folder).rglob("*.py")):
            rel = str(source_file.relative_to(ROOT))
            if rel not in tracked()[0] or rel == SELF:
                continue
            source = source_file.read_text()
            tree = ast.parse(source)
            module_name = _module_name(source_file)
            namespace = vars(importlib.import_module(module_name)) if module_name else _static_names(tree)
            docstrings = _docstrings(tree)
            for text in [d for d, _ in docstrings] + _comments(source):
                paths, names = references_in_text(text)
                broken |= {(rel, p) for p in paths if not path_resolves(p, rel)}
                broken |= {(rel, n) for n in names if not name_resolves(n, namespace if module_name else None)}
            for text, cls in docstrings:
                for target in {m[1] for m in _ROLE.finditer(text)}:
                    if not _role_resolves(target, module_name, namespace, cls):
                        broken.add((rel, target))
    return broken


def test_every_cited_path_and_dotted_name_exists():
    # every module of the package is imported, dmref.kernels' and the transformers integration too
    pytest.importorskip("triton", reason="imports dmref.kernels: needs the extra: pip install 'dmref[test-kernels]'")
    pytest.importorskip("transformers", reason="imports dmref.integrations.transformers: needs the extra: "
                                               "pip install 'dmref[transformers]'")
    known = set().union(*KNOWN_BROKEN.values())
    broken = broken_references()
    new = sorted(broken - known)
    fixed = sorted(known - broken)
    assert not new, "references to nothing:\n" + "\n".join(f"  {f}: {r}" for f, r in new)
    assert not fixed, "fixed: remove from KNOWN_BROKEN:\n" + "\n".join(f"  {f}: {r}" for f, r in fixed)


# ----------------------------------------------------------------------------------------------
# The resolver itself: a planted bad reference is found
# ----------------------------------------------------------------------------------------------

def test_resolver_finds_paths_and_names_in_prose():
    paths, names = references_in_text(
        "See docs/gemm.md and `DESIGN.md` section 4, tests/data/h200_fp8_gemm.npz, "
        "https://example.org/a/b.md, docs/*.md, ``dmref.emulation.encode``, dmref.tiled's forward.")
    assert paths == {"docs/gemm.md", "DESIGN.md", "tests/data/h200_fp8_gemm.npz"}
    assert names == {"dmref.emulation.encode", "dmref.tiled"}


def test_resolver_accepts_what_exists_and_refuses_a_planted_bad_reference(tmp_path):
    assert path_resolves("docs/gemm.md", "README.md")
    assert path_resolves("../../docs/gemm.md", "dmref/proofs/README.md")
    assert path_resolves("delta_matching.md", "dmref/proofs/README.md")  # a sibling, by name
    assert path_resolves("dmref/emulation", "README.md")  # a folder
    assert not path_resolves("DESIGN.md", "pyproject.toml")
    assert not path_resolves("docs/no_such_page.md", "README.md")
    assert not path_resolves("../shared/DESIGN.md", "README.md")  # outside the repository
    assert name_resolves("dmref.emulation.blocked.quantize_blocked")
    assert name_resolves("dmref.recipes.Recipe.p")  # a dataclass field
    assert not name_resolves("dmref.emulation.blocked.no_such_function")
    assert not name_resolves("dmref.no_such_module")
    assert name_resolves("ScaleRule.POW2_DOWN", vars(importlib.import_module("dmref.emulation.blocked")))
    assert not name_resolves("ScaleRule.POW3", vars(importlib.import_module("dmref.emulation.blocked")))
    planted = tmp_path / "planted.md"
    planted.write_text("The model of docs/no_such_page.md, as `dmref.emulation.no_such_name` computes it.")
    paths, names = references_in_text(planted.read_text())
    assert [p for p in paths if not path_resolves(p, "docs/planted.md")] == ["docs/no_such_page.md"]
    assert [n for n in names if not name_resolves(n)] == ["dmref.emulation.no_such_name"]



# ----------------------------------------------------------------------------------------------
# CI runs the README's commands as a new user types them
# ----------------------------------------------------------------------------------------------

CI_SCRIPT = ".ci/run"


def readme_commands() -> list[str]:
    """The commands of the README's ``bash`` blocks that install dmref (``python -m pip install
    ...``, with what runs after it on the same line)."""
    blocks = re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), re.DOTALL | re.MULTILINE)
    return [line.strip() for block in blocks for line in block.splitlines()
            if line.startswith("python -m pip install")]


def test_ci_runs_the_readmes_commands_verbatim_before_the_extras():
    commands = readme_commands()
    assert [c for c in commands if c.endswith("dmref demo")], "the README's command that installs and runs the demo"
    assert [c for c in commands if "python -m pytest" in c], "the README's command that installs and runs the tests"
    ci = (ROOT / CI_SCRIPT).read_text().splitlines()
    extras = [i for i, line in enumerate(ci) if line.startswith("python -m pip install") and "[test-kernels" in line]
    assert extras, f"{CI_SCRIPT} installs the extras (Triton, transformers) after the README's commands"
    for command in commands:
        # the command as the line's start, followed at most by what CI does when it fails
        at = [i for i, line in enumerate(ci) if line == command or line.startswith(command + " || ")]
        assert at, f"{CI_SCRIPT} does not run the README's command as written: {command}"
        assert at[0] < extras[0], f"{CI_SCRIPT} runs the README's command only after installing the extras: {command}"


# ----------------------------------------------------------------------------------------------
# Counts the docs state, against the code
# ----------------------------------------------------------------------------------------------

def test_the_docs_count_the_standard_cases_as_the_oracle_makes_them():
    from dmref.oracle import make_cases

    n = len(make_cases("standard", probe=False))
    for doc in ("README.md", "docs/oracle.md"):
        stated = re.findall(r"`standard`, (\d+) cases", (ROOT / doc).read_text())
        assert stated, f"{doc} states the number of standard cases as '`standard`, N cases'"
        assert {int(x) for x in stated} == {n}, f"{doc}: the standard set has {n} cases, not {stated}"


def test_readme_and_pyproject_give_the_slow_set_the_same_minutes():
    minutes = {doc: re.findall(r"about\s+(\d+)\s+minutes\s+on\s+2\s+cores", (ROOT / doc).read_text())
               for doc in ("README.md", "pyproject.toml")}
    assert all(len(m) == 1 for m in minutes.values()), minutes
    assert minutes["README.md"] == minutes["pyproject.toml"], minutes


# ----------------------------------------------------------------------------------------------
# Each number written once: the docs' results tables are generated from benchmarks/results
# ----------------------------------------------------------------------------------------------

def _tables_module():
    """``benchmarks/tables.py``, loaded from its file (``benchmarks/`` is scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmarks_tables", ROOT / "benchmarks" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_generated_tables_are_what_the_results_files_give():
    tables = _tables_module()
    stale = [str(doc.relative_to(ROOT)) for doc in tables.doc_files()
             if tables.regenerate(doc.read_text()) != doc.read_text()]
    assert not stale, f"generated tables differ from benchmarks/results in {stale}: run python benchmarks/tables.py"
    assert tables.generated_ratios("h100") and tables.generated_ratios("h200"), "the speed tables of both devices"


def test_every_ratio_quoted_in_prose_is_a_cell_of_a_generated_table():
    tables = _tables_module()
    prose = tables._PROSE.findall((ROOT / "docs" / "kernels_speed.md").read_text())
    assert prose and all(tables._RATIO.search(text) for _, text in prose), "the speed page quotes ratios in prose"
    assert tables.unquoted_ratios() == [], "a ratio in a <!-- prose:DEVICE --> block that no generated table holds"


def test_a_planted_stale_table_and_an_unquoted_ratio_are_found():
    tables = _tables_module()
    doc = (ROOT / "docs" / "kernels_speed.md").read_text()
    ranges = tables.bench_attention_ranges("h100")
    planted = doc.replace(ranges, ranges.replace("x |", "x (edited) |", 1))
    assert planted != doc and tables.regenerate(planted) == doc
    assert "9.99x" not in tables.generated_ratios("h100")
    assert tables._RATIO.findall("a 9.99x and a 1.05-1.31x, not 10%, v1.2 or 0x10") == ["9.99x", "1.05-1.31x"]
