"""Docstrings for the fields of puredist's NamedTuples, from their class's own.

A NamedTuple's fields are properties whose docstring is "Alias for field number N",
which is what the API reference (Sphinx autodoc) and ``help()`` show. :func:`fields_documented`
gives each field the text its class's ``Attributes:`` section has for it (Google
style: ``name: text``, or ``a, b: text`` for several, continued on more indented
lines). It only sets docstrings.

This module must not change behaviour: it only sets docstrings.
"""

from __future__ import annotations

import inspect
import re

_ENTRY = re.compile(r"^(\s*)([A-Za-z_][\w]*(?:\s*,\s*[A-Za-z_][\w]*)*):\s*(.*)$")


def _attributes(doc: str) -> dict[str, str]:
    """``{field: text}`` from the ``Attributes:`` section of ``doc``."""
    lines = inspect.cleandoc(doc).splitlines()
    if "Attributes:" not in lines:
        return {}
    entries: dict[str, str] = {}
    names: list[str] = []
    indent = None
    for line in lines[lines.index("Attributes:") + 1:]:
        if line.strip() and not line.startswith(" "):
            break  # the next section
        match = _ENTRY.match(line)
        if match and (indent is None or len(match.group(1)) == indent):
            indent = len(match.group(1))
            names = [name.strip() for name in match.group(2).split(",")]
            for name in names:
                entries[name] = match.group(3)
        elif line.strip():
            for name in names:
                entries[name] += " " + line.strip()
    return entries


def fields_documented(cls: type) -> type:
    """Class decorator: each field of the NamedTuple ``cls`` gets its text from the
    class docstring's ``Attributes:`` section (the others keep their own)."""
    for name, text in _attributes(cls.__doc__ or "").items():
        if name in cls._fields:
            getattr(cls, name).__doc__ = text
    return cls
