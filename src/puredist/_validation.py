"""Checks of static configuration, shared by the functional and classic layers.

Each check raises before any tensor or process group is touched, with a message that
names the argument and its value. Exception types follow torch's averagers
(``ValueError`` for bad values); a wrong type is a ``TypeError``.

This module must not touch tensors or process groups.
"""

from __future__ import annotations

import numbers
import operator
import warnings
from typing import Sequence

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


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Arg ``{name}`` must be an int, got {value!r} ({type(value).__name__}).")


def check_period(period: int, *, arg: str = "period") -> None:
    """Raise unless ``period`` (the argument named ``arg``) is an int ``>= 1``."""
    _check_int(arg, period)
    if period < 1:
        raise ValueError(f"Arg ``{arg}`` must be a positive value, got {period}.")


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


def check_warmup_steps(warmup_steps: int) -> None:
    """Raise unless ``warmup_steps`` is an int ``>= 0``."""
    _check_int("warmup_steps", warmup_steps)
    if warmup_steps < 0:
        raise ValueError(
            f"Arg ``warmup_steps`` must be a non-negative number, got {warmup_steps}."
        )


def check_hierarchy_periods(periods: Sequence[int], *, arg: str) -> None:
    """Raise unless ``periods`` (from the argument named ``arg``) is a non-empty,
    strictly increasing run of ints ``>= 1``."""
    if len(periods) == 0:
        raise ValueError(f"Arg ``{arg}`` must not be empty.")
    for period in periods:
        _check_int(arg, period)
    if periods[0] <= 0:
        raise ValueError(f"The minimum period in arg ``{arg}`` must be a positive value, got {periods[0]}.")
    for lower, higher in zip(periods, periods[1:]):
        if higher <= lower:
            raise ValueError(
                f"The periods in arg ``{arg}`` must be strictly increasing (lowest level first), got {list(periods)}."
            )


def check_hierarchy_group_sizes(group_sizes: Sequence[int], world_size: int, *, arg: str, whole: str) -> None:
    """Raise unless every group size (from the argument named ``arg``) is a positive
    divisor of ``world_size`` and the last one (the top of the hierarchy) equals it;
    ``whole`` names what has ``world_size`` ranks (e.g. ``"arg process_group"``)."""
    for size in group_sizes:
        _check_int(arg, size)
    if group_sizes[-1] != world_size:  # (first, as torch checks it)
        raise ValueError(
            f"The last value in arg ``{arg}`` {group_sizes[-1]} must be equal to the size of {whole} {world_size}."
        )
    for size in group_sizes:
        if size < 1 or world_size % size != 0:
            raise ValueError(
                f"Every group size in arg ``{arg}`` must be a positive divisor of the group's size "
                f"{world_size}, got {size}."
            )


def check_bucket_cap_bytes(bucket_cap_bytes: int) -> None:
    """Raise unless ``bucket_cap_bytes`` is an int ``>= 1``."""
    _check_int("bucket_cap_bytes", bucket_cap_bytes)
    if bucket_cap_bytes < 1:
        raise ValueError(f"Arg ``bucket_cap_bytes`` must be positive, got {bucket_cap_bytes}.")
