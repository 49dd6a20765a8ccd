"""The package's modules import each other without a circle, and import each other inside functions only to put
off a heavy runtime.

A circle (two modules that each import the other, directly or around a longer loop) makes the import order matter
and usually means one job was split across two files. The graph is read from the source with ``ast``: every import at
module level, those under ``if TYPE_CHECKING:`` included (a circle in the types is still a circle in the design), and
every import inside a function (an import put off until a call still closes the circle when the call comes).

An import of one of the package's own modules inside a function is how a heavy runtime (torch, transformers, vLLM,
...: :data:`HEAVY_RUNTIMES`) stays out of a light import; it must put off at least one that the importing module does
not load anyway, else it only hides a circle or an ordering problem and belongs at the top of the file.
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


def _function_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements inside functions (run at a call, not at import)."""
    level = {id(node) for node in _module_level_imports(tree)}
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in level]


def import_graph(package_dir: Path, in_functions: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports at module level (``in_functions``: also inside functions)."""
    modules = _module_files(package_dir)

    def owner(name: str) -> str | None:  # the innermost module of the package that ``name`` lies in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        tree = ast.parse(path.read_text(), filename=str(path))
        nodes = _module_level_imports(tree) + (_function_imports(tree) if in_functions else [])
        for node in nodes:
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


HEAVY_RUNTIMES = frozenset({"torch", "transformers", "deepspeed", "vllm", "peft", "bitsandbytes", "tokenizers",
                            "safetensors", "fastapi", "uvicorn", "PIL"})


def _third_party_roots(nodes: list[ast.Import | ast.ImportFrom]) -> set[str]:
    roots = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif not node.level and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def heavy_runtimes_loaded(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the :data:`HEAVY_RUNTIMES` that importing it loads (its own module-level imports, those of the
    package's modules it imports, and of their packages' ``__init__``)."""
    modules = _module_files(package_dir)
    graph = import_graph(package_dir)
    direct = {name: _third_party_roots(_module_level_imports(ast.parse(path.read_text()))) & HEAVY_RUNTIMES
              for name, path in modules.items()}

    def parents(name: str) -> set[str]:
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts))} & set(modules)

    loaded: dict[str, set[str]] = {}
    for start in modules:
        seen, pending, heavy = {start}, [start], set()
        while pending:
            name = pending.pop()
            heavy |= direct[name]
            for nxt in graph[name] | parents(name):
                if nxt not in seen:
                    seen.add(nxt)
                    pending.append(nxt)
        loaded[start] = heavy
    return loaded


def function_imports_of_the_package(package_dir: Path) -> list[tuple[str, str]]:
    """``(importing module, imported module)`` of every import of the package's own modules inside a function."""
    every, module_level = import_graph(package_dir, in_functions=True), import_graph(package_dir)
    return [(name, target) for name in sorted(every) for target in sorted(every[name] - module_level[name])]


def test_the_package_has_no_import_circle():
    graph = import_graph(PACKAGE_DIR)
    assert len(graph) > 100  # the whole package was read
    assert import_circles(graph) == []


def test_no_import_circle_through_imports_inside_functions():
    assert import_circles(import_graph(PACKAGE_DIR, in_functions=True)) == []


def test_imports_inside_functions_put_off_a_heavy_runtime():
    loaded = heavy_runtimes_loaded(PACKAGE_DIR)
    lazy = function_imports_of_the_package(PACKAGE_DIR)
    assert len(lazy) >= 5  # the walk found them (start-up paths, the reward server, LoRA, tiny models)
    needless = [f"{src} -> {dst}" for src, dst in lazy if not loaded[dst] - loaded[src]]
    assert needless == [], "imports inside functions that put off no heavy runtime (move them to the top)"


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
