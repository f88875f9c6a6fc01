"""Stacked replicas: the outer step of a global copy held as ``[R, *shape]`` tensors,
one row per simulated rank (:class:`~puredist.SimulatedCollective`).

An elementwise outer optimizer steps the stacked tensors as they are: each element's
step is its own. One that is not (:attr:`~puredist.Optimizer.elementwise` false: a
norm per tensor, as LARS or normalized SGD) would take its norms across the replicas;
:func:`replica_by_replica` steps it one replica at a time instead, with
``torch.func.vmap`` of its pure ``update`` over the replica axis, so that each
replica's step is the one a real rank takes. Which state tensors are per replica is
the state type's declaration (:func:`~puredist.optim.state_axes`: its counts are
shared, every replica having taken the same steps); for a state of an optimizer built
by hand, declaring nothing, a tensor shaped like its stacked parameter is per
replica and any other (a count) is shared.

This module must not communicate.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.utils._pytree as torch_pytree
from torch.func import vmap

from puredist.optim import Optimizer, state_axes
from puredist.optim.base import is_param_state


def replica_by_replica(outer: Optimizer) -> Optimizer:
    """``outer``, its ``update`` and ``update_`` mapped over the leading replica axis
    of the parameters, the gradients and the states' per-replica tensors (``update_``
    writes the parameters in place and returns the new states).

    Raises:
        TypeError: ``outer`` has no pure ``update`` (an optimizer built by hand with
            ``update=None``): nothing to map.
    """
    if outer.update is None:
        raise TypeError(
            "Arg ``outer``: on simulated ranks (SimulatedCollective) an outer optimizer that is not elementwise "
            "steps each replica's global copy on its own, through its pure update under torch.func.vmap, and this "
            "one, built by hand, has none (update=None): give it an update, build it with "
            "puredist.optim.make_optimizer, or mark it elementwise=True if each element's step is its own."
        )

    def update(params, grads, states):
        params, states = list(params), list(states)
        axes = [_replica_axes(param, state) for param, state in zip(params, states)]
        return vmap(outer.update, in_dims=(0, 0, axes), out_dims=(0, axes))(params, list(grads), states)

    def update_(params, grads, states):
        stepped, new_states = update(params, grads, states)
        with torch.no_grad():
            torch._foreach_copy_(list(params), list(stepped))
        return new_states

    return outer._replace(update=update, update_=update_)


def _replica_axes(param: torch.Tensor, state: Any) -> Any:
    """``vmap``'s axes of one parameter's state over the replicas (see the module
    docstring): its declaration's, or by shape for a state that declares nothing."""
    if is_param_state(state):
        return state_axes(state)
    return torch_pytree.tree_map(lambda leaf: _per_replica(leaf, param.shape), state)


def _per_replica(leaf: object, stacked: Sequence[int]) -> int | None:
    return 0 if isinstance(leaf, torch.Tensor) and leaf.shape == stacked else None
