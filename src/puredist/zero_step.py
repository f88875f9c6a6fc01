"""ZeRO stage 1 as pure functions: sharded optimizer state over an explicit plan.

Every rank holds the optimizer state of the parameters it owns only (per the
:class:`~puredist.zero_plan.ZeroPlan`), steps them with the (already averaged)
gradients, and the owners broadcast the new values. Built by :func:`zero` from any
functional :class:`~puredist.optim.Optimizer`:

- ``init(params, *, plan, rank) -> ZeroState``: optimizer state for ``rank``'s share;
- ``update_(params, grads, state, *, collective) -> state``: one whole iteration in
  place (step the owned parameters, broadcast from every owner, ``step + 1``);
- ``update(params, grads, state, *, collective) -> (params, state)``: the same,
  pure: new tensors, inputs untouched;
- ``update_subset_(params, grads, state, *, indices, collective) -> (state, handle)``:
  step only the parameters at ``indices`` (one DDP bucket) and start their
  broadcasts; the handle completes them. Does not advance ``step`` — call
  ``end_iteration(state)`` once all buckets are done.

Every collective is issued by the calling thread, in an order fixed by the plan
(owner by owner, in bucket order), so the same code is safe on Gloo and NCCL. Before
anything is updated, ``update_`` checks that every rank has the same plan and the same
parameter layout, and raises :class:`~puredist.RankMismatchError` on every rank if not.

With a :class:`~puredist.SimulatedCollective` of ``R`` replicas, one process runs every
rank at once, for property tests: every leaf is stacked ``[R, *shape]`` (row ``r`` is
rank ``r``'s), ``init(params, plan=plan, rank=None)`` holds the state of every
parameter (shaped like one row), and a step updates each parameter's row of its owner
with that row's gradient, then copies it to every row (the owner's broadcast).

Under ``torch.func.vmap`` with a :class:`~puredist.VmapCollective`, the pure ``update``
runs the same step from one replica's view: every replica steps every parameter with
its own gradient (the state of every parameter, ``rank=None``, mapped), then takes the
owner's new value and state (:meth:`~puredist.VmapCollective.broadcast`). It is a
simulation: nothing is sharded in memory.

This module must not average gradients: they come in already averaged (by DDP or
:func:`~puredist.average_`); it only steps and broadcasts.
"""

from typing import Callable, NamedTuple, Sequence

import torch

from puredist.tree import PyTree, clone_leaves, tree_flatten, tree_unflatten
from puredist.collectives import (
    CollectiveError, CollectiveHandle, DistributedCollective, SimulatedCollective, refusing,
)
from puredist.collectives.vmap import VmapCollective
from puredist._consistency import refusals, with_refusal
from puredist.errors import RankMismatchError
from puredist.optim import Optimizer, clone_states
from puredist.zero_plan import ZeroPlan
from puredist._bound import bound
from puredist._docs import fields_documented
from puredist._validation import BELOW, HOLDS, INSTANCE, check

__all__ = [
    "Zero", "ZeroState", "zero", "init", "update_", "update", "update_subset_", "end_iteration", "mapped_update",
    "broadcast_from_owners_", "wait_for_owners",
]


@fields_documented
class ZeroState(NamedTuple):
    """State of a ZeRO-sharded optimizer on one rank.

    Attributes:
        step: completed iterations.
        plan: the ownership plan (the same on every rank).
        owned: per-parameter optimizer states of the parameters this rank owns,
            aligned with ``plan.owned_by(rank)``; nothing for the others. Simulated
            (``rank=None`` at ``init``): the states of every parameter, in leaf order.
    """

    step: int
    plan: ZeroPlan
    owned: tuple


@fields_documented
class Zero(NamedTuple):
    """A ZeRO-sharded optimizer (see the module docstring).

    Attributes:
        init: ``init(params, *, plan, rank) -> ZeroState``: the state of ``rank``'s
            share (``rank=None``: every rank's, simulated).
        update: ``update(params, grads, state, *, collective) -> (params, state)``: pure
            (under ``vmap`` with a ``VmapCollective``).
        update_: ``update_(params, grads, state, *, collective) -> state``: one whole
            iteration in place, after the rank check.
        update_subset_: ``update_subset_(params, grads, state, *, indices, collective)
            -> (state, handle)``: step the owned parameters among ``indices`` and start
            their broadcasts (what the DDP hooks run per bucket).
        end_iteration: ``end_iteration(state) -> state``: the step count + 1, after
            every bucket of an iteration.
    """

    init: Callable[..., ZeroState]
    update: Callable[..., tuple[PyTree, ZeroState]]
    update_: Callable[..., ZeroState]
    update_subset_: Callable[..., tuple[ZeroState, CollectiveHandle]]
    end_iteration: Callable[[ZeroState], ZeroState]


def broadcast_from_owners_(
    leaves: Sequence[torch.Tensor], indices: Sequence[int], plan: ZeroPlan, collective: DistributedCollective
) -> CollectiveHandle:
    """Start, for each owner in rank order, the broadcast of the parameters at
    ``indices`` it owns; return one handle for all of them."""
    return CollectiveHandle.merged([
        collective.broadcast_(list(map(leaves.__getitem__, mine)), src=owner, async_op=True)
        for owner, mine in plan.by_owner(indices)
    ])


def wait_for_owners(handle: CollectiveHandle, leaves: Sequence[torch.Tensor], indices: Sequence[int], plan: ZeroPlan,
                    rank: int, what: str) -> None:
    """Wait for the owners' broadcasts of the parameters at ``indices`` (this rank's
    own already stepped). Where one fails, nothing was received (the handle writes all
    or nothing), so the error says, per parameter: this rank's own among ``indices``
    hold their stepped values, every other its value from before the step.

    Raises:
        CollectiveError: a broadcast failed; ``completed_elements`` per parameter, as
            just said (a retry would step this rank's parameters again).
    """
    try:
        handle.wait()
    except CollectiveError as error:
        chosen = set(indices)
        totals = [leaf.numel() * (2 if leaf.is_complex() else 1) for leaf in leaves]  # (in real components)
        stepped = [total if i in chosen and plan.owners[i] == rank else 0 for i, total in enumerate(totals)]
        raise CollectiveError(
            f"{what} (its owners' broadcasts)", stepped, totals, error.failed_bucket, error.buckets,
            error.__cause__ or error,
            advice="The parameters that hold the result are this rank's own, stepped here; the others were not "
                   "received, so the ranks now differ: restore the parameters and the optimizer state (a "
                   "checkpoint) before going on. A retry would step this rank's parameters again.",
        ) from error


def init(optimizer: Optimizer, params: PyTree, *, plan: ZeroPlan, rank: int | None) -> ZeroState:
    """The state of ``rank``: optimizer state for the parameters ``plan`` gives it;
    ``rank=None``: of every rank at once, for a :class:`~puredist.SimulatedCollective`
    (``params`` stacked ``[plan.world_size, *shape]``)."""
    leaves, _ = tree_flatten(params)
    plan.check(parameters=len(leaves))
    if rank is None:
        SimulatedCollective(plan.world_size).check_stacked(leaves, arg="params")
        return ZeroState(step=0, plan=plan, owned=tuple(optimizer.init([leaf[0] for leaf in leaves])))
    check("rank", rank, BELOW, stop=plan.world_size, where=" (or None, simulated)")
    owned = tuple(optimizer.init([leaves[i] for i in plan.owned_by(rank)]))
    return ZeroState(step=0, plan=plan, owned=owned)


def _refusal(optimizer: Optimizer, leaves, grad_leaves, state: ZeroState, rank: int) -> str:
    """Why ``optimizer`` would refuse to step this rank's parameters with gradients
    (its :attr:`~puredist.Optimizer.check`: a schedule's value, a gradient's shape or
    sparsity), or ``""``."""
    if optimizer.check is None:
        return ""
    owned = state.plan.owned_by(rank)
    active = [k for k, i in enumerate(owned) if grad_leaves[i] is not None]
    try:
        optimizer.check([state.owned[k] for k in active], [leaves[owned[k]] for k in active],
                        [grad_leaves[owned[k]] for k in active])
    except ValueError as error:  # the refusal itself (the rare path), to be shared with every rank
        return str(error)
    return ""


def _step_owned(optimizer: Optimizer, leaves, grad_leaves, state: ZeroState, indices, rank: int) -> ZeroState:
    """Step the parameters at ``indices`` that ``rank`` owns."""
    position = {index: k for k, index in enumerate(state.plan.owned_by(rank))}
    mine = [i for i in indices if state.plan.owners[i] == rank]
    new = optimizer.update_(
        [leaves[i] for i in mine], [grad_leaves[i] for i in mine],
        tuple(map(state.owned.__getitem__, map(position.__getitem__, mine))),
    )
    owned = list(state.owned)
    for i, s in zip(mine, new):
        owned[position[i]] = s
    return state._replace(owned=tuple(owned))


class _Context(NamedTuple):
    """What the rank check compares besides the tensors: the plan and the step (``""``
    for a state too malformed to say), formatted only when checked or refused."""

    state: ZeroState

    def __str__(self) -> str:
        try:
            return f"plan {self.state.plan.digest()} step {self.state.step}"
        except (AttributeError, TypeError):
            return ""


def _step_inputs(params, grads, state: ZeroState, collective):
    """``(leaves, spec, grad leaves)`` of a step's ``params`` and ``grads``, once they,
    ``state`` and ``collective`` are known to fit one another (each check a one-line
    call; raises before anything is stepped or communicated)."""
    check("collective", collective, INSTANCE, kind=(DistributedCollective, SimulatedCollective),
          a="a DistributedCollective or a SimulatedCollective for a ZeRO step in place (under vmap: the pure update)")
    leaves, spec = tree_flatten(params)
    try:
        grad_leaves = spec.flatten_up_to(grads)
    except ValueError as error:
        raise ValueError(f"Arg ``grads`` must have the structure of ``params`` (None for no gradient): {error}") from None
    state.plan.check("The state's plan", parameters=len(leaves))
    simulated = isinstance(collective, SimulatedCollective)
    _check_state_fits(state, leaves, collective, "a simulated step" if simulated else None)
    if simulated:
        collective.check_stacked(leaves, arg="params")
        collective.check_stacked([g for g in grad_leaves if g is not None], arg="grads")
    return leaves, spec, grad_leaves


def _check_state_fits(state: ZeroState, leaves: list, collective, every: str | None) -> None:
    """Raise ``ValueError`` unless ``state``'s plan shards over the collective's ranks
    and, where one process steps every rank (``every`` says how: simulated, under
    ``vmap``), the state holds every parameter's (``init(..., rank=None)``'s), else one
    state per parameter this rank owns (another rank's state, loaded by mistake, raised
    ``IndexError`` on this rank alone while its peers waited in the rank check)."""
    if state.plan.world_size != collective.world_size or (every and len(state.owned) != len(leaves)):
        raise ValueError(
            f"Arg ``state`` does not fit: its plan shards over {state.plan.world_size} ranks, the collective has "
            f"{collective.world_size}" + (f"; {every} needs the state of every parameter ({len(leaves)}, from "
                                          f"init(..., rank=None)), got {len(state.owned)}" if every else "") + "."
        )
    if not every:
        check("state", len(state.owned), HOLDS, what="parameter states", count=len(state.plan.owned_by(collective.rank)),
              per=f"parameter(s) rank {collective.rank} owns", where=f" (another rank's state? init(..., rank="
              f"{collective.rank}) makes this rank's). Nothing was stepped")


def _step_simulated(optimizer: Optimizer, leaves, grad_leaves, state: ZeroState, indices) -> ZeroState:
    """Every rank at once: each parameter's row of its owner, stepped as the owner
    steps its own dense tensor (a row of a strided leaf is copied out: torch's fused
    kernels step non-dense tensors wrongly), then written to every row (the owner's
    broadcast)."""
    owners = state.plan.owners
    rows = [leaves[i][owners[i]].detach().clone(memory_format=torch.contiguous_format) for i in indices]
    grads = [None if grad_leaves[i] is None else grad_leaves[i][owners[i]].contiguous() for i in indices]
    new = optimizer.update_(rows, grads, tuple(state.owned[i] for i in indices))
    owned = list(state.owned)
    with torch.no_grad():
        for i, row, leaf_state in zip(indices, rows, new):
            leaves[i].copy_(row.expand_as(leaves[i]))
            owned[i] = leaf_state
    return state._replace(owned=tuple(owned))


def _step_and_broadcast(optimizer: Optimizer, leaves, grad_leaves, state: ZeroState, indices, collective):
    if isinstance(collective, SimulatedCollective):
        return _step_simulated(optimizer, leaves, grad_leaves, state, indices), CollectiveHandle()
    state = _step_owned(optimizer, leaves, grad_leaves, state, indices, collective.rank)
    return state, broadcast_from_owners_(leaves, indices, state.plan, collective)


def update_subset_(
    optimizer: Optimizer, params, grads, state: ZeroState, *, indices: Sequence[int], collective: DistributedCollective
):
    """Step the owned parameters among ``indices`` and start their owners'
    broadcasts: ``(state, handle)``."""
    leaves, _, grad_leaves = _step_inputs(params, grads, state, collective)
    return _step_and_broadcast(optimizer, leaves, grad_leaves, state, indices, collective)


def update_(optimizer: Optimizer, params, grads, state: ZeroState, *, collective: DistributedCollective) -> ZeroState:
    """One whole iteration in place, after the rank check; returns the state at step + 1."""
    with refusing(collective, context=_Context(state)):  # this rank's input: its peers raise at once, not wait
        leaves, _, grad_leaves = _step_inputs(params, grads, state, collective)
    if isinstance(collective, DistributedCollective):
        # a step this rank's optimizer would refuse (a schedule's value out of range) is part of the check:
        # every rank raises, also one that owns nothing (it waited for the owner's broadcast before)
        refusal = _refusal(optimizer, leaves, grad_leaves, state, collective.rank)
        context = with_refusal(str(_Context(state)), refusal)
        try:
            collective.check_same_on_all_ranks(leaves, context=context, what="one ZeRO step")
        except RankMismatchError as error:
            if refusals(error):
                raise ValueError(
                    f"A ZeRO step was refused ({'; '.join(refusals(error))}); nothing was stepped on any rank."
                ) from error
            raise
        if refusal:  # one rank: no check ran
            raise ValueError(refusal)
    state, handle = _step_and_broadcast(optimizer, leaves, grad_leaves, state, range(len(leaves)), collective)
    if isinstance(collective, DistributedCollective):
        wait_for_owners(handle, leaves, range(len(leaves)), state.plan, collective.rank, "One ZeRO step")
    return end_iteration(state)


def mapped_update(optimizer: Optimizer, params, grads, state: ZeroState, collective: VmapCollective):
    """:func:`update` under ``vmap`` (see the module docstring)."""
    leaves, spec = tree_flatten(params)
    grad_leaves = spec.flatten_up_to(grads)
    _check_state_fits(state, leaves, collective, "under vmap every replica")
    active = [i for i, g in enumerate(grad_leaves) if g is not None]
    stepped, states = optimizer.update(
        [leaves[i] for i in active], [grad_leaves[i] for i in active], [state.owned[i] for i in active]
    )
    new_leaves, owned = list(leaves), list(state.owned)
    for k, i in enumerate(active):
        new_leaves[i] = stepped[k]
        owned[i] = type(states[k])(*(
            None if t is None else collective.broadcast([t], src=state.plan.owners[i])[0] for t in states[k]
        ))
    new_leaves = [collective.broadcast([leaf], src=owner)[0] for leaf, owner in zip(new_leaves, state.plan.owners)]
    return tree_unflatten(spec, new_leaves), ZeroState(state.step + 1, state.plan, tuple(owned))


def update(optimizer: Optimizer, params, grads, state: ZeroState, *, collective: DistributedCollective):
    """Pure: ``(new params, new state)``; the inputs are not modified. Under
    ``vmap``, with a :class:`~puredist.VmapCollective` (see the module docstring)."""
    if isinstance(collective, VmapCollective):
        return mapped_update(optimizer, params, grads, state, collective)
    leaves, spec = tree_flatten(params)
    copies = clone_leaves(leaves)
    cloned = state._replace(owned=tuple(clone_states(state.owned)))
    new_state = update_(optimizer, copies, _stepped_grads(spec, grads, state, collective), cloned, collective=collective)
    return tree_unflatten(spec, copies), new_state


def _stepped_grads(spec, grads, state: ZeroState, collective) -> list | PyTree:
    """``grads``' leaves, those this rank steps with copied (torch's multi-tensor
    Nesterov SGD adds into the gradients it is given); ``grads`` as given where they
    do not fit ``spec`` (the step refuses them, through its peers' rank check)."""
    try:
        leaves = spec.flatten_up_to(grads)
    except ValueError:
        return grads
    if isinstance(collective, SimulatedCollective):
        stepped = range(len(leaves))
    elif isinstance(collective, DistributedCollective):
        stepped = state.plan.owned_by(collective.rank)
    else:  # (refused by the step)
        return leaves
    for i in stepped:
        if leaves[i] is not None:
            leaves[i] = leaves[i].clone()
    return leaves


def end_iteration(state: ZeroState) -> ZeroState:
    """The state after all buckets of an iteration were stepped (step + 1)."""
    return state._replace(step=state.step + 1)


def zero(optimizer: Optimizer) -> Zero:
    """Shard ``optimizer``'s state over ranks (ZeRO stage 1).

    Args:
        optimizer: a functional optimizer from :mod:`puredist.optim`.

    Returns:
        A :class:`Zero`.

    Raises:
        TypeError: ``optimizer`` is not a functional optimizer.
    """
    check("optimizer", optimizer, INSTANCE, kind=Optimizer, a="a puredist optimizer (e.g. adam(1e-3))")
    return Zero(
        init=bound(init, optimizer),
        update=bound(update, optimizer),
        update_=bound(update_, optimizer),
        update_subset_=bound(update_subset_, optimizer),
        end_iteration=end_iteration,
    )
