"""Drop-in for ``torch.distributed.algorithms.model_averaging.utils``.

Differences on purpose: :func:`average_parameters` averages in place in bounded
buckets (torch flattens the whole model into one promoted buffer and rebinds every
``p.data`` to it), and raises :class:`~puredist.RankMismatchError` on every rank when
ranks pass different parameters (torch hangs or averages garbage).

This module must not keep state between calls.
"""

from __future__ import annotations

import operator
from itertools import compress, repeat
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from puredist._validation import Rule, check
from puredist.averaging import average_
from puredist.collectives import DistributedCollective

__all__ = [
    "average_parameters",
    "get_params_to_average",
    "average_parameters_or_parameter_groups",
]


def average_parameters(params: Iterator[torch.nn.Parameter], process_group: dist.ProcessGroup | None) -> None:
    """Average ``params`` in place over ``process_group`` (``None``: WORLD).

    A rank outside the group returns at once. Storage is never moved:
    ``p.data_ptr()`` is the same afterwards.
    """
    average_(list(params), collective=DistributedCollective(process_group))


_PARAM_GROUP = Rule(lambda v, b: isinstance(v, dict), NotImplementedError,  # (where an element is no Parameter)
                    "Parameter input of type {value.__class__} is not supported")
"""An element of ``params`` that is not a ``Parameter`` must be a param-group dict
(torch's exception type and message)."""


def get_params_to_average(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, torch.nn.Parameter]],
) -> list[torch.nn.Parameter]:
    """The parameters (of a model, or of an optimizer's param groups) that have a
    ``.grad``, as torch's function selects them.

    Raises:
        NotImplementedError: an element is neither a ``Parameter`` nor a param-group
            dict (torch's exception type and message).
    """
    selected: list[torch.nn.Parameter] = []
    run: list[torch.nn.Parameter] = []  # parameters read since the last group: selected in one C-level pass
    for param in params:  # read once and in order, as torch does: a bad element raises when it is reached
        if isinstance(param, torch.nn.Parameter):
            run.append(param)
        else:
            check("params", param, _PARAM_GROUP)
            selected += _with_grad(run) + _with_grad(list(param["params"]))  # (a group's may be an iterator)
            run = []
    return selected + _with_grad(run)


_GRAD = operator.attrgetter("grad")


def _with_grad(candidates: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Those of ``candidates`` whose ``.grad`` is set, in order (in C: no Python call
    per parameter, which a training loop would pay at every step)."""
    return list(compress(candidates, map(operator.is_not, map(_GRAD, candidates), repeat(None))))


def average_parameters_or_parameter_groups(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, torch.nn.Parameter]],
    process_group: dist.ProcessGroup | None,
) -> None:
    """Average the parameters of a model or of an optimizer's param groups."""
    average_parameters(iter(get_params_to_average(params)), process_group)
