"""The package's layers: every import between nebula_fl modules (an import inside a function included) runs down
the order below or stays within one package, and no set of modules imports itself round a circle. The scan reads
the source (ast), so a lazy import cannot hide a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

# Bottom first. A package may import its own modules and any package on a lower line; packages on one line may
# import each other only where no circle results (the circle check below).
LAYERS = (
    ("errors", "lifetime", "plugins", "devices", "storage", "compat"),
    ("comm", "compression", "secagg", "security", "wan", "data"),
    ("config",),
    ("model",),
    ("privacy",),
    ("tasks",),
    ("strategies",),
    ("components", "reports"),
    ("server", "generation"),
    ("clients", "training"),
    ("launcher",),
    ("deploy",),
    ("cli", "__main__"),
)
RANK = {package: rank for rank, line in enumerate(LAYERS) for package in line}
PACKAGE = REPO / "nebula_fl"


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(root: Path) -> list[tuple[str, str, int]]:
    """(importer, imported module, line) for every import of a nebula_fl module, at any depth of a file."""
    modules = {module_name(p, root): p for p in (root / "nebula_fl").rglob("*.py")}
    found = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".")[: len(name.split(".")) - node.level + is_package]
                    base = ".".join(here + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target.startswith("nebula_fl") and target != name:
                    found.append((name, target, node.lineno))
    return sorted(set(found))  # `from m import a, b` names m once


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "nebula_fl"


def upward(imports: list[tuple[str, str, int]]) -> list[str]:
    """Imports from a package to one on the same or a higher line (the package face `nebula_fl` is the ground)."""
    out = []
    for src, dst, line in imports:
        a, b = package_of(src), package_of(dst)
        if a == b or b == "nebula_fl":
            continue
        if a not in RANK or b not in RANK:
            out.append(f"{src}:{line} -> {dst}: a package missing from LAYERS; place it")
        elif RANK[a] < RANK[b]:
            out.append(f"{src}:{line} -> {dst} runs up from {a} (line {RANK[a]}) to {b} (line {RANK[b]})")
    return out


def circles(imports: list[tuple[str, str, int]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), each a circle of imports."""
    graph: dict[str, set[str]] = {}
    for src, dst, _ in imports:
        graph.setdefault(src, set()).add(dst)
        graph.setdefault(dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_package_is_placed_on_a_line():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert packages - set(RANK) == set(), "add the new package or module to LAYERS"
    assert set(RANK) - packages == set(), "LAYERS names a package that is gone"


def test_no_import_runs_up_the_layers():
    imports = project_imports(REPO)
    assert len(imports) > 300 and any(line > 100 for *_, line in imports)  # the whole package, lazy imports too
    assert upward(imports) == []


def test_no_circle_of_imports():
    assert circles(project_imports(REPO)) == []


@pytest.mark.parametrize("source", ["from nebula_fl.server import app\n",
                                    "def f():\n    import nebula_fl.clients.trainer\n",
                                    "from ..server.app import main\n"])
def test_the_scan_catches_an_upward_import_in_any_spelling(tmp_path, source):
    """A control: a model package that imports the server, at top level, lazily, or relatively, is caught."""
    for rel in ("nebula_fl/__init__.py", "nebula_fl/server/__init__.py", "nebula_fl/server/app.py",
                "nebula_fl/clients/__init__.py", "nebula_fl/clients/trainer.py", "nebula_fl/model/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    (tmp_path / "nebula_fl/model/probe.py").write_text(source)
    assert len(upward(project_imports(tmp_path))) == 1


def test_the_circle_search_finds_a_circle_hidden_in_a_function(tmp_path):
    (tmp_path / "nebula_fl/data").mkdir(parents=True)
    for rel in ("nebula_fl/__init__.py", "nebula_fl/data/__init__.py"):
        (tmp_path / rel).write_text("")
    (tmp_path / "nebula_fl/data/a.py").write_text("from nebula_fl.data.b import g\n")
    (tmp_path / "nebula_fl/data/b.py").write_text("def g():\n    from nebula_fl.data import a\n")
    assert circles(project_imports(tmp_path)) == [["nebula_fl.data.a", "nebula_fl.data.b"]]
