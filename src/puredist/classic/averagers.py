"""Drop-in for ``torch.distributed.algorithms.model_averaging.averagers``.

The classes keep torch's names, signatures, defaults, warnings and errors; their
state is a pure-core :class:`~puredist.averaging.AveragerState` and their logic is
the core's :func:`~puredist.averaging.periodic_averager`. They gain
``state_dict()``/``load_state_dict()``.

This module must not average by itself: it calls puredist's averagers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterable

import torch
import torch.distributed as dist

from puredist.averaging import Averager, AveragerState, periodic_averager
from puredist.classic.utils import get_params_to_average
from puredist.collectives import DistributedCollective

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

    def __init__(self, process_group: dist.ProcessGroup | None = None):
        if process_group is None and dist.group.WORLD is None:
            raise ValueError("Default process group has not been initialized, please make sure to call init_process_group.")
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
    """A classic averager whose every step is one call of a core averager."""

    _averager: Averager
    _collective: DistributedCollective

    def average_parameters(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, torch.nn.Parameter]],
    ) -> None:
        """Average parameters (or an optimizer's param groups) that have a ``.grad``
        when the schedule says so at the current ``step``, then increment ``step``.

        Raises:
            NotImplementedError: an element is neither a Parameter nor a param group.
            RankMismatchError: ranks selected different parameters (every rank).
        """
        self._state = self._averager.update_(
            get_params_to_average(params), self._state, collective=self._collective
        )


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
        self._averager = periodic_averager(period, warmup_steps)
        self._collective = DistributedCollective(self.process_group)
        self.warmup_steps = warmup_steps
        self.period = period
