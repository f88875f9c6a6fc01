"""How much of puredist's code is validation, counted from its source (issue 37's
count): the executable lines (statements, docstrings, comments and blank lines not
counted) that are raises, ``if ...: raise`` guards, or inside a function whose name
starts with check, validate, refuse, require or ensure. ``demo/`` is not counted."""

from __future__ import annotations

import ast
import pathlib
import re

_CHECK = re.compile(r"^_*(check|validate|refuse|require|ensure)", re.I)
_DOCUMENTED = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, _DOCUMENTED) and node.body and isinstance(node.body[0], ast.Expr):
            value = node.body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                lines.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    return lines


def _validation_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        guard = (isinstance(node, ast.If) and len(node.body) == 1 and isinstance(node.body[0], ast.Raise)
                 and not node.orelse)
        named = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _CHECK.match(node.name)
        if guard or named or isinstance(node, ast.Raise):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def count(path: pathlib.Path) -> tuple[int, int]:
    """``(validation lines, executable lines)`` of the module at ``path``."""
    source = path.read_text()
    tree, text = ast.parse(source), source.splitlines()
    statements = {line for node in ast.walk(tree) if isinstance(node, ast.stmt)
                  for line in range(node.lineno, node.end_lineno + 1)}
    executable = {line for line in statements - _docstring_lines(tree)
                  if text[line - 1].strip() and not text[line - 1].strip().startswith("#")}
    return len(_validation_lines(tree) & executable), len(executable)


def per_module(package: pathlib.Path) -> dict[str, tuple[int, int]]:
    """``{module path: (validation lines, executable lines)}`` for every module of
    ``package`` but ``demo/``'s."""
    return {str(path.relative_to(package)): count(path)
            for path in sorted(package.rglob("*.py")) if "demo" not in path.relative_to(package).parts}
