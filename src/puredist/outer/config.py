"""The options of one outer-optimization transform, checked once and frozen.

:class:`OuterConfig` is what every other module of :mod:`puredist.outer` receives
explicitly (no function captures options): the outer optimizer, the schedule's
numbers, the dtypes and devices of the global copy and of the payload, the lower
levels, the compressor, and what follows from them (the text that names the
configuration in rank checks and checkpoints). When each fragment synchronizes is
:mod:`puredist.outer.timeline`'s.

This module must not touch tensors or talk to other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from puredist._inputs import FLOAT8
from puredist._validation import (
    COMPUTE_DTYPE, COUNT, DEVICE, EXCLUSIVE, HOLDS_VALUES, INSTANCE, INSTANCE_OR_NONE, LEVELS, PERIOD, RANGE,
    check_hierarchy_periods, check_options,
)
from puredist.compression import Compressor
from puredist.compression.codecs import IS_COMPRESSOR
from puredist.optim import Optimizer
from puredist.averaging_schedules import hierarchical_schedule


def _no_lower_level(step: int) -> None:
    return None


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one per transform
class OuterConfig:
    """The options of :func:`~puredist.outer_optimizer` (see there), checked.

    Attributes:
        outer, sync_every, warmup_steps, delay, fragments: as given.
        comm_dtype, global_device, global_dtype, compressor: as given.
        lower_levels: ``{period: group_size}``, as given (``{}``: none).
        lower_sizes: the group sizes of ``lower_levels``, in its order.
        lower_level: ``count -> index into lower_sizes`` of the lower level that
            averages after inner step ``count``, or ``None``.
        same_place: the global copy is the parameters' own device and dtype and is
            sent in it (no ``comm_dtype``; a compressor encodes it as it is):
            pseudo-gradients and write-backs are then multi-tensor kernels over
            whole fragments.
        text: names the configuration in rank checks, errors and checkpoints.
    """

    outer: Optimizer
    sync_every: int
    warmup_steps: int = 0
    delay: int = 0
    fragments: int = 1
    comm_dtype: torch.dtype | None = None
    global_device: torch.device | str | None = None
    global_dtype: torch.dtype | None = None
    lower_levels: Mapping[int, int] = field(default_factory=dict)
    compressor: Compressor | None = None
    lower_sizes: tuple[int, ...] = field(init=False)
    lower_level: Callable[[int], int | None] = field(init=False)
    same_place: bool = field(init=False)
    text: str = field(init=False)

    def __post_init__(self) -> None:
        check_options(self, _OPTIONS)  # then the lower levels' periods (a mapping by then)
        if self.lower_levels:  # (``{}``: no lower level)
            check_hierarchy_periods(tuple(self.lower_levels), arg="lower_levels")
        lower = dict(self.lower_levels)
        derived = {
            "lower_levels": lower,
            "lower_sizes": tuple(lower.values()),
            "lower_level": hierarchical_schedule(tuple(lower), self.warmup_steps) if lower else _no_lower_level,
            "same_place": self.global_device is None and self.global_dtype is None and self.comm_dtype is None,
            "text": (
                f"outer_optimizer({self.outer.config or 'an optimizer built by hand'}, sync_every={self.sync_every}, "
                f"warmup_steps={self.warmup_steps}, delay={self.delay}, fragments={self.fragments}, "
                f"comm_dtype={self.comm_dtype}, global_dtype={self.global_dtype}, lower_levels={lower}"
                + (f", compressor={self.compressor.name})" if self.compressor is not None else ")")
            ),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def __str__(self) -> str:
        return self.text

    def explain(self, reason: str) -> str:
        """An error message about this transform: ``reason`` first, then the
        configuration it concerns (which every error of the transform names)."""
        return f"{reason}\n  (transform: {self.text})"


_OPTIONS = (  # (option, its rules, their bounds from the config), checked in this order by check_options
    ("outer", (INSTANCE,), lambda c: {"kind": Optimizer, "a": "a puredist optimizer (e.g. sgd(0.7, momentum=0.9, "
                                      "nesterov=True))"}),
    ("comm_dtype", (COMPUTE_DTYPE,), lambda c: {"excluded": FLOAT8}),
    ("global_dtype", (COMPUTE_DTYPE,), lambda c: {"excluded": FLOAT8}),
    ("global_device", (DEVICE, HOLDS_VALUES), lambda c: {}),
    ("lower_levels", (LEVELS,), lambda c: {}),
    ("sync_every", PERIOD, lambda c: {}),
    ("warmup_steps", COUNT, lambda c: {}),
    ("delay", (RANGE,), lambda c: {"low": 0, "high": c.sync_every - 1, "where": f" for sync_every={c.sync_every}"}),
    ("fragments", (RANGE,), lambda c: {"low": 1, "high": c.sync_every, "where": f" for sync_every={c.sync_every}"}),
    ("compressor", (INSTANCE_OR_NONE,), lambda c: IS_COMPRESSOR),
    ("comm_dtype", (EXCLUSIVE,), lambda c: {"other": "compressor", "given": c.compressor and c.compressor.name,
                                            "why": "the compressor decides the payload."}),
)
