"""The options of one outer-optimization transform, checked once and frozen.

:class:`OuterConfig` is what every other module of :mod:`puredist.outer` receives
explicitly (no function captures options): the outer optimizer, the schedule's
numbers, the dtypes and devices of the global copy and of the payload, the lower
levels, the compressor, and what follows from them (the text that names the
configuration in rank checks and checkpoints). When each fragment synchronizes is
:func:`puredist.outer.schedule.sync_number`'s.

This module must not touch tensors or talk to other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from puredist._inputs import FLOAT8
from puredist._validation import (
    COMPUTE_DTYPE, INSTANCE, LEVELS, RANGE, check, check_hierarchy_periods, check_period, check_warmup_steps,
)
from puredist.compression import Compressor, check_compressor
from puredist.optim import Optimizer
from puredist.schedules import hierarchical_schedule


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
        lower_level: ``step -> index into lower_sizes`` of the lower level that
            averages at ``step``, or ``None``.
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
        _check_options(self)
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


def _check_options(config: OuterConfig) -> None:
    """Raise ``TypeError``/``ValueError`` naming the first bad option and its value."""
    check("outer", config.outer, INSTANCE, kind=Optimizer,
          a="a puredist optimizer (e.g. sgd(0.7, momentum=0.9, nesterov=True))")
    check("comm_dtype", config.comm_dtype, COMPUTE_DTYPE, excluded=FLOAT8)
    check("global_dtype", config.global_dtype, COMPUTE_DTYPE, excluded=FLOAT8)
    if config.global_device is not None:
        try:
            device = torch.device(config.global_device)
        except (RuntimeError, TypeError) as error:
            raise TypeError(f"Arg ``global_device`` must be a torch.device, a device string or None, got "
                            f"{config.global_device!r} ({error}).") from None
        if device.type == "meta":
            raise ValueError(f"Arg ``global_device`` {config.global_device!r}: a meta tensor holds no values to keep.")
    check("lower_levels", config.lower_levels, LEVELS)
    check_period(config.sync_every, arg="sync_every")
    check_warmup_steps(config.warmup_steps)
    where = f" for sync_every={config.sync_every}"
    check("delay", config.delay, RANGE, low=0, high=config.sync_every - 1, where=where)
    check("fragments", config.fragments, RANGE, low=1, high=config.sync_every, where=where)
    compressor = config.compressor
    if compressor is not None:
        check_compressor(compressor)
    if compressor is not None and config.comm_dtype is not None:
        raise ValueError(
            f"Args ``compressor`` ({compressor.name}) and ``comm_dtype`` ({config.comm_dtype}) are exclusive: the "
            "compressor decides the payload."
        )
    if config.lower_levels:
        check_hierarchy_periods(tuple(config.lower_levels), arg="lower_levels")
