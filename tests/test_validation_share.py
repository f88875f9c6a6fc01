"""Validation stays a bounded share of the code: checks are declared once (rules as
data, read by one function) and run once per configuration or layout, so that the
algorithm shows. The bound is the share the code has now, rounded up to a whole
percent: lower it as checks are consolidated further, never raise it."""

import pathlib

import puredist
from validation_share import count, per_module

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
