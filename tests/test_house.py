"""The house's size bounds (issue 37's targets), read from the source: a module is
short enough to read at once and a function short enough to hold in mind."""

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
