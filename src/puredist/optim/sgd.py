"""SGD, as ``torch.optim.SGD`` (same arguments and math, torch's own kernels).

This module must not communicate.
"""

import dataclasses
import operator
from itertools import repeat
from typing import Annotated, NamedTuple

import torch
from torch.optim.sgd import sgd as _sgd_kernel

from puredist._docs import fields_documented
from puredist._seq import any_none, rows_of
from puredist._validation import Rule, check, check_hypers
from puredist.optim._checks import ONE_KERNEL, check_fused_takes, check_hyper, counts_of
from puredist.optim._factory import make_optimizer
from puredist.optim._kernels import grads_for, steps_out_of_place
from puredist.optim._out_of_place import sgd_foreach
from puredist.optim.base import Count, FieldKind, Optimizer, config_text, param_state
from puredist.optim.hyperparameters import Hyper, read_counts


@param_state(elementwise=True)
@fields_documented
class SGDParamState(NamedTuple):
    """SGD state of one parameter, with momentum (torch's layout).

    Attributes:
        momentum_buffer: the momentum buffer: zeros (``-0.0``) from ``init`` (the first
            step then makes it the gradient, as torch's first step does). ``None`` is
            taken as input (a state from before torch's first step) and never returned.
    """

    momentum_buffer: Annotated[torch.Tensor | None, FieldKind.SHAPED]


@param_state(elementwise=True)
@fields_documented
class SGDCountedParamState(NamedTuple):
    """SGD state of one parameter, with momentum and a step count: with a schedule or
    dampened momentum (the count tells the first step, which takes the gradient
    undamped).

    Attributes:
        momentum_buffer: as :class:`SGDParamState`'s.
        step: the updates taken, a 0-dim float32 CPU tensor (as Adam's).
    """

    momentum_buffer: Annotated[torch.Tensor | None, FieldKind.SHAPED]
    step: Count


@param_state(elementwise=True)
@fields_documented
class SGDCountParamState(NamedTuple):
    """SGD state of one parameter without momentum, with a schedule.

    Attributes:
        step: the updates taken, a 0-dim float32 CPU tensor.
    """

    step: Count


@param_state(elementwise=True)
class SGDNoParamState(NamedTuple):
    """SGD state of one parameter without momentum or schedule: nothing (as optax's
    ``EmptyState``)."""


def _sgd_state_type(has_buffer: bool, counted: bool) -> type:
    """The SGD state type holding what it has (no ``None`` field)."""
    if has_buffer:
        return SGDCountedParamState if counted else SGDParamState
    return SGDCountParamState if counted else SGDNoParamState


def _sgd_state(buffer: torch.Tensor | None, count: torch.Tensor | None) -> NamedTuple:
    """The SGD state of one parameter holding what it has (no ``None`` field)."""
    return _sgd_state_type(buffer is not None, count is not None)(*(t for t in (buffer, count) if t is not None))


_NESTEROV = Rule(  # (torch.optim.SGD's message)
    lambda v, b: not v or ((callable(b["momentum"]) or b["momentum"] > 0) and b["dampening"] == 0), ValueError,
    "Nesterov momentum requires a momentum and zero dampening")
"""``nesterov``'s rule, given ``momentum`` (a value or a schedule) and ``dampening``."""

_UNDAMPED_SCHEDULE = Rule(
    lambda v, b: not (callable(b["momentum"]) and v), ValueError,
    "Args ``momentum`` (a schedule) and ``{arg}`` ({value}): torch's first momentum step takes the gradient "
    "undamped, which a rate that starts later cannot follow; schedule momentum without dampening.")
"""``dampening``'s rule, given ``momentum``: none where momentum is a schedule."""


def sgd(
    lr: float = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
    differentiable: bool = False,
) -> Optimizer:
    """Stochastic gradient descent, as ``torch.optim.SGD`` (same arguments and math;
    ``foreach``/``fused`` pick torch's kernel as the class does, ``None`` = torch's
    default; ``fused=True`` runs torch's fused kernel, on CPU or CUDA;
    ``differentiable=True``: ``update`` records its step for autograd, as under
    ``torch.func`` transforms).

    ``lr``, ``weight_decay`` and ``momentum`` may be schedules, ``lr(count) -> rate``
    (see :mod:`puredist.optim`); a momentum schedule takes no dampening.

    Raises:
        ValueError: a negative ``lr``, ``momentum`` or ``weight_decay`` (a schedule's
            value: at the update, before anything is stepped); ``nesterov`` without
            momentum or with dampening; a momentum schedule with dampening; ``fused``
            and ``foreach`` both True.
    """
    check_hypers(dict(lr=lr, momentum=momentum, weight_decay=weight_decay), scheduled=("lr", "momentum", "weight_decay"),
                 validate=check_hyper)
    check("foreach", foreach, ONE_KERNEL, fused=fused)
    check("nesterov", nesterov, _NESTEROV, momentum=momentum, dampening=dampening)
    check("dampening", dampening, _UNDAMPED_SCHEDULE, momentum=momentum)
    options = _SGD(lr, momentum, dampening, weight_decay, nesterov, maximize, foreach, fused)
    config = config_text("sgd", lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov, maximize=maximize, foreach=foreach, fused=fused)
    return make_optimizer(
        _sgd_state_type(options.has_momentum, options.counted), options.init_leaf, options.run,
        hypers={"lr": lr, "weight_decay": weight_decay, "momentum": momentum}, config=config,
        differentiable=differentiable,
        check=lambda params, traced: check_fused_takes(params, fused and not traced, "sgd"),
        pure_step=options.pure_step, writes_grads=nesterov,
    )


@dataclasses.dataclass(frozen=True)
class _SGD:
    """:func:`sgd`'s options (checked), its methods the algorithm's parts that
    :func:`~puredist.optim._factory.make_optimizer` takes. ``lr``, ``momentum`` and
    ``weight_decay`` are as given (numbers or schedules); ``run`` gets their values."""

    lr: Hyper
    momentum: Hyper
    dampening: float
    weight_decay: Hyper
    nesterov: bool
    maximize: bool
    foreach: bool | None
    fused: bool | None

    @property
    def has_momentum(self) -> bool:
        return callable(self.momentum) or self.momentum > 0

    @property
    def counted(self) -> bool:
        """Whether the state counts steps: for a schedule, or dampened momentum's first step."""
        return bool(callable(self.lr) or callable(self.weight_decay) or callable(self.momentum) or (
            self.momentum and self.dampening))

    def init_leaf(self, p: torch.Tensor) -> NamedTuple:
        count = torch.zeros((), dtype=torch.float32) if self.counted else None
        # a zero buffer steps exactly as torch's first step (buf = grad): -0.0 * momentum + grad is grad,
        # signed zeros included (-0.0 is the additive identity; +0.0 would turn a -0.0 gradient into +0.0);
        # with dampening the first step starts from the gradient instead (see run)
        buffer = torch.full_like(p, -0.0, memory_format=torch.preserve_format) if self.has_momentum else None
        return _sgd_state(buffer, count)

    def recorded_step(self, params, grads, states, lr, weight_decay, momentum) -> list[NamedTuple]:
        """torch's single-tensor SGD step, recorded (``torch.func`` transforms, autograd,
        ``torch.compile``): ``params`` (recorded copies) stepped in place, the new
        states returned. Every ``add`` with a scale is written as a ``sub`` (the same
        bits eagerly: ATen's ``sub`` is ``add`` with ``-alpha``): inductor (torch 2.13,
        CPU) drops ``add``'s ``alpha`` after a matmul, a gradient's last op, in a graph
        that takes ``torch.func.grad`` (plain SGD: 13.0 off after three steps). The
        first momentum step takes the gradient (torch's ``buf = grad``, without its
        ``detach``, which would cut the gradient through the buffer); dampened
        momentum tells it by the count on the device, so that a mapped count works."""
        if momentum and self.dampening:
            counts_of(states, "SGD with dampening knows its first step by the count")
        new_states = []
        for param, grad, state in zip(params, grads, states):
            grad = grad.neg() if self.maximize else grad
            if weight_decay:
                grad = grad.sub(param, alpha=-weight_decay)
            buffer, count = getattr(state, "momentum_buffer", None), getattr(state, "step", None)
            if momentum:
                if buffer is None:
                    buffer = grad.clone()
                elif self.dampening:
                    buffer = torch.where(count == 0, grad, buffer.mul(momentum).sub(grad, alpha=self.dampening - 1))
                else:
                    buffer = buffer.mul(momentum).add(grad)  # (torch's alpha 1 - dampening is 1)
                grad = grad.sub(buffer, alpha=-momentum) if self.nesterov else buffer
            param.sub_(grad, alpha=lr)
            if count is not None:
                count.add_(1)  # (the state's copy)
            new_states.append(_sgd_state(buffer, count))
        return new_states

    def run(self, params, grads, states, traced, lr, weight_decay, momentum):
        """Step in place with these values of the hyper-parameters; the new states."""
        if traced:
            return self.recorded_step(params, grads, states, lr, weight_decay, momentum)
        buffers = [getattr(s, "momentum_buffer", None) for s in states]  # (the kernel fills in those it creates)
        if momentum and self.dampening:  # torch's first step copies the gradient undamped: a fresh buffer starts there
            counts = read_counts(states, "SGD with dampening knows its first step by the count")
            buffers = [None if count == 0 else buffer for buffer, count in zip(buffers, counts)]
        _sgd_kernel(params, grads_for(self.fused, params, grads), buffers, foreach=self.foreach,
                    fused=self.fused, weight_decay=weight_decay, momentum=momentum, lr=lr,
                    dampening=self.dampening, nesterov=self.nesterov, maximize=self.maximize)
        counts = [getattr(s, "step", None) for s in states]
        for count in counts:  # scheduled: one more update taken (in place, as Adam's kernel counts)
            if count is not None:
                count.add_(1)
        old = [getattr(s, "momentum_buffer", None) for s in states]
        if not self.has_momentum or all(map(operator.is_, buffers, old)):
            return list(states)  # every buffer was stepped in place (the usual case: no new state to build)
        return [_sgd_state(b, count) for b, count in zip(buffers, counts)]

    def pure_step(self, params, grads, states):
        """torch's multi-tensor step into new tensors (:mod:`puredist.optim._out_of_place`),
        where torch would run that kernel eagerly on fp32/fp64 tensors and dense
        gradients, every parameter has a gradient, nothing is dampened or scheduled
        (no counts) and every momentum buffer exists; ``None`` elsewhere."""
        lr, momentum, weight_decay = self.lr, self.momentum, self.weight_decay
        if self.dampening or not steps_out_of_place(params, grads, self.foreach, self.fused, lr, weight_decay,
                                                    momentum):
            return None
        if not self.has_momentum:
            return sgd_foreach(params, grads, None, lr=lr, momentum=0.0, weight_decay=weight_decay,
                               nesterov=self.nesterov, maximize=self.maximize)[0], list(states)
        buffers = list(map(getattr, states, repeat("momentum_buffer"), repeat(None)))
        if any_none(buffers):
            return None
        new_params, new_buffers = sgd_foreach(params, grads, buffers, lr=lr, momentum=momentum,
                                              weight_decay=weight_decay, nesterov=self.nesterov,
                                              maximize=self.maximize)
        return new_params, rows_of(SGDParamState, new_buffers)
