"""The factory the built-in optimizers share: from an algorithm's per-parameter
``init_leaf`` and its in-place ``step``, the :class:`~puredist.optim.base.Optimizer`'s
``init``, pure ``update``, in-place ``update_`` and ``check`` (trees flattened, ``None``
gradients skipped, states and gradients checked, the step recorded where it must be).

This module must not know any algorithm.
"""

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import torch

from puredist._inputs import check_fits, check_state_count
from puredist._validation import check_hypers
from puredist.optim._checks import check_hyper, shaped_field
from puredist.optim._kernels import step_recorded
from puredist.optim.base import Optimizer, clone_states, config_text, copies, declaration, is_param_state
from puredist.optim.hyperparameters import Hyper, Step, with_schedules
from puredist.tree import PyTree, tree_flatten, tree_unflatten


def _per_leaf(spec, state: PyTree, count: int) -> list[NamedTuple]:
    """``state``'s per-parameter states in leaf order. ``state`` is shaped like the
    params tree (as ``init`` returns it) or, as ZeRO and the outer optimizer pass
    their sub-lists, a flat sequence of per-parameter states (told apart by type, with
    no exception on the way: this runs at every step)."""
    flat = isinstance(state, (tuple, list)) and not is_param_state(state)
    if flat and all(map(declaration, set(map(type, state)))):
        states = list(state)
    else:
        try:
            states = spec.flatten_up_to(state)
        except (ValueError, TypeError) as error:
            raise ValueError(
                f"Arg ``state`` must be shaped like ``params`` ({count} parameters, structure {spec}), as init "
                f"returns it; got a {type(state).__name__} that is not."
            ) from error
    check_state_count(states, count, declaration)
    return states


PureStep = Callable[[list[torch.Tensor], list[torch.Tensor], list[NamedTuple]], tuple[list, list] | None]
"""``pure_step(params, grads, states) -> (new params, new states)`` computed into new
tensors, the inputs untouched, or ``None`` where it does not apply (then the pure
``update`` copies and steps the copies in place)."""


def make_optimizer(
    state_type: type, init_leaf: Callable[[torch.Tensor], NamedTuple], run: Callable[..., list[NamedTuple]], *,
    hypers: dict[str, Hyper] | None = None, kind: str = "", config: str | None = None,
    validate: Callable[[str, Any], None] = check_hyper, differentiable: bool = False,
    check: Callable[[list, bool], None] | None = None, pure_step: PureStep | None = None, writes_grads: bool = False,
    takes_sparse: bool = True,
) -> Optimizer:
    """The :class:`~puredist.optim.base.Optimizer` of an algorithm, ``init``,
    ``update``, ``update_`` and ``check`` made from its parts: what SGD and Adam are
    built with, and the way to add an optimizer.

    Args:
        state_type: the per-parameter state ``init_leaf`` makes, declared with
            :func:`~puredist.optim.base.param_state` (its declaration gives the
            optimizer's ``elementwise`` and what ZeRO, DiLoCo, ``vmap`` and the checks
            read of its fields).
        init_leaf: ``init_leaf(param) -> state`` of one parameter.
        run: ``run(params, grads, states, traced, **values) -> states`` steps the
            parameters (lists, each with a gradient) and their states' tensors in
            place, with ``values`` the hyper-parameters' values (a schedule's at the
            states' count); ``traced``: the step is recorded (autograd, ``torch.func``).
        hypers: the hyper-parameters, numbers or schedules of the count (the state
            then declares a :data:`~puredist.optim.base.Count`), each
            value passed to ``validate(name, value)`` (default: ``betas`` two numbers in
            ``[0, 1)``, the others non-negative numbers) before
            anything is stepped.
        kind: its name; ``config``: its :attr:`~puredist.optim.base.Optimizer.config`
            (default: ``kind(hyper=value, ...)``).
        differentiable: ``update`` records its step for autograd.
        check, pure_step, writes_grads, takes_sparse: for torch's kernels:
            ``check(params, traced)`` raises before anything is stepped;
            ``pure_step(params, grads, states)`` is an out-of-place step (or ``None``
            where it does not apply); ``writes_grads``: the kernel may write into the
            gradients (the pure update steps copies); ``takes_sparse``: sparse
            gradients are stepped (else refused).

    Raises:
        TypeError: ``state_type`` was not declared with ``param_state``.
        ValueError: ``validate`` refuses a hyper-parameter that is not a schedule.
    """
    declared = declaration(state_type)
    if declared is None:
        raise TypeError(
            f"Arg ``state_type`` ({state_type!r}) must be declared with @puredist.optim.param_state(elementwise=...)."
        )
    hypers = dict(hypers or {})
    check_hypers(hypers, scheduled=list(hypers), validate=validate)  # (a schedule's values: at the update)
    config = config_text(kind, **hypers) if config is None else config
    step, check_states = with_schedules(hypers, run, check or _nothing_to_check, validate)
    built = _Built(init_leaf, step, check_states, differentiable, config.split("(")[0] or "this optimizer",
                   pure_step, writes_grads, takes_sparse)
    return Optimizer(built.init, built.update, built.update_, config, built.check, elementwise=declared.elementwise)


def _nothing_to_check(params: list, traced: bool) -> None:
    """An algorithm's ``check`` where torch's kernels refuse nothing more."""


@dataclasses.dataclass(frozen=True)
class _Built:
    """An algorithm's parts (see :func:`make_optimizer`), bound into the optimizer's
    functions: its methods are the :class:`~puredist.optim.base.Optimizer`'s."""

    init_leaf: Callable
    step: Step
    check_states: Callable[[Sequence[NamedTuple]], None]
    differentiable: bool
    kind: str
    pure_step: PureStep | None
    writes_grads: bool
    takes_sparse: bool

    def init(self, params: PyTree) -> PyTree:
        """A fresh per-parameter state for each leaf of ``params``, in a tree shaped
        like ``params`` (``{"w": w}`` gives ``{"w": state of w}``)."""
        leaves, spec = tree_flatten(params)
        return tree_unflatten(spec, [self.init_leaf(p) for p in leaves])

    def stepped(self, leaves: list, grad_leaves: list, state: list, traced: bool) -> list:
        """Step ``leaves`` in place with ``step`` (a ``None`` grad skips its parameter and
        keeps its state); return the new per-parameter states."""
        active = [i for i, g in enumerate(grad_leaves) if g is not None]
        new_state = list(state)
        new = self.step([leaves[i] for i in active], [grad_leaves[i] for i in active], [state[i] for i in active],
                        traced)
        for i, s in zip(active, new):
            new_state[i] = s
        return new_state

    def _flat_inputs(self, params: PyTree, grads: PyTree, state: PyTree) -> tuple[list, Any, list, list[NamedTuple]]:
        """``(leaves, spec, grad leaves, per-parameter states)`` of a step's inputs,
        once the states and gradients are known to fit the parameters (before
        anything is stepped)."""
        leaves, spec = tree_flatten(params)
        states = _per_leaf(spec, state, len(leaves))
        grad_leaves = spec.flatten_up_to(grads)
        check_fits(leaves, states, grad_leaves, shaped_field=shaped_field, name=self.kind,
                   takes_sparse=self.takes_sparse)
        return leaves, spec, grad_leaves, states

    def update_(self, params: PyTree, grads: PyTree, state: PyTree) -> PyTree:
        """Step ``params`` in place (a ``None`` grad skips its parameter); return the
        new state, shaped like ``params``."""
        leaves, spec, grad_leaves, states = self._flat_inputs(params, grads, state)
        return tree_unflatten(spec, self.stepped_in_place(leaves, grad_leaves, states))

    def stepped_in_place(self, leaves: list, grad_leaves: list, states: list) -> list:
        with torch.no_grad():  # as torch.optim steps its parameters (no detached views made)
            return self.stepped(leaves, grad_leaves, states, False)

    def update(self, params: PyTree, grads: PyTree, state: PyTree) -> tuple[PyTree, PyTree]:
        """Pure: ``(new params, new state)``; the inputs are not modified; the new
        parameters are fresh tensors (leaves, ``requires_grad`` kept). Under
        ``torch.func`` transforms (``vmap`` over stacked params, grads and states;
        ``grad``), and with autograd for an optimizer built ``differentiable=True``,
        the step is recorded instead: torch's single-tensor kernels in their
        differentiable form (equal to the eager step up to rounding: the step count's
        powers are taken in its dtype: about 1e-5 of ``lr`` for Adam's default betas)."""
        leaves, spec, grad_leaves, states = self._flat_inputs(params, grads, state)
        traced = step_recorded(
            lambda: [*leaves, *(g for g in grad_leaves if g is not None),
                     *(t for s in states for t in s if isinstance(t, torch.Tensor))],
            self.differentiable,
        )
        if not traced and self.pure_step is not None:
            stepped_out_of_place = self.pure_step(leaves, grad_leaves, states)
            if stepped_out_of_place is not None:
                new, new_states = stepped_out_of_place
                _keep_requires_grad(new, leaves)
                return tree_unflatten(spec, new), tree_unflatten(spec, new_states)
        cloned = clone_states(states, recorded=traced)  # the inputs' state tensors are never handed out
        if self.writes_grads and not traced:  # nothing passed in is written, the gradients included
            grad_leaves = [None if g is None else g.detach().clone() for g in grad_leaves]
        if not traced:
            new = copies(leaves)
            _keep_requires_grad(new, leaves)
            return tree_unflatten(spec, new), tree_unflatten(spec, self.stepped_in_place(new, grad_leaves, cloned))
        new = copies(leaves, recorded=True)  # the update is differentiable
        return tree_unflatten(spec, new), tree_unflatten(spec, self.stepped(new, grad_leaves, cloned, True))

    def check(self, states: Sequence[NamedTuple], params: Sequence[torch.Tensor] | None = None,
              grads: Sequence[torch.Tensor] | None = None) -> None:
        """Raise ``ValueError``, stepping nothing, where a step of parameters with these
        per-parameter states (and, given, these parameters and gradients) would
        (see :attr:`Optimizer.check`)."""
        check_fits(params, states, grads, shaped_field=shaped_field, name=self.kind, takes_sparse=self.takes_sparse)
        self.check_states(states)


def _keep_requires_grad(new: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor]) -> None:
    """The new parameters require grad where the old ones do (fresh leaves)."""
    for copy, leaf in zip(new, leaves):
        if leaf.requires_grad:
            copy.requires_grad_()
