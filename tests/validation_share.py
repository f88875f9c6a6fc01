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


CHECK_MODULES = ("_validation.py", "_inputs.py", "_consistency.py")
"""The modules that hold checks by kind: an argument's value (rules as data),
a tensor given (what a collective or step refuses of it, what it must fit), the
ranks' agreement. Every other module holds one-line guards only."""


def _is_guard(statement: ast.stmt) -> bool:
    """A docstring, a ``return``, a call of a check, an ``if ...: raise`` guard, or an
    ``if`` (no ``else``) around one guard (a check that applies in one case)."""
    if isinstance(statement, ast.If):
        body = statement.body
        return len(body) == 1 and (isinstance(body[0], ast.Raise) or _is_guard(body[0])) and not statement.orelse
    if isinstance(statement, ast.Return):
        return True
    if isinstance(statement, ast.Expr):
        value, called = statement.value, getattr(statement.value, "func", None)
        name = getattr(called, "id", None) or getattr(called, "attr", "")
        return (isinstance(value, ast.Constant) and isinstance(value.value, str)) or bool(_CHECK.match(name))
    return False


class _CheckLogic(ast.NodeVisitor):
    """Where a module checks by more than one-line guards (see :func:`check_logic`)."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self._handlers = 0

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if _CHECK.match(node.name) and not all(map(_is_guard, node.body)):
            self.found.append(f"{node.name} (line {node.lineno})")
        body = [s for s in node.body if not _is_guard(s) or isinstance(s, ast.If)]
        if len(body) == 1 and isinstance(body[0], ast.Raise):
            return  # raising is the function's job: an abstract method, a refusing rule, an error's builder
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        self._handlers += 1
        self.generic_visit(node)
        self._handlers -= 1

    def visit_If(self, node: ast.If) -> None:
        if not _is_guard(node):
            self.generic_visit(node)
        else:
            self.visit(node.test)

    def visit_Raise(self, node: ast.Raise) -> None:
        if not self._handlers and node.cause is None:
            self.found.append(f"raise (line {node.lineno})")


def check_logic(path: pathlib.Path) -> list[str]:
    """Where the module at ``path`` checks by more than one-line guards: each function
    named as a check (``check``, ``validate``, ``refuse``, ``require``, ``ensure``)
    whose body holds anything but guards (its docstring, ``return``, ``if ...: raise``,
    a call of another check, an ``if`` around one of those), and each ``raise`` outside an ``if ...: raise`` guard,
    but in an ``except`` clause or ``raise ... from cause`` (an error translated or
    passed on: the failure path, not a check) or as a function's whole body (raising
    is its job: an abstract method, a rule that refuses, an error's builder)."""
    visitor = _CheckLogic()
    visitor.visit(ast.parse(path.read_text()))
    return visitor.found


def modules_with_check_logic(package: pathlib.Path) -> dict[str, list[str]]:
    """``{module path: check_logic(module)}`` for the modules of ``package`` (``demo/``
    aside) that check by more than one-line guards."""
    found = {str(path.relative_to(package)): check_logic(path)
             for path in sorted(package.rglob("*.py")) if "demo" not in path.relative_to(package).parts}
    return {module: where for module, where in found.items() if where}
