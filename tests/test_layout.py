"""The package's shape stays as designed: small modules, no import cycles, no private names imported across
modules, every package listed in pyproject.toml, and ``import lmdbstore`` free of torch.

The rules are the ones docs/design.md states; this file is what keeps them true.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib
from conftest import REPO

#: No module of the library or the CLI is longer than this (lines, docstrings and comments included).
MAX_MODULE_LINES = 400
#: Import name of each source folder.
ROOTS = {"lmdbstore": REPO / "lmdbstore", "lmdbstore_cli": REPO / "cli"}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the library and the CLI."""
    out = {}
    for name, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = [name, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imports(module: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, list[str], int]]:
    """``(target module, imported names, line)`` of every import in the file (module level or inside a
    function; ``if TYPE_CHECKING:`` blocks excluded), relative imports resolved."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    package = module if _is_package(path) else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield target, [a.name for a in node.names], node.lineno


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for target, names, _ in _imports(mod, path, modules):
            if target not in modules:
                continue
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            graph[mod].update(subs or [target])
            if subs and len(subs) < len(names):
                graph[mod].add(target)  # names that are not submodules come from the package itself
    return graph


def test_no_module_over_the_line_limit() -> None:
    long = {
        str(p.relative_to(REPO)): n
        for p in _modules().values()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = _edges(modules)
    cycles = []
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append([*stack[stack.index(t) :], t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


#: The library's layers, lowest first: a module imports only from its own layer or below ("No import from a
#: higher layer", docs/design.md#package-layout).  Keyed by the part of the name after ``lmdbstore.``.
LAYERS = [
    {"errors", "version", "format"},
    {"util"},
    {"configcheck", "config"},
    {"store"},
    {"loader"},
    {"feed", "ingestion"},
    {"tools"},
    {"frameworks"},
    {"training"},
    {"", "__main__"},
]


def _layer(module: str) -> int:
    if module.startswith("lmdbstore_cli"):
        return len(LAYERS)
    part = module.split(".")[1] if "." in module else ""
    return next(i for i, names in enumerate(LAYERS) if part in names)


def test_no_import_from_a_higher_layer() -> None:
    modules = _modules()
    up = [
        f"{modules[m].relative_to(REPO)} ({_layer(m)}) imports {t} ({_layer(t)})"
        for m, targets in _edges(modules).items()
        for t in targets
        if _layer(t) > _layer(m) and not (m == "lmdbstore.__main__" and t.startswith("lmdbstore_cli"))
    ]
    assert not up, "\n".join(up)


def test_no_private_name_imported_across_modules() -> None:
    modules = _modules()
    bad = []
    for mod, path in modules.items():
        for target, names, line in _imports(mod, path, modules):
            if not target.startswith(tuple(ROOTS)):
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private or any(part.startswith("_") and not part.startswith("__") for part in target.split(".")):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {private or target} from {target}")
    assert not bad, "\n".join(bad)


def test_every_package_is_listed_in_pyproject() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {m for m, p in _modules().items() if _is_package(p)}
    assert listed == found, f"missing from pyproject: {found - listed}; listed but absent: {listed - found}"
    assert config["package-dir"] == {"lmdbstore_cli": "cli"}


@pytest.mark.parametrize("module", ["lmdbstore", "lmdbstore.tools.verify", "lmdbstore.tools.export"])
def test_reading_and_tools_do_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
