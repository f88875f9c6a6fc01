"""The optimizer protocol, the per-parameter state types, and state utilities.

An :class:`Optimizer` is a NamedTuple of pure functions:

- ``init(params) -> state``: a tree shaped like ``params`` holding one per-parameter
  state (a NamedTuple) where ``params`` holds a tensor (optax's layout:
  ``init({"w": w})["w"]`` is ``w``'s state);
- ``update(params, grads, state) -> (params, state)``: pure; new tensors, inputs
  untouched;
- ``update_(params, grads, state) -> state``: writes the new values into ``params``'
  own storage (and updates the state's tensors in place).

``params`` and ``grads`` are pytrees of the same structure; a ``None`` in ``grads``
where ``params`` has a tensor leaves that parameter and its state unchanged, as
``torch.optim`` skips parameters without ``.grad``. Because the state is per parameter, any sub-list of parameters can be
stepped with the matching sub-list of states (a flat sequence of per-parameter states
is taken for any tree): that is how ZeRO steps only the parameters a rank owns.

This module must not communicate, nor step anything: it defines what an optimizer
is and what its state holds.
"""

import operator
from itertools import repeat
from typing import Any, Callable, NamedTuple, Sequence

import torch

from puredist._docs import fields_documented
from puredist._seq import any_none, rows_of
from puredist.tree import PyTree


@fields_documented
class SGDParamState(NamedTuple):
    """SGD state of one parameter, with momentum (torch's layout).

    Attributes:
        momentum_buffer: the momentum buffer: zeros (``-0.0``) from ``init`` (the first
            step then makes it the gradient, as torch's first step does). ``None`` is
            taken as input (a state from before torch's first step) and never returned.
    """

    momentum_buffer: torch.Tensor | None


@fields_documented
class SGDCountedParamState(NamedTuple):
    """SGD state of one parameter, with momentum and a step count: with a schedule or
    dampened momentum (the count tells the first step, which takes the gradient
    undamped).

    Attributes:
        momentum_buffer: as :class:`SGDParamState`'s.
        step: the updates taken, a 0-dim float32 CPU tensor (as Adam's).
    """

    momentum_buffer: torch.Tensor | None
    step: torch.Tensor


@fields_documented
class SGDCountParamState(NamedTuple):
    """SGD state of one parameter without momentum, with a schedule.

    Attributes:
        step: the updates taken, a 0-dim float32 CPU tensor.
    """

    step: torch.Tensor


class SGDNoParamState(NamedTuple):
    """SGD state of one parameter without momentum or schedule: nothing (as optax's
    ``EmptyState``)."""


@fields_documented
class AdamParamState(NamedTuple):
    """Adam/AdamW state of one parameter (torch's layout).

    Attributes:
        step: the number of steps taken, a 0-dim float32 CPU tensor.
        exp_avg: first-moment running average.
        exp_avg_sq: second-moment running average.
    """

    step: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


@fields_documented
class AMSGradParamState(NamedTuple):
    """Adam/AdamW state of one parameter with amsgrad (torch's layout).

    Attributes:
        step, exp_avg, exp_avg_sq: as :class:`AdamParamState`'s.
        max_exp_avg_sq: the running max of ``exp_avg_sq``.
    """

    step: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor


_PARAM_STATES = (SGDParamState, SGDCountedParamState, SGDCountParamState, SGDNoParamState, AdamParamState,
                 AMSGradParamState)
"""Every per-parameter state holds tensors only, no ``None`` field (a configuration
that keeps no buffer or count has a state without that field), so that plain
``torch.func.vmap`` maps them (as optax's states)."""
_PARAM_STATE_TYPES = set(_PARAM_STATES)


_BUFFER = {SGDParamState: "momentum_buffer", SGDCountedParamState: "momentum_buffer", AdamParamState: "exp_avg",
           AMSGradParamState: "exp_avg"}


@fields_documented
class Optimizer(NamedTuple):
    """A functional optimizer (see the module docstring).

    Attributes:
        init: ``init(params) -> state``: per-parameter states in a tree shaped like ``params``.
        update: ``update(params, grads, state) -> (params, state)``: pure.
        update_: ``update_(params, grads, state) -> state``: steps ``params`` in place.
        config: what it is, its kind and every hyper-parameter (a schedule shown as
            ``<schedule>``), e.g. ``"sgd(lr=0.7, momentum=0.9, ...)"``: what the outer
            optimizer's rank check and checkpoints compare; ``""`` for one built by hand.
        check: ``check(states, params=None, grads=None)`` raises ``ValueError`` where
            a step of parameters with these per-parameter states would (a schedule's
            value at their counts out of range; given the parameters and their
            gradients, aligned with ``states``, also a state or a gradient of another
            shape, or a sparse gradient an optimizer takes none of), stepping nothing:
            what ZeRO runs on every rank before its rank check, so that a rank owning
            nothing learns an owner's refusal instead of waiting for its broadcast.
            ``None``: nothing to check (one built by hand).
        elementwise: each element's step depends on that element's parameter,
            gradient and state only (no norm, no per-tensor statistic), so that a step
            of tensors laid end to end in one buffer equals the step of each: what
            lets DiLoCo step a fragment's global copy as one tensor
            (:mod:`puredist.outer.flat`). ``False`` for one built by hand unless it
            says so.
    """

    init: Callable[[PyTree], PyTree]
    update: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]
    update_: Callable[[PyTree, PyTree, PyTree], PyTree]
    config: str = ""
    check: Callable[..., None] | None = None
    elementwise: bool = False


def config_text(kind: str, **hypers: Any) -> str:
    """``kind(name=value, ...)``, a schedule shown as ``<schedule>`` (a function's repr
    differs between processes; its values are checked where they are used)."""
    return f"{kind}(" + ", ".join(f"{k}={'<schedule>' if callable(v) else v!r}" for k, v in hypers.items()) + ")"


def copies(tensors: Sequence[torch.Tensor], *, recorded: bool = False) -> list[torch.Tensor]:
    """Fresh copies of ``tensors`` (values, bits and strides): one multi-tensor kernel
    on a GPU, where a clone per tensor would cost a launch and the host's time for
    each. ``recorded``: clones that autograd and ``torch.func`` transforms record."""
    if recorded:
        return [t.clone() for t in tensors]
    with torch.no_grad():
        if len(tensors) > 1 and all(t.is_cuda for t in tensors):
            return list(torch._foreach_mul(tensors, 1))  # x * 1 is x exactly: -0.0, inf and subnormals too
        return [t.clone() for t in tensors]


def clone_states(states: Sequence[NamedTuple], *, recorded: bool = False) -> list[NamedTuple]:
    """Copies of per-parameter states (NamedTuples of one kind), field by field
    (``recorded``: as for :func:`copies`)."""
    if not states or not states[0]._fields:
        return list(states)  # (a state with no field holds nothing to copy)
    columns = []
    for column in zip(*states):
        if not any_none(column):
            columns.append(copies(column, recorded=recorded))
        elif all(map(operator.is_, column, repeat(None))):
            columns.append(column)
        else:
            columns.append([None if t is None else t.clone() for t in column])
    return rows_of(type(states[0]), *columns)
