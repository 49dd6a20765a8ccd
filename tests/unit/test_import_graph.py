"""The package's modules import each other without a circle.

A circle (two modules that each import the other, directly or around a longer loop) makes the import order matter
and usually means one job was split across two files. The graph is read from the source with ``ast``: every import at
module level, those under ``if TYPE_CHECKING:`` included (a circle in the types is still a circle in the design);
imports inside functions are left out (they are how heavy runtimes are kept out of light imports).
"""

from __future__ import annotations

import ast
from pathlib import Path

import hpc_rlhf

PACKAGE_DIR = Path(hpc_rlhf.__file__).parent


def _module_files(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (``pkg/__init__.py`` is ``pkg``)."""
    modules = {}
    for path in package_dir.rglob("*.py"):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module is imported (or type-checked): not inside functions."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        pending.extend(ast.iter_child_nodes(node))
    return found


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports at module level."""
    modules = _module_files(package_dir)

    def owner(name: str) -> str | None:  # the innermost module of the package that ``name`` lies in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in _module_level_imports(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str | None]
            if isinstance(node, ast.Import):
                targets = [owner(alias.name) for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: ``from . import x`` / ``from ..a import b``
                    anchor = package[: len(package) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [owner(f"{base}.{alias.name}") if f"{base}.{alias.name}" in modules else owner(base)
                           for alias in node.names]
            graph[name].update(t for t in targets if t is not None and t != name)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
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
                        circles.append(sorted(component))
    return circles


def test_the_package_has_no_import_circle():
    graph = import_graph(PACKAGE_DIR)
    assert len(graph) > 100  # the whole package was read
    assert import_circles(graph) == []


def test_a_circle_through_type_checking_imports_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "loop.py").write_text("from pkg.sub.hooks import Hooks\n")
    (pkg / "sub" / "hooks.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .loop import Trainer\n")
    (pkg / "sub" / "lazy.py").write_text("def f():\n    from pkg.sub import lazy2\n")
    (pkg / "sub" / "lazy2.py").write_text("from pkg.sub import lazy\n")
    assert import_circles(import_graph(pkg)) == [["pkg.sub.hooks", "pkg.sub.loop"]]
