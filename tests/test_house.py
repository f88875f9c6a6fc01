"""The house's bounds (issue 37's targets), read from the source: a module is short
enough to read at once, a function short enough to hold in mind, and no module is
part of an import cycle (``TYPE_CHECKING`` imports included)."""

import ast
import pathlib

import puredist

MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def _modules() -> list[pathlib.Path]:
    return sorted(pathlib.Path(puredist.__file__).parent.rglob("*.py"))


def test_no_module_is_over_its_bound():
    long = {str(path): n for path in _modules() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_its_bound():
    long = {
        f"{path.name}:{node.name}": node.end_lineno - node.lineno + 1
        for path in _modules()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    }
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (docstring included): {long}"


def test_no_module_is_part_of_an_import_cycle():
    from import_rules import cycles, package_imports

    graph = package_imports(pathlib.Path(puredist.__file__).parent, "puredist")
    ours = {name: {m for m in imported if m in graph} for name, imported in graph.items()}
    assert not cycles(ours), cycles(ours)


def test_a_submodule_named_from_its_own_package_is_no_import_of_the_package(tmp_path):
    """``from pkg import sub`` inside ``pkg`` imports ``pkg.sub`` (``pkg``'s ``__init__``
    is already running); outside ``pkg`` it runs that ``__init__`` too; a name that is
    no submodule reads the ``__init__``."""
    from import_rules import cycles, package_imports

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg import a\nX = 1\n")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("import os\n")
    graph = package_imports(package, "pkg")
    assert graph["pkg"] >= {"pkg.a"} and "pkg" not in graph["pkg"] and "pkg" not in graph["pkg.a"]
    assert not cycles(graph)
    (package / "b.py").write_text("from pkg import X\n")  # reads the __init__, which imports a, which imports b
    assert set(cycles(package_imports(package, "pkg"))) == {"pkg", "pkg.a", "pkg.b"}
