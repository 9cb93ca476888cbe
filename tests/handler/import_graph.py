"""A package's import graph from its source (the AST; nothing is imported): cycles, room order, lazy imports.

A package is split into rooms (its sub-packages, in order) plus shared modules (any room may import
them; they import nothing of the package). A room may import itself, the rooms before it and the
shared modules; never a room after it. `check` returns three lists:

- `cycles`: each strongly connected set (sorted module names) of two or more modules of the package
  that import one another at module level (imports inside functions or under `if TYPE_CHECKING:` do
  not count; `from pkg.room import mod` is an import of the module pkg.room.mod, importing a
  sub-package is importing its `__init__`).
- `violations`: imports, at module or function level (not under `if TYPE_CHECKING:`), of a module of
  the package from a room that may not import it, and of a `forbidden` top-level package.
- `unexplained`: imports inside a function of a module of one of the `own` top-level packages with
  no comment on its lines or the line above saying why (the word "lazy" or "why:").
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

WHY_COMMENT = re.compile(r"#.*(\blazy\b|\bwhy:)", re.IGNORECASE)


@dataclass(frozen=True)
class Import:
    source: str  # the importing module's dotted name
    target: str  # the imported module's dotted name (a package means its __init__)
    path: Path
    line: int
    in_function: bool


class Graph(NamedTuple):
    cycles: list[list[str]]
    violations: list[str]
    unexplained: list[str]


@dataclass
class _Module:
    name: str
    path: Path
    is_package: bool
    imports: list[Import] = field(default_factory=list)


def _modules(root: Path, package: str) -> dict[str, _Module]:
    """Every module under `root` (the folder of `package`) by dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        name = ".".join([package, *parts])
        found[name] = _Module(name, path, is_package)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_statements(tree: ast.Module) -> Iterable[tuple[ast.Import | ast.ImportFrom, bool]]:
    """(statement, inside a function) for every import not under `if TYPE_CHECKING:`."""

    def visit(node: ast.AST, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for orelse in child.orelse:  # the `else:` of TYPE_CHECKING runs
                    yield from visit(ast.Module(body=[orelse], type_ignores=[]), in_function)
            else:
                inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                yield from visit(child, inner)

    yield from visit(tree, False)


def _targets(stmt: ast.Import | ast.ImportFrom, module: _Module, known: dict[str, _Module]) -> list[str]:
    """The dotted names of the modules a statement imports (any package's, not only ours)."""
    if isinstance(stmt, ast.Import):
        return [alias.name for alias in stmt.names]
    base = stmt.module or ""
    if stmt.level:
        here = module.name.split(".")
        if not module.is_package:
            here = here[:-1]
        here = here[: len(here) - (stmt.level - 1)]
        base = ".".join([*here, *([base] if base else [])])
    targets = []
    for alias in stmt.names:
        sub = f"{base}.{alias.name}"
        targets.append(sub if sub in known else base)
    return targets


def _room(name: str, package: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == package else ""


def _has_why_comment(lines: Sequence[str], stmt: ast.stmt) -> bool:
    first = max(stmt.lineno - 2, 0)  # the line above (0-based index of lineno - 1 is the statement)
    last = stmt.end_lineno or stmt.lineno
    return any(WHY_COMMENT.search(line) for line in lines[first:last])


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of two or more nodes (Tarjan), each sorted, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1 or node in edges.get(node, ()):
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return sorted(found)


def check(
    root: Path,
    package: str,
    rooms: Sequence[str],
    shared: Sequence[str] = (),
    own: Sequence[str] = (),
    forbidden: Sequence[str] = (),
) -> Graph:
    """The package at `root` (named `package`): its cycles, room-order violations and unexplained lazy imports.

    `rooms` are the sub-packages in order, `shared` the modules directly under the package that any
    room may import, `own` the top-level packages (besides `package`) whose lazy import needs a why,
    `forbidden` the top-level packages no module of `package` may import.
    """
    root = Path(root)
    modules = _modules(root, package)
    own_packages = {package, *own}
    order = {room: i for i, room in enumerate(rooms)}
    edges: dict[str, set[str]] = {name: set() for name in modules}
    violations: list[str] = []
    unexplained: list[str] = []

    for module in modules.values():
        source = module.path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source, filename=str(module.path))
        where = module.path.relative_to(root.parent)
        for stmt, in_function in _import_statements(tree):
            for target in dict.fromkeys(_targets(stmt, module, modules)):  # once per statement
                top = target.split(".")[0]
                at = f"{where}:{stmt.lineno}"
                if top in forbidden:
                    violations.append(f"{at} {module.name} imports {target}: {package} may not import {top}")
                if top not in own_packages:
                    continue
                if in_function and not _has_why_comment(lines, stmt):
                    unexplained.append(f"{at} {module.name} imports {target} inside a function (no lazy/why: comment)")
                if top != package:
                    continue
                if not in_function and target in modules and target != module.name:
                    edges[module.name].add(target)
                problem = _layering(module.name, target, package, order, shared)
                if problem:
                    violations.append(f"{at} {problem}")
    return Graph(_cycles(edges), violations, unexplained)


def _layering(source: str, target: str, package: str, order: dict[str, int], shared: Sequence[str]) -> str | None:
    """Why `source` may not import `target` (both of `package`), or None when it may."""
    from_room, to_room = _room(source, package), _room(target, package)
    if to_room == "" or from_room == to_room:  # the package's own __init__, or the same room
        return None
    if from_room == "" or from_room in shared:
        return f"{source} (shared) imports {target}: a shared module imports nothing of {package}"
    if from_room not in order:
        return f"{source} is in no room ({package}.{from_room} is not one of {list(order)}) and imports {target}"
    if to_room in shared:
        return None
    if to_room not in order:
        return f"{source} ({from_room}) imports {target}, which is in no room"
    if order[to_room] > order[from_room]:
        return f"{source} ({from_room}) imports {target} ({to_room}), a room after it"
    return None
