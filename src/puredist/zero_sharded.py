"""ZeRO stage 1 as pure functions: sharded optimizer state over an explicit plan.

Every rank holds the optimizer state of the parameters it owns only (per the
:class:`~puredist.sharding.ZeroPlan`), steps them with the (already averaged)
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
"""

from typing import Callable, NamedTuple, Sequence

import torch

from puredist.tree import PyTree, clone_leaves, tree_flatten, tree_unflatten
from puredist.collectives import CollectiveHandle, DistributedCollective
from puredist.optim import Optimizer, _clone_state
from puredist.sharding import ZeroPlan


class ZeroState(NamedTuple):
    """State of a ZeRO-sharded optimizer on one rank.

    Attributes:
        step: completed iterations.
        plan: the ownership plan (the same on every rank).
        owned: per-parameter optimizer states of the parameters this rank owns,
            aligned with ``plan.owned_by(rank)``; nothing for the others.
    """

    step: int
    plan: ZeroPlan
    owned: tuple


class Zero(NamedTuple):
    """A ZeRO-sharded optimizer (see the module docstring)."""

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
    handles = []
    for owner in range(plan.world_size):
        mine = [leaves[i] for i in indices if plan.owners[i] == owner]
        if mine:
            handles.append(collective.broadcast_(mine, src=owner, async_op=True))
    return CollectiveHandle.merged(handles)


def zero(optimizer: Optimizer) -> Zero:
    """Shard ``optimizer``'s state over ranks (ZeRO stage 1).

    Args:
        optimizer: a functional optimizer from :mod:`puredist.optim`.

    Returns:
        A :class:`Zero`.
    """

    def init(params: PyTree, *, plan: ZeroPlan, rank: int) -> ZeroState:
        """The state of ``rank``: optimizer state for the parameters ``plan`` gives it."""
        leaves, _ = tree_flatten(params)
        if len(plan.owners) != len(leaves):
            raise ValueError(f"Arg ``plan`` covers {len(plan.owners)} parameters, ``params`` has {len(leaves)}.")
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"Arg ``rank`` must be in [0, {plan.world_size}), got {rank}.")
        owned = optimizer.init([leaves[i] for i in plan.owned_by(rank)])
        return ZeroState(step=0, plan=plan, owned=owned)

    def _step_owned(leaves, grad_leaves, state: ZeroState, indices, rank: int) -> ZeroState:
        owned_indices = state.plan.owned_by(rank)
        position = {index: k for k, index in enumerate(owned_indices)}
        mine = [i for i in indices if state.plan.owners[i] == rank]
        new = optimizer.update_(
            [leaves[i] for i in mine],
            [grad_leaves[i] for i in mine],
            tuple(state.owned[position[i]] for i in mine),
        )
        owned = list(state.owned)
        for i, s in zip(mine, new):
            owned[position[i]] = s
        return state._replace(owned=tuple(owned))

    def _checked(params, grads, state: ZeroState, collective: DistributedCollective):
        leaves, spec = tree_flatten(params)
        grad_leaves = spec.flatten_up_to(grads)
        if len(state.plan.owners) != len(leaves):
            raise ValueError(f"The state's plan covers {len(state.plan.owners)} parameters, ``params`` has {len(leaves)}.")
        if state.plan.world_size != collective.world_size:
            raise ValueError(
                f"The state's plan shards over {state.plan.world_size} ranks, the collective has {collective.world_size}."
            )
        return leaves, spec, grad_leaves

    def _step_and_broadcast(leaves, grad_leaves, state: ZeroState, indices, collective: DistributedCollective):
        state = _step_owned(leaves, grad_leaves, state, indices, collective.rank)
        return state, broadcast_from_owners_(leaves, indices, state.plan, collective)

    def update_subset_(params, grads, state: ZeroState, *, indices: Sequence[int], collective: DistributedCollective):
        """Step the owned parameters among ``indices`` and start their owners'
        broadcasts: ``(state, handle)``."""
        leaves, _, grad_leaves = _checked(params, grads, state, collective)
        return _step_and_broadcast(leaves, grad_leaves, state, indices, collective)

    def update_(params, grads, state: ZeroState, *, collective: DistributedCollective) -> ZeroState:
        """One whole iteration in place, after the rank check; returns the state at step + 1."""
        leaves, _, grad_leaves = _checked(params, grads, state, collective)
        collective.check_same_on_all_ranks(
            leaves, context=f"plan {state.plan.digest()} step {state.step}", what="one ZeRO step"
        )
        state, handle = _step_and_broadcast(leaves, grad_leaves, state, range(len(leaves)), collective)
        handle.wait()
        return end_iteration(state)

    def update(params, grads, state: ZeroState, *, collective: DistributedCollective):
        """Pure: ``(new params, new state)``; the inputs are not modified."""
        leaves, spec = tree_flatten(params)
        copies = clone_leaves(leaves)
        cloned = state._replace(owned=tuple(_clone_state(s) for s in state.owned))
        new_state = update_(copies, spec.flatten_up_to(grads), cloned, collective=collective)
        return tree_unflatten(spec, copies), new_state

    def end_iteration(state: ZeroState) -> ZeroState:
        """The state after all buckets of an iteration were stepped (step + 1)."""
        return state._replace(step=state.step + 1)

    return Zero(init, update, update_, update_subset_, end_iteration)
