"""The built API reference: ``make docs``'s command builds it offline, nitpicky and with
warnings as errors (once for this module's tests, about 30 s), and every public name of
every public module (its ``__all__``) has its own entry on its module's page, under its
own name; a NamedTuple's fields are listed under their own names."""

import html
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
from sphinx.util.inventory import InventoryFile

ROOT = Path(__file__).resolve().parents[1]
# the public modules: one page each in docs/api (``puredist.rst``, ``puredist.outer.rst``, ...)
PAGES = sorted(path.stem for path in (ROOT / "docs" / "api").glob("puredist*.rst"))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs")
    command = re.search(r"^docs: install\n\t\$\(PY\) (.+)$", (ROOT / "Makefile").read_text(), flags=re.M).group(1)
    done = subprocess.run(
        [sys.executable, *command.replace("docs out/docs", f"{ROOT / 'docs'} {out}").split()],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return out


def _public_names() -> list[tuple[str, str]]:
    """``(module, name)`` for every name of every public module's ``__all__``."""
    names = []
    for module_name in PAGES:
        module = importlib.import_module(module_name)
        assert hasattr(module, "__all__"), f"{module_name} has a page but no __all__"
        names += [(module_name, name) for name in module.__all__]
    return names


def test_the_docs_build_offline_without_a_warning_with_the_contracts(built):
    front = (built / "api" / "puredist.html").read_text()
    assert 'id="puredist.outer_optimizer"' in front and "Raises" in front


def test_every_public_module_has_a_page_in_the_reference():
    import pkgutil

    import puredist

    listed = (ROOT / "docs" / "api" / "index.rst").read_text()
    public = {f"puredist.{m.name}" for m in pkgutil.iter_modules(puredist.__path__) if not m.name.startswith("_")}
    internal = {"puredist.errors", "puredist.staging", "puredist.demo"}  # the internals page holds them
    assert set(PAGES) == {"puredist"} | public - internal
    assert all(f"\n   {page}\n" in listed for page in PAGES)


def test_every_public_name_has_its_own_entry_on_its_modules_page(built):
    with open(built / "objects.inv", "rb") as stream:
        inventory = InventoryFile.load(stream, "", lambda base, uri: uri)
    entries = {name: (role, entry[2]) for role, named in inventory.items() if role.startswith("py:")
               for name, entry in named.items()}
    wrong = []
    for module, name in _public_names():
        role, uri = entries.get(f"{module}.{name}", (None, None))
        if inspect.ismodule(getattr(importlib.import_module(module), name)):  # (classic's post_localSGD_hook)
            expected = ("py:module", f"api/{module}.html#module-{module}.{name}")
        else:
            expected = (role if role != "py:module" else "not a module", f"api/{module}.html#{module}.{name}")
        if (role, uri) != expected:
            wrong.append(f"{module}.{name}: {role} {uri}")
    assert not wrong, wrong


def _entry(page: str, anchor: str) -> str:
    """The HTML of one entry: from its anchor to the next entry at its level."""
    start = page.index(f'id="{anchor}"')
    end = re.compile(r'id="(?!' + re.escape(anchor) + r'\.)[\w.]+"').search(page, start + len(anchor) + 5)
    return page[start:end.start() if end else len(page)]


def test_each_entry_shows_its_own_name_and_a_named_tuples_fields_under_theirs(built):
    wrong = []
    for module, name in _public_names():
        obj, anchor = getattr(importlib.import_module(module), name), f"{module}.{name}"
        if inspect.ismodule(obj):  # (classic's post_localSGD_hook, as torch's): its hook has the entry
            obj, anchor = getattr(obj, name), f"{anchor}.{name}"
        entry = _entry((built / "api" / f"{module}.html").read_text(), anchor)
        shown = re.search(r'class="sig-name descname"><span class="pre">([^<]+)</span>', entry)
        if shown is None or html.unescape(shown.group(1)) != name:
            wrong.append(f"{anchor} shown as {shown and shown.group(1)}")
        fields = getattr(obj, "_fields", None)
        listed = re.search(r"Variables<span class=\"colon\">:</span></dt>(.*?)</dd>", entry, flags=re.S)
        if isinstance(fields, tuple) and listed:  # a NamedTuple whose docstring lists its fields
            entries = re.findall(r"(?:<li>)?<p>((?:<strong>[^<]*</strong>)+)", listed.group(1))  # (``a, b: ...``)
            names = [field for entry in entries for field in re.sub(r"</?strong>", "", entry).split(",")]
            if names != list(fields):
                wrong.append(f"{anchor}'s fields listed as {names}, not {list(fields)}")
    assert not wrong, wrong


def test_the_public_pages_signatures_show_as_python(built):
    # a signature Sphinx cannot parse (an object's repr for a default or in an annotation:
    # ``<factory>``, ``<FieldKind.COUNT: '...'>``) shows raw, with ``~`` prefixes or cut up
    raw = []
    for module in PAGES:
        for signature in re.findall(r'<dt class="sig[^>]*>(.*?)</dt>', (built / "api" / f"{module}.html").read_text(),
                                    flags=re.S):
            text = html.unescape(re.sub(r"<[^>]*>", "", signature))
            if re.search(r"[<>~]", text):
                raw.append(text)
    assert not raw, raw
