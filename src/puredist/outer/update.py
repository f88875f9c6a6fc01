"""One step of an outer-optimization transform, run after inner step ``count =
state.step + 1``: the synchronizations due start, those whose delay is over are
applied, and a lower level due averages the idle fragments.

:func:`update_` runs in place; :func:`update` is its pure twin (it works on copies,
or, under ``torch.func`` transforms and ``torch.compile``, runs the same step on the
out-of-place storage: :func:`traced_update`). Both are :func:`_step` over a
:class:`~puredist.outer.storage.base.Storage`. When each fragment synchronizes is
:mod:`puredist.outer.timeline`'s, one synchronization :mod:`puredist.outer.sync`'s.

This module must not compute a synchronization itself: it orders those of
:mod:`puredist.outer.sync` by the timeline.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from puredist._transforms import is_transformed, transforms_active
from puredist._validation import check_all
from puredist.averaging import _float_leaves
from puredist.collectives import Collective, CollectiveError, refusing
from puredist.optim import clone_states
from puredist.outer import sync
from puredist.outer.checks import (
    check_collective, check_initial_copy, check_params, check_state, initial_check_context,
)
from puredist.outer.config import OuterConfig
from puredist.outer.fragments import fragment_leaves
from puredist.outer.state import OuterState
from puredist.outer.storage import Fragment, Storage, storage_for, traced_storage
from puredist.outer.timeline import due_fragments, lower_level_fragments, outer_step_fragments
from puredist.tree import PyTree, clone_leaves, tree_leaves, tree_unflatten


class _LowerContext(NamedTuple):
    """The rank-check context of a lower level's averaging, formatted only when
    checked (under ``torch.compile`` the step may be symbolic: no string is built)."""

    config: OuterConfig
    count: int

    def __str__(self) -> str:
        return f"{self.config} lower level after inner step {self.count}"


def _leaves_and_fragments(config: OuterConfig, params: PyTree, state: OuterState, collective: Collective, *, traced: bool):
    """``(leaves, treespec, leaf indices per fragment)`` of ``params``, once the inputs
    passed :mod:`puredist.outer.checks` (at step 0, the initial copy's too). Where
    this rank's inputs fail, its refusal first goes through the rank check its peers
    run first in this step (see :func:`_first_check`), so that they raise
    :class:`~puredist.RankMismatchError` naming it instead of waiting for this rank
    until the backend's timeout; then the error found here is raised."""
    with _refusing_step(config, state, collective):
        leaves, spec = _float_leaves(params, in_place=not traced)
        check_params(config, leaves, state)
        fragments = fragment_leaves(config, leaves)
        check_collective(config, collective)
    if state.step == 0:
        check_initial_copy(config, state, collective)
    return leaves, spec, fragments


def _refusing_step(config: OuterConfig, state: OuterState, collective: Collective):
    """:class:`~puredist.collectives.base.refusing` the step at ``state``'s step through
    the rank check its peers run first in it (:func:`_first_check`); telling no one
    where the step communicates nothing."""
    first = _first_check(config, state)
    if first is None:
        return contextlib.nullcontext()
    return refusing(collective, group_size=first[0], context=first[1])


def _first_check(config: OuterConfig, state: OuterState) -> tuple[int | None, object] | None:
    """``(group size, context)`` of the first rank check that :func:`update_` runs at
    ``state``'s step on a rank whose inputs pass (``None``: the step communicates
    nothing), in its order: the initial copy's check, a failed synchronization issued
    again, the first one due, the lower level."""
    if state.step == 0:
        return None, initial_check_context(config)
    for item in state.in_flight:
        if item.handle.error is not None:
            return None, sync.SyncContext(config, item.fragment, item.started)
    count = state.step + 1
    due = due_fragments(config, count)
    if due:
        return None, sync.SyncContext(config, due[0], count)
    waiting = {item.fragment for item in state.in_flight if item.started + config.delay != count}
    level, idle = lower_level_fragments(config, count, waiting)
    if level is not None and idle:  # (every fragment holds a leaf)
        return config.lower_sizes[level], _LowerContext(config, count)
    return None


def _check_outer_steps(config: OuterConfig, state: OuterState, fragments) -> None:
    """Raise ``ValueError`` before anything is communicated where the outer optimizer
    would refuse a step applied after this step's inner step (a schedule's value out
    of range, :attr:`~puredist.Optimizer.check`): the fragments whose synchronization
    applied now takes an outer step (:func:`~puredist.outer.timeline.outer_step_fragments`)."""
    check_all(config.outer.check, ([state.outer_state[i] for i in fragments[f]]
                                   for f in outer_step_fragments(config, state.step + 1)))


def update_(config: OuterConfig, params: PyTree, state: OuterState, *, collective: Collective) -> OuterState:
    """In place (see :class:`~puredist.OuterTransform`). Raises before applying
    anything if a synchronization fails: the state passed in stays valid and
    un-applied (a failed synchronization in it is issued again, on ``collective``, by
    the next ``update_`` with it). If the lower-level averaging fails after the outer
    step was applied, the :class:`~puredist.CollectiveError` carries the state to
    continue from (``error.state``)."""
    check_state(config, state)
    return _stepped_(config, params, state, collective)


def _stepped_(config: OuterConfig, params: PyTree, state: OuterState, collective: Collective) -> OuterState:
    """:func:`update_` of a state known to be an :class:`OuterState` (:func:`update`
    checked it, or built it)."""
    leaves, _, fragments = _leaves_and_fragments(config, params, state, collective, traced=False)
    return _step(config, storage_for(config, leaves, collective), leaves, fragments, state, collective)[1]


def _step(config: OuterConfig, storage: Storage, leaves: list, fragments, state: OuterState,
          collective: Collective) -> tuple[list, OuterState]:
    """``(new leaves, new state)`` after one step on checked inputs (in place: the
    leaves given, written; traced: new ones)."""
    count = state.step + 1
    _check_outer_steps(config, state, fragments)  # (a compressed synchronization changes the residuals it sends)
    in_flight = [sync.issue_again(config, item, collective) if item.handle.error is not None else item
                 for item in state.in_flight]
    applying = [item for item in in_flight if item.started + config.delay == count]
    waiting = [item for item in in_flight if item.started + config.delay != count]
    for item in applying:  # before anything starts: a failure leaves every synchronization as given, or failed
        if not item.handle.is_completed():  # (a completed one has nothing to wait for; traced: all)
            item.handle.wait()
    globals_, states, residuals = list(state.global_params), list(state.outer_state), list(state.residuals)
    new_leaves = list(leaves)

    def fragment(f: int) -> Fragment:
        indices = fragments[f]
        return Fragment(f, [new_leaves[i] for i in indices], [globals_[i] for i in indices],
                        [states[i] for i in indices], [residuals[i] for i in indices] if residuals else [])

    due = due_fragments(config, count)
    for f in due:  # (without a delay each completes here, and is applied now)
        item, left = sync.start(config, storage, fragment(f), count, collective)
        (waiting if config.delay else applying).append(item)
        for i, residual in zip(fragments[f], left):
            residuals[i] = residual
    for item in applying:
        done = sync.apply(config, storage, fragment(item.fragment), item)
        for k, i in enumerate(fragments[item.fragment]):
            new_leaves[i], globals_[i], states[i] = done.locals[k], done.globals[k], done.states[k]
    new_state = OuterState(count, tuple(globals_), tuple(states), tuple(waiting), tuple(residuals))
    level, idle = lower_level_fragments(config, count, set(due) | {item.fragment for item in waiting})
    idle_leaves = [i for f in idle for i in fragments[f]]
    if level is not None and idle_leaves:
        try:
            means = storage.mean_within([new_leaves[i] for i in idle_leaves], collective,
                                        group_size=config.lower_sizes[level], context=_LowerContext(config, count))
        except CollectiveError as error:
            error.state = new_state  # the outer step was applied: continue from this state
            raise
        for i, mean in zip(idle_leaves, means):
            new_leaves[i] = mean
    return new_leaves, new_state


def update(config: OuterConfig, params: PyTree, state: OuterState, *, collective: Collective) -> tuple[PyTree, OuterState]:
    """Pure: first completes the input state's collectives in flight (their buffers
    belong to the collective until then), then works on copies. Under ``torch.func``
    transforms (``vmap`` with a :class:`~puredist.VmapCollective`, ``grad``) it runs
    out of place (differentiably without a compressor), for ``delay=0``, and so it
    does under ``torch.compile`` (a delayed step takes the in-place path on copies
    there, as eagerly). The state keeps its structure from ``init``
    on, so one vmapped step serves every step, step 0 included: with ``axes =
    puredist.tree.vmap_axes(transform.init(params_of_one_replica))`` (the step, a
    Python int, unmapped), ``state = vmap(transform.init, out_dims=axes)(stacked)``
    and ``vmap(step, in_dims=(0, axes), out_dims=(0, axes))``. If the lower-level
    averaging fails after the outer step was applied, the
    :class:`~puredist.CollectiveError` carries the new parameters with the new state
    (``error.params``, ``error.state``: to continue from together; the inputs are
    unchanged).

    Raises:
        TypeError: ``state`` is not an :class:`~puredist.OuterState` (another transform's).
    """
    check_state(config, state)
    if transforms_active() and any(map(is_transformed, (*tree_leaves(params), *state.global_params))):
        return traced_update(config, params, state, collective)
    if torch.compiler.is_compiling() and not (config.delay or state.in_flight):
        return traced_update(config, params, state, collective)  # (delayed: the copies' path below)
    for item in state.in_flight:
        if item.handle.error is None:  # a failed one is issued again by update_
            item.handle.wait()
    with _refusing_step(config, state, collective):
        leaves, spec = _float_leaves(params, in_place=True)
    copies = clone_leaves(leaves)
    cloned = OuterState(
        state.step,
        tuple(torch.empty_like(t, pin_memory=t.is_pinned()).copy_(t) for t in state.global_params),  # stays pinned
        tuple(clone_states(state.outer_state)),
        tuple(
            item._replace(
                pseudo_grads=tuple(t.clone() for t in item.pseudo_grads),
                snapshot=tuple(t.clone() for t in item.snapshot),
            )
            for item in state.in_flight
        ),
        tuple(t.clone() for t in state.residuals),
    )
    try:
        return tree_unflatten(spec, copies), _stepped_(config, copies, cloned, collective)
    except CollectiveError as error:
        if getattr(error, "state", None) is not None:  # the global copy was written into the copies
            error.params = tree_unflatten(spec, copies)
        raise


def traced_update(config: OuterConfig, params: PyTree, state: OuterState, collective: Collective) -> tuple[PyTree, OuterState]:
    """:func:`update` under ``torch.func`` transforms and ``torch.compile``: the same
    step, on the out-of-place storage (:mod:`puredist.outer.storage.traced`), for
    synchronous synchronizations; differentiable without a compressor (its payloads
    are not).

    Raises:
        NotImplementedError: a delay, or synchronizations in flight.
    """
    if config.delay or state.in_flight:
        raise NotImplementedError(
            config.explain(
                "Under torch.func transforms the outer update runs synchronous synchronizations only (delay=0): a "
                "delayed one is carried in the state by handles and snapshots that no transform can map."
            )
        )
    leaves, spec, fragments = _leaves_and_fragments(config, params, state, collective, traced=True)
    new_leaves, new_state = _step(config, traced_storage(config, collective), leaves, fragments, state, collective)
    return tree_unflatten(spec, new_leaves), new_state
