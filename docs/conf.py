"""Sphinx configuration of puredist's documentation: the guides (Markdown, MyST) and the
API reference (autodoc + napoleon, from the docstrings). ``make docs`` builds it offline,
nitpicky and with warnings as errors, so a cross-reference to a puredist name that does
not exist fails the build."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

project = "puredist"
author = "the puredist authors"
copyright = "the puredist authors, BSD-3-Clause"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path = []

myst_heading_anchors = 3
suppress_warnings = ["myst.header"]

autodoc_default_options = {"members": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False  # torch's own docstrings (autograd.Function's) refer to torch's docs
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # a NamedTuple's Attributes: a field list, not a second description of each field
napoleon_use_rtype = False

# Every reference must resolve; names outside puredist (torch, optree, the standard
# library) are not documented here, so they are the only ones let through.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(dist|nn|DeviceMesh)(\..*)?|.*\[.*"),
    (r"py:.*", r"(argparse|torch|optree|hypothesis|torchft|typing|collections|enum|abc|dataclasses|functools|concurrent|datetime|pathlib|types)(\..*)?"),
    (r"py:.*", r"(int|float|str|bool|bytes|object|list|dict|tuple|set|frozenset|type|None|Ellipsis|NoneType|Exception|BaseException|"
               r"RuntimeError|ValueError|TypeError|NotImplementedError|TimeoutError|KeyError|IndexError|callable|optional|"
               r"Callable|Sequence|Mapping|Iterable|Iterator|Any|NamedTuple|Protocol|T|S|Tree|Tensor|PyTree|Module)"),
]

# Each public module has a page (api/index.rst lists them) that documents every name of
# its ``__all__``: a name ``puredist`` re-exports has an entry on its page and one on its
# module's. A reference through another module that exports the same object (a class's
# defining module) resolves to one of the entries of that object.
import dataclasses  # noqa: E402
import importlib  # noqa: E402
import inspect  # noqa: E402
import re  # noqa: E402

from sphinx.domains.python import PythonDomain  # noqa: E402
from sphinx.ext.autodoc import ClassDocumenter, ExceptionDocumenter  # noqa: E402

import puredist  # noqa: E402

# The public modules, in the order of the API reference (its index's toctree); the
# internal modules (the internals page) document only what no public module exports.
PUBLIC = re.findall(r"^   (puredist\S*)$", (Path(__file__).parent / "api" / "index.rst").read_text(), flags=re.M)


def _homes() -> dict[int, str]:
    """``{id(object): the first public module that exports it}`` for the classes and
    functions: their home, whose entry gives a class its canonical name."""
    homes: dict[int, str] = {}
    for module_name in PUBLIC:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                homes.setdefault(id(obj), module_name)
    return homes


_HOMES = _homes()


def _skip_documented_elsewhere(app, what, name, obj, skip, options):
    """An internal module's member that a public module exports is documented on the
    public module's page, not again under the internal one (a public module documents
    every name of its ``__all__``)."""
    if what == "module" and id(obj) in _HOMES and app.env.temp_data.get("autodoc:module") not in PUBLIC:
        return True
    return skip


def _imported(path: str):
    """The object at the dotted ``path`` (a module, then attributes), or None."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        return obj
    return None


def _documented(app, domain) -> dict[int, str]:
    """``{id(object): documented name}`` over the entries of the reference (built once)."""
    if not hasattr(app, "_puredist_documented"):
        app._puredist_documented = {}
        for name, entry in domain.objects.items():
            found = None if entry.aliased else _imported(name)
            if found is not None:
                app._puredist_documented.setdefault(id(found), name)
    return app._puredist_documented


def _same_object(app, env, node, contnode):
    """Resolve a reference to puredist's objects through any module that holds them
    (``puredist.collectives.DistributedCollective``, or ``average_`` written in
    :mod:`puredist.averaging`'s docstrings) to the entry of the same Python object."""
    target = node.get("reftarget", "").lstrip("~.")
    if node.get("refdomain") != "py":
        return None
    module, cls = node.get("py:module") or "", node.get("py:class") or ""
    scopes = [f"{module}.{cls}." if cls else None, f"{module}." if module else None, ""]
    domain = env.get_domain("py")
    for scope in filter(lambda s: s is not None, scopes):
        path = scope + target
        obj = _imported(path) if path.startswith("puredist.") else None
        name = _documented(app, domain).get(id(obj)) if obj is not None else None
        resolved = domain.resolve_any_xref(env, node["refdoc"], app.builder, name, node, contnode) if name else []
        if resolved:
            return resolved[0][1]
    return None


_PROSE = ("attribute", "property", "data")
_ORIGINAL: dict[str, list[str]] = {}


_SEVERAL = re.compile(r"^(\s+)([A-Za-z_]\w*(?:, [A-Za-z_]\w*)+):")


def _keep_prose(app, what, name, obj, options, lines):
    """Before napoleon: an attribute's, a property's or a constant's docstring is prose
    (napoleon would read ``text: more`` on its first line as a type and its text); an
    entry naming several fields (``a, b: text``) names them without spaces, which a
    field list would read as a type and a name."""
    if what in _PROSE:
        _ORIGINAL[name] = list(lines)
    lines[:] = [_SEVERAL.sub(lambda m: m.group(1) + m.group(2).replace(", ", ",") + ":", line) for line in lines]


_TRAILING_UNDERSCORE = re.compile(r"^(\s*:(?:ivar|vartype|param|type) \w+)_:")


def _restore_prose(app, what, name, obj, options, lines):
    """After napoleon: prose back as it was; a field named with a trailing underscore
    (``update_``) escaped, which reST would otherwise read as a link named ``update`` (a
    second ``update`` entry, its type taken by the first)."""
    if what in _PROSE and name in _ORIGINAL:
        lines[:] = _ORIGINAL.pop(name)
    lines[:] = [_TRAILING_UNDERSCORE.sub(r"\1\\_:", line) for line in lines]


def _factory_defaults(app, what, name, obj, options, signature, return_annotation):
    """A dataclass's field with a ``default_factory`` shows its default as the call that
    makes it (``dict()``), not ``<factory>``, which is no Python: the signature would not
    parse and show raw (``~torch.dtype``)."""
    if what == "class" and signature and dataclasses.is_dataclass(obj):
        for field in dataclasses.fields(obj):
            if field.default_factory is not dataclasses.MISSING:
                made = f"{getattr(field.default_factory, '__qualname__', 'factory')}()"
                signature = re.sub(rf"(\b{field.name}: [^=]*= )<factory>", lambda m: m.group(1) + made, signature)
    return signature, return_annotation


class _CanonicalAtHome:
    """A class's ``:canonical:`` name (its defining module's) is given by the entry on its
    home page only: a class that several public modules export has one entry on each of
    their pages, and one canonical name can belong to one entry."""

    def get_canonical_fullname(self) -> str | None:
        home = _HOMES.get(id(self.object))
        return super().get_canonical_fullname() if home in (None, self.modname) else None


class _ClassDocumenter(_CanonicalAtHome, ClassDocumenter):
    pass


class _ExceptionDocumenter(_CanonicalAtHome, ExceptionDocumenter):
    pass


class _PythonDomain(PythonDomain):
    """A reference that matches several entries of one Python object (``CollectiveError``
    as :class:`puredist.CollectiveError` and :class:`puredist.collectives.CollectiveError`)
    goes to the shortest name; entries of different objects stay ambiguous (a warning),
    and so do plain values (two constants may hold one interned value)."""

    def find_obj(self, env, modname, classname, name, type, searchmode=0):
        matches = super().find_obj(env, modname, classname, name, type, searchmode)
        kept: dict[object, tuple] = {}
        for match in sorted(matches, key=lambda match: (len(match[0]), match[0])):
            found = _imported(match[0]) if match[0].startswith("puredist.") else None
            plain = found is None or isinstance(found, (int, float, str, bytes, tuple, frozenset))
            kept.setdefault(match[0] if plain else id(found), match)
        return list(kept.values())


def setup(app):
    app.add_autodocumenter(_ClassDocumenter, override=True)
    app.add_autodocumenter(_ExceptionDocumenter, override=True)
    app.add_domain(_PythonDomain, override=True)
    app.connect("autodoc-process-docstring", _keep_prose, priority=100)
    app.connect("autodoc-process-docstring", _restore_prose, priority=900)
    app.connect("autodoc-skip-member", _skip_documented_elsewhere)
    app.connect("autodoc-process-signature", _factory_defaults)
    app.connect("missing-reference", _same_object)
