"""Drop-in for ``torch.distributed.algorithms.model_averaging.averagers``.

The classes keep torch's names, signatures, defaults, warnings and errors; their
state is a pure-core :class:`~puredist.averaging.AveragerState` and their logic is
the core's :func:`~puredist.averaging.periodic_averager`. They gain
``state_dict()``/``load_state_dict()``.

This module must not average by itself: it calls puredist's averagers.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from puredist._validation import as_int, check_warmup_steps
from puredist.averaging import Averager, AveragerState, periodic_averager_warning_at
from puredist.classic.utils import get_params_to_average
from puredist.collectives import DistributedCollective
from puredist.averaging_schedules import periodic_schedule

__all__ = ["ModelAverager", "PeriodicModelAverager"]


class ModelAverager(ABC):
    """Base class for all model averagers.

    Args:
        process_group: the group to all-reduce over; ``None`` means the default
            group (``torch.distributed.init_process_group`` must have run).

    Attributes:
        process_group: the group used.
        step: the step counter (read and write), stored in a core
            :class:`~puredist.averaging.AveragerState`.
    """

    _state = AveragerState(step=0)  # (a subclass may set ``step`` before ``super().__init__``, or never call it)

    def __init__(self, process_group: dist.ProcessGroup | None = None):
        if process_group is None and dist.group.WORLD is None:
            raise TypeError(  # torch's type and text (its not_none check), with the cause
                "Invariant encountered: value was None when it should not be (the default process group: call "
                "torch.distributed.init_process_group first)."
            )
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self._state = AveragerState(step=0)

    @property
    def step(self) -> int:
        return self._state.step

    @step.setter
    def step(self, value: int) -> None:
        self._state = self._state._replace(step=value)

    @abstractmethod
    def average_parameters(self, params):
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The averager's checkpointable state: ``{"step": int}``."""
        return self._state._asdict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`.

        Raises:
            KeyError: ``state_dict`` has no ``"step"``.
        """
        self._state = AveragerState(step=int(state_dict["step"]))


class _CoreAverager(ModelAverager):
    """A classic averager whose averaging steps are each one call of a core averager.

    Subclasses set ``_averager``, ``_collective`` and ``_due(step) -> bool``.
    """

    _averager: Averager
    _collective: DistributedCollective
    _due: Callable[[int], bool]

    def average_parameters(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, torch.nn.Parameter]],
    ) -> None:
        """Average parameters (or an optimizer's param groups) that have a ``.grad``
        when the schedule says so at the current ``step``, then increment ``step``.
        At a step without averaging ``params`` is not read, as in torch.

        Raises:
            NotImplementedError: an element is neither a Parameter nor a param group
                (its peers raise RankMismatchError at once, naming it).
            RankMismatchError: ranks selected different parameters (every rank).
        """
        if not self._due(self.step):
            self.step += 1
            return
        try:
            selected = get_params_to_average(params)
        except NotImplementedError as error:
            # the averager refuses a leaf that is not a tensor on every rank: through the rank check its
            # peers run first, so that they raise at once instead of waiting for this rank
            with contextlib.suppress(TypeError):
                self._averager.update_([error], self._state, collective=self._collective)
            raise
        self._state = self._averager.update_(selected, self._state, collective=self._collective)


class PeriodicModelAverager(_CoreAverager):
    """Averages parameters periodically after the warm-up stage (post-local SGD).

    Averages at step ``k`` iff ``k >= warmup_steps and (k - warmup_steps) % period
    == 0``, in place, in bounded buckets.

    Args:
        period (int): steps per model averaging (``>= 1``; 1 warns as in torch).
        warmup_steps (int): steps before averaging starts (``>= 0``).
        process_group: the group to average over (``None``: the default group).

    Raises:
        ValueError: ``period < 1`` or ``warmup_steps < 0``.
    """

    def __init__(self, period, warmup_steps=0, process_group: dist.ProcessGroup | None = None):
        super().__init__(process_group)
        self._schedule(period, warmup_steps, stacklevel=4)  # the warning at the caller's line
        self._collective = DistributedCollective(self.process_group)

    def _schedule(self, period, warmup_steps, *, stacklevel: int | None) -> None:
        period, warmup_steps = as_int(period), as_int(warmup_steps)
        check_warmup_steps(warmup_steps)  # before the period, as torch
        self._averager = periodic_averager_warning_at(period, warmup_steps, stacklevel=stacklevel)
        self._due = periodic_schedule(period, warmup_steps)
        self._period, self._warmup_steps = period, warmup_steps

    @property
    def period(self) -> int:
        """Steps per averaging. Settable, as torch's (which reads it at every call):
        the schedule from the current step on, checked as when built (no warning)."""
        return self._period

    @period.setter
    def period(self, period) -> None:
        self._schedule(period, self._warmup_steps, stacklevel=None)

    @property
    def warmup_steps(self) -> int:
        """Steps before averaging starts; settable as :attr:`period`."""
        return self._warmup_steps

    @warmup_steps.setter
    def warmup_steps(self, warmup_steps) -> None:
        self._schedule(self._period, warmup_steps, stacklevel=None)
