"""Validation stays a bounded share of the code: checks are declared once (rules as
data, read by one function) and run once per configuration or layout, so that the
algorithm shows. The bound is the share the code has now, rounded up to a whole
percent: lower it as checks are consolidated further, never raise it. Check logic
lives in three modules by kind; every other module calls them in one-line guards."""

import pathlib

import puredist
from validation_share import CHECK_MODULES, check_logic, count, modules_with_check_logic, per_module

MAX_SHARE = 0.09
"""The most validation lines may be of the executable lines."""


def test_validation_is_at_most_its_bounded_share_of_the_code():
    counts = per_module(pathlib.Path(puredist.__file__).parent)
    validation = sum(v for v, _ in counts.values())
    total = sum(t for _, t in counts.values())
    largest = sorted(counts.items(), key=lambda item: -item[1][0])[:5]
    assert validation <= MAX_SHARE * total, (
        f"validation is {validation}/{total} = {validation / total:.1%} of the executable lines, over "
        f"{MAX_SHARE:.0%}; the most: {largest}"
    )


def test_the_count_sees_raises_guards_and_check_functions_but_not_docstrings(tmp_path):
    module = tmp_path / "sample.py"
    module.write_text(
        '"""Module docstring."""\n'
        "def check_x(x):\n"
        '    """A check."""\n'
        "    y = x + 1\n"
        "    return y\n"
        "def f(x):\n"
        "    # a comment\n"
        "    if x < 0:\n"
        "        raise ValueError(\n"
        "            'negative')\n"
        "    if x > 9:\n"
        "        x = 9\n"
        "    return x\n"
    )
    # executable: def check_x, y =, return y (3, docstring not) + def f, if, raise (2 lines), if, x =, return (7)
    assert count(module) == (3 + 3, 10)


def test_check_logic_lives_only_in_the_three_modules_of_its_kind():
    """Every other module checks by one-line guards only: a rule's row, a call of a
    check of the three kind modules, an ``if ...: raise``."""
    found = modules_with_check_logic(pathlib.Path(puredist.__file__).parent)
    outside = {module: where for module, where in found.items() if module not in CHECK_MODULES}
    assert not outside, f"check logic outside {CHECK_MODULES}: {outside}"


def test_the_check_logic_measure_tells_guards_from_logic(tmp_path):
    module = tmp_path / "sample.py"
    module.write_text(
        "def check_guards(x):\n"
        '    """Only guards."""\n'
        "    check_positive(x)\n"
        "    if x > 9:\n"
        "        raise ValueError('big')\n"
        "    if x > 5:\n"
        "        check_small(x)\n"
        "    return x\n"
        "def check_logic(xs):\n"
        "    bad = [x for x in xs if x < 0]\n"
        "    check_empty(bad)\n"
        "def refusal():\n"
        "    raise NotImplementedError\n"
        "def passes_on(f):\n"
        "    try:\n"
        "        f()\n"
        "    except OSError as error:\n"
        "        raise RuntimeError('lost') from error\n"
        "    raise RuntimeError('done') from None\n"
        "def loops(xs):\n"
        "    for x in xs:\n"
        "        if x < 0:\n"
        "            y = x\n"
        "            raise ValueError(y)\n"
    )
    assert check_logic(module) == ["check_logic (line 9)", "raise (line 24)"]
