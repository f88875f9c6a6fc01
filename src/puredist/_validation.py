"""The rules an argument's value must satisfy, as data, and the one function that
applies them; shared by the functional and classic layers.

A :class:`Rule` is a test, an exception type and a message template; :func:`check`
raises the first rule a value breaks, its message built from the template with the
argument's name and the value. The rules of a configuration run where a transform,
optimizer or plan is built, before any tensor or process group is touched;
:func:`check_same_shapes` (an element shaped unlike its counterpart: an optimizer's
state or gradient, a saved residual) compares shapes the caller reads.

The tables' loops are here too, their rows beside the code they guard:
:func:`check_options` (a configuration's options), :func:`check_entries` (a
checkpoint's entries by key pattern), :func:`check_hypers` and
:func:`check_schedules` (hyper-parameters, a schedule's values at the states'
counts), :func:`check_all` (a check over several values); and the compound rules
over plain values: a hierarchy's periods and group sizes, a plan's owners.
Exception types follow torch's averagers (``ValueError`` for bad values); a wrong
type is a ``TypeError``. Where torch's classes raise for the same rule, the message
is torch's.

This module must not touch tensors or process groups.
"""

from __future__ import annotations

import numbers
import operator
import re
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Iterable, NamedTuple, Sequence

_PERIOD_ONE_WARNING = (
    "When period is 1, no need to use model averaging because the communication cost "
    "of all-reducing parameters will be no less than the cost of all-reducing gradients "
    "by DistributedDataParallel in the backward pass. Therefore, only "
    "DistributedDataParallel should be used for this case."
)
_MAX_PERIOD_ONE_WARNING = (
    "When the maximum period in arg ``period_group_size_dict`` is 1, "
    "no need to use model averaging because the communication cost "
    "of all-reducing parameters will be no less than the cost of all-reducing gradients "
    "by DistributedDataParallel in the backward pass. Therefore, only "
    "DistributedDataParallel should be used for this case."
)


def is_integral(value: object) -> bool:
    """Whether ``value`` is an integral number other than a bool (numpy's included)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_int(value):
    """``value`` as an int where it is :func:`is_integral` (numpy's ints included,
    which torch's classes take), else as it is (the checks refuse it)."""
    return operator.index(value) if is_integral(value) else value


class Rule(NamedTuple):
    """What an argument's value must satisfy.

    Attributes:
        holds: ``holds(value, bounds) -> bool``, ``bounds`` the keywords given to
            :func:`check` (e.g. ``stop``, ``world_size``).
        error: the exception raised where it does not hold.
        message: its template, formatted with ``arg`` (the argument's name),
            ``value``, ``type`` (the name of the value's type) and the bounds.
    """

    holds: Callable[[Any, dict], bool]
    error: type[Exception]
    message: str


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_beta(value: object) -> bool:
    try:
        return bool(0.0 <= value < 1.0)
    except (TypeError, RuntimeError):  # not a number (a string, None, a tensor of several values)
        return False


INT = Rule(lambda v, b: _is_int(v), TypeError, "Arg ``{arg}`` must be an int, got {value!r} ({type}).")
POSITIVE = Rule(lambda v, b: v > 0, ValueError, "Arg ``{arg}`` must be a positive value, got {value}.")
NON_NEGATIVE = Rule(lambda v, b: _is_number(v) and v >= 0, ValueError,  # (NaN fails)
                    "Arg ``{arg}`` must be a non-negative number, got {value!r}.")
NON_NEGATIVE_INT = Rule(lambda v, b: _is_int(v) and v >= 0, ValueError,
                        "Arg ``{arg}`` must be a non-negative int, got {value!r}.")
AT_LEAST_ONE = Rule(lambda v, b: _is_int(v) and v >= 1, ValueError, "Arg ``{arg}`` must be an int >= 1, got {value!r}.")
BELOW = Rule(lambda v, b: _is_int(v) and 0 <= v < b["stop"], ValueError,
             "Arg ``{arg}`` must be an int in [0, {stop}){where}, got {value!r}.")
RANGE = Rule(lambda v, b: _is_int(v) and b["low"] <= v <= b["high"], ValueError,
             "Arg ``{arg}`` must be an int in [{low}, {high}]{where}, got {value!r}.")
ONE_OF = Rule(lambda v, b: v in b["choices"], ValueError, "Arg ``{arg}`` must be one of {choices}, got {value!r}.")
INSTANCE = Rule(lambda v, b: isinstance(v, b["kind"]), TypeError, "Arg ``{arg}`` must be {a}, got {value!r}.")
INSTANCE_OR_NONE = Rule(lambda v, b: v is None or isinstance(v, b["kind"]), TypeError, INSTANCE.message)
LEVELS = Rule(lambda v, b: isinstance(v, Mapping), TypeError,
              "Arg ``{arg}`` must be a mapping {{period: group_size}}, got {value!r}.")
COMPUTE_DTYPE = Rule(  # or None; a float8 has no arithmetic (``excluded``)
    lambda v, b: v is None or getattr(v, "is_floating_point", False) is True and v not in b["excluded"], TypeError,
    "Arg ``{arg}`` must be a floating-point torch.dtype other than float8 (which has no arithmetic) or None, "
    "got {value!r}.")
BETAS = Rule(lambda v, b: isinstance(v, (tuple, list)) and len(v) == 2 and all(map(_is_beta, v)), ValueError,
             "Arg ``{arg}`` must be two numbers in [0, 1), got {value!r}.")
NOT_EMPTY = Rule(lambda v, b: len(v) > 0, ValueError, "Arg ``{arg}`` must not be empty.")
POSITIVE_INTS = Rule(lambda v, b: all(_is_int(s) and s >= 1 for s in v), ValueError,
                     "Arg ``{arg}`` must hold positive ints, got {value!r}.")
NON_NEGATIVE_INTS = Rule(lambda v, b: all(is_integral(s) and s >= 0 for s in v), ValueError,
                         "Arg ``{arg}`` must be non-negative ints, got {value!r}.")
LENGTH = Rule(lambda v, b: len(v) == b["length"], ValueError, "Arg ``{arg}`` must have {length} entries, got {value!r}.")
PARTITION = Rule(  # of range(count), into lists
    lambda v, b: all(is_integral(i) for part in v for i in part)
    and sorted(i for part in v for i in part) == list(range(b["count"])),
    ValueError, "Arg ``{arg}`` must hold every parameter index in [0, {count}) exactly once, got {value!r}.")
FLOAT_DTYPES = Rule(lambda v, b: len(v) > 0 and all(getattr(d, "is_floating_point", False) is True for d in v),
                    ValueError,
                    "Arg ``{arg}`` must be a non-empty sequence of floating-point torch dtypes, got {value!r}.")
# a hierarchy's periods (lowest level first) and group sizes; torch's messages where torch checks the same
MIN_PERIOD = Rule(lambda v, b: v[0] > 0, ValueError,
                  "The minimum period in arg ``{arg}`` must be a positive value, got {value[0]}.")
INCREASING = Rule(lambda v, b: all(h > l for l, h in zip(v, v[1:])), ValueError,
                  "The periods in arg ``{arg}`` must be strictly increasing (lowest level first), got {value}.")
TOP_IS_WHOLE = Rule(lambda v, b: v == b["world_size"], ValueError,  # (of the last size)
                    "The last value in arg ``{arg}`` {value} must be equal to the size of {whole} {world_size}.")
DIVISOR = Rule(lambda v, b: v >= 1 and b["world_size"] % v == 0, ValueError,
               "Every group size in arg ``{arg}`` must be a positive divisor of the group's size {world_size}, "
               "got {value}.")
POSITIVE_INT = Rule(lambda v, b: _is_int(v) and v >= 1, ValueError, "Arg ``{arg}`` must be a positive int, got {value!r}.")
EVEN = Rule(lambda v, b: v % 2 == 0, ValueError, "Arg ``{arg}`` must be even ({why}), got {value}.")
MULTIPLE = Rule(lambda v, b: v % b["of"] == 0, ValueError, "Arg ``{arg}`` must be a multiple of {of} ({why}), got {value}.")
FRACTION = Rule(lambda v, b: _is_number(v) and 0 < v <= 1, ValueError, "Arg ``{arg}`` must be in (0, 1], got {value!r}.")
HOLDS = Rule(lambda v, b: v == b["count"], ValueError,  # ``value``: how many the argument holds
             "Arg ``{arg}`` holds {value} {what} for {count} {per}{where}.")
INTRA_MACHINE_GROUP = Rule(  # torch's first sentence; ``cuda``: whether CUDA is available
    lambda v, b: v is not None or b["cuda"], ValueError,
    "Default group size only takes effect when CUDA is available. Arg ``{arg}`` of PostLocalSGDState is None: the "
    "hook would make groups of torch.cuda.device_count() ranks, one a machine, and CUDA is not available here. On "
    "CPU (Gloo), pass the group: make it on every rank before training, e.g. "
    "``subgroup, _ = dist.new_subgroups(group_size=N)`` with N the ranks of one machine (a divisor of the world "
    "size), then ``PostLocalSGDState(process_group, subgroup, start_localSGD_iter)``; or pass "
    "``post_local_gradient_allreduce=False`` to reduce no gradient after local SGD starts.")

PERIOD = (INT, POSITIVE)
"""A period, a bucket's capacity: an int ``>= 1``."""
COUNT = (INT, NON_NEGATIVE)
"""A number of steps (warm-up): an int ``>= 0``."""


def check(arg: str, value: Any, *rules: Rule, **bounds: Any) -> None:
    """Raise for the first of ``rules`` that ``value`` (the argument named ``arg``)
    breaks, with its message; ``bounds``: what the rules compare with, and ``where``
    (optional): what a range's message adds after the range (what bounds it)."""
    for rule in rules:
        if not rule.holds(value, bounds):
            bounds = {"where": "", **bounds}
            raise rule.error(rule.message.format(arg=arg, value=value, type=type(value).__name__, **bounds))


def check_each(arg: str, values: Sequence[Any], *rules: Rule, **bounds: Any) -> None:
    """:func:`check` for each of ``values`` (the elements of the argument ``arg``)."""
    for value in values:
        check(arg, value, *rules, **bounds)


def check_all(check_one: Callable[[Any], None] | None, values: Iterable[Any]) -> None:
    """``check_one(value)`` for each of ``values``, raising what it raises; ``None``:
    nothing to check (``values`` is not iterated)."""
    if check_one is None:
        return
    for value in values:
        check_one(value)


def check_hypers(values: Mapping[str, Any], *, scheduled: Sequence[str], validate: Callable[[str, Any], None]) -> None:
    """``validate(name, value)`` (raising what it raises) for each hyper-parameter of
    ``values`` at construction, but a schedule (a callable) of one in ``scheduled``,
    whose values :func:`check_schedules` checks at the update."""
    for name, value in values.items():
        if not (callable(value) and name in scheduled):
            validate(name, value)


def check_schedules(hypers: Mapping[str, Any], counts: Iterable[int],
                    validate: Callable[[str, Any], None]) -> dict[int, dict[str, Any]]:
    """``{count: {name: value}}`` for each distinct count of ``counts`` (in order):
    each hyper-parameter's value at that count (a schedule's, a callable of the count,
    evaluated there), each schedule's value passed to ``validate(name, value)`` (raising
    what it raises) before the next count's values are made."""
    groups = {}
    for count in sorted(set(counts)):
        groups[count] = values = {name: value(count) if callable(value) else value for name, value in hypers.items()}
        for name, value in hypers.items():
            if callable(value):
                validate(name, values[name])
    return groups


def check_options(options: object, table: Sequence[tuple[str, Sequence[Rule], Callable[[Any], dict]]]) -> None:
    """Raise for the first option of ``table`` that ``options`` breaks, in the table's
    order: each row ``(name, rules, bounds)`` checks ``getattr(options, name)``
    against ``rules`` with ``bounds(options)`` (see :func:`check`)."""
    for name, rules, bounds in table:
        check(name, getattr(options, name), *rules, **bounds(options))


def check_entries(arg: str, rows: Sequence[Any], given: Mapping[str, Any], load: Any,
                  why: Callable[..., str], *, absent: object) -> None:
    """Raise ``ValueError`` for the first row of ``rows`` (in their order) that an
    entry of ``given`` (the argument named ``arg``) or of ``load.expected`` (what its
    entries must agree with; its keys come first) breaks, the message "Arg
    ``arg``: " followed by ``why(row, match, value, load)``. A row has ``keys``, a
    regular expression a key must match whole, and ``agrees(value, expected, match,
    load)``; ``value`` is ``given``'s entry, ``absent`` stands for a side that lacks
    the key; ``load``: whatever else the rows read."""
    expected = load.expected
    keys = [*expected, *(key for key in given if key not in expected)]
    for row in rows:
        for key in keys:
            match = re.fullmatch(row.keys, key)  # (re caches the compiled rows)
            if match and not row.agrees(given.get(key, absent), expected.get(key, absent), match, load):
                raise ValueError(f"Arg ``{arg}``: " + why(row, match, given.get(key, absent), load))


def check_same_shapes(arg: str, shapes: Sequence[Any], expected: Sequence[Any], *, what: str, other: str,
                      tail: str = "") -> None:
    """Raise ``ValueError`` naming the first position ``i`` where ``shapes`` (of the
    argument ``arg``'s ``what``) differ from ``expected`` (the shapes of ``other``):
    "Arg ``arg``: what i has shape s, other e" and ``tail``. Two lists of one length;
    a ``None`` pairs only with ``None`` (an element with nothing to compare). The
    shapes are compared as lists (torch.compile traces it), the message built only
    when raising."""
    if list(shapes) == list(expected):
        return
    i = next(i for i, (shape, other_shape) in enumerate(zip(shapes, expected)) if shape != other_shape)
    raise ValueError(f"Arg ``{arg}``: {what} {i} has shape {tuple(shapes[i])}, {other} {tuple(expected[i])}{tail}")


def check_period(period: int, *, arg: str = "period") -> None:
    """Raise unless ``period`` (the argument named ``arg``) is an int ``>= 1``."""
    check(arg, period, *PERIOD)


def check_warmup_steps(warmup_steps: int) -> None:
    """Raise unless ``warmup_steps`` is an int ``>= 0``."""
    check("warmup_steps", warmup_steps, *COUNT)


def check_bucket_cap_bytes(bucket_cap_bytes: int) -> None:
    """Raise unless ``bucket_cap_bytes`` is an int ``>= 1``."""
    check("bucket_cap_bytes", bucket_cap_bytes, *PERIOD)


def warn_if_period_is_one(period: int, *, stacklevel: int | None) -> None:
    """Warn as torch does when averaging every step (plain DDP is cheaper); ``None``:
    no warning (torch warns only when an averager is built)."""
    if period == 1 and stacklevel is not None:
        warnings.warn(_PERIOD_ONE_WARNING, stacklevel=stacklevel + 1)


def warn_if_max_period_is_one(periods: Sequence[int], *, stacklevel: int | None) -> None:
    """Warn as torch's hierarchical averager does when its largest period is 1
    (``None``: no warning)."""
    if periods[-1] == 1 and stacklevel is not None:
        warnings.warn(_MAX_PERIOD_ONE_WARNING, stacklevel=stacklevel + 1)


def check_hierarchy_periods(periods: Sequence[int], *, arg: str) -> None:
    """Raise unless ``periods`` (from the argument named ``arg``) is a non-empty,
    strictly increasing run of ints ``>= 1``."""
    check(arg, periods, NOT_EMPTY)
    check_each(arg, periods, INT)
    check(arg, list(periods), MIN_PERIOD, INCREASING)


def check_hierarchy_group_sizes(group_sizes: Sequence[int], world_size: int, *, arg: str, whole: str) -> None:
    """Raise unless every group size (from the argument named ``arg``) is a positive
    divisor of ``world_size`` and the last one (the top of the hierarchy) equals it
    (first, as torch checks it); ``whole`` names what has ``world_size`` ranks (e.g.
    ``"arg process_group"``)."""
    check_each(arg, group_sizes, INT)
    check(arg, group_sizes[-1], TOP_IS_WHOLE, world_size=world_size, whole=whole)
    check_each(arg, group_sizes, DIVISOR, world_size=world_size)


def check_owners(outside: Sequence[tuple[int, Any]], *, world_size: int, what: str) -> None:
    """Raise ``ValueError`` where ``outside`` is not empty: ``(index, owner)`` of each
    owner, in a plan of who owns which parameter, that is not a rank in ``[0,
    world_size)``; the message, "what: owners must be ranks in [0, world_size), got
    ...", names the first eight (``what`` names the plan)."""
    if outside:
        found = ", ".join(f"{owner!r} at parameter {i}" for i, owner in outside[:8])
        raise ValueError(f"{what}: owners must be ranks in [0, {world_size}), got {found}.")


def _is_device(value: object) -> bool:
    import torch  # (a device is parsed, no tensor touched)

    try:
        torch.device(value)
    except (RuntimeError, TypeError):
        return False
    return True


DEVICE = Rule(lambda v, b: v is None or _is_device(v), TypeError,
              "Arg ``{arg}`` must be a torch.device, a device string or None, got {value!r}.")
HOLDS_VALUES = Rule(lambda v, b: v is None or not str(v).startswith("meta"), ValueError,  # (after DEVICE)
                    "Arg ``{arg}`` {value!r}: a meta tensor holds no values to keep.")
EXCLUSIVE = Rule(lambda v, b: v is None or b["given"] is None, ValueError,
                 "Args ``{other}`` ({given}) and ``{arg}`` ({value}) are exclusive: {why}")
