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
    paths = {}
    for path in sorted(package.rglob("*.py")):
        parts = [name, *path.relative_to(package).with_suffix("").parts]
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {module: _imports_within(module, path, set(paths)) for module, path in paths.items()}


def _imports_within(module: str, path: pathlib.Path, modules: set[str]) -> set[str]:
    """:func:`imports_of` ``path`` (the source of ``module``), where ``from package
    import sub`` in a module of ``package`` (or its ``__init__``) names only
    submodules of ``modules``: those submodules, not the package, whose ``__init__``
    is already running or has run (outside the package, the ``__init__`` runs first:
    an import of the package, as :func:`imports_of` counts it)."""
    imported = imports_of(path)
    named: dict[str, list[bool]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module in modules:
            subs = [f"{node.module}.{alias.name}" in modules for alias in node.names]
            named.setdefault(node.module, []).extend(subs)
            imported.update(f"{node.module}.{alias.name}" for alias in node.names
                            if f"{node.module}.{alias.name}" in modules)
    imported -= {package for package, subs in named.items()
                 if all(subs) and (module == package or module.startswith(package + "."))}
    return imported


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """The modules of ``graph`` (``{module: the modules it imports}``) that import one
    that imports them back, directly or through others."""

    def reaches(start: str, goal: str, seen: tuple[str, ...] = ()) -> bool:
        return any(m == goal or (m not in seen and reaches(m, goal, (*seen, m))) for m in graph.get(start, ()))

    return [name for name in graph if reaches(name, name)]

