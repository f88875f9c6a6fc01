"""What puredist's modules import, read from their source (imports under
``TYPE_CHECKING`` included), for the tests that check a module's "must not import"
contract and that a package's modules form no import cycle."""

from __future__ import annotations

import ast
import pathlib


def imports_of(path: pathlib.Path) -> set[str]:
    """Every module that the source file at ``path`` imports, by its full name."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    return imported


def package_imports(package: pathlib.Path, name: str) -> dict[str, set[str]]:
    """``{module: the modules it imports}`` for each module of the package ``name`` at
    ``package``, its subpackages' included (a package named by its ``__init__``)."""
    graph = {}
    for path in sorted(package.rglob("*.py")):
        parts = [name, *path.relative_to(package).with_suffix("").parts]
        graph[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = imports_of(path)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """The modules of ``graph`` (``{module: the modules it imports}``) that import one
    that imports them back, directly or through others."""

    def reaches(start: str, goal: str, seen: tuple[str, ...] = ()) -> bool:
        return any(m == goal or (m not in seen and reaches(m, goal, (*seen, m))) for m in graph.get(start, ()))

    return [name for name in graph if reaches(name, name)]

