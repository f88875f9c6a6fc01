"""Stacked replicas: the outer step of a global copy held as ``[R, *shape]`` tensors,
one row per simulated rank (:class:`~puredist.SimulatedCollective`).

An elementwise outer optimizer steps the stacked tensors as they are: each element's
step is its own. One that is not (:attr:`~puredist.Optimizer.elementwise` false: a
norm per tensor, as LARS or normalized SGD) would take its norms across the replicas;
:func:`replica_by_replica` steps it one replica at a time instead, with
``torch.func.vmap`` over the replica axis (the state's counts unmapped, as
:func:`~puredist.optim.state_axes` declares them: every replica has taken the same
steps), so that each replica's step is the one a real rank takes.

This module must not communicate.
"""

from __future__ import annotations

import torch
from torch.func import vmap

from puredist.optim import Optimizer, state_axes


def replica_by_replica(outer: Optimizer) -> Optimizer:
    """``outer``, its ``update`` and ``update_`` mapped over the leading replica axis
    of the parameters, the gradients and the states' tensors (``update_`` writes the
    parameters in place and returns the new states)."""
    def update(params, grads, states):
        states = list(states)
        axes = state_axes(states)
        return vmap(outer.update, in_dims=(0, 0, axes), out_dims=(0, axes))(list(params), list(grads), states)

    def update_(params, grads, states):
        stepped, new_states = update(params, grads, states)
        with torch.no_grad():
            torch._foreach_copy_(list(params), list(stepped))
        return new_states

    return outer._replace(update=update, update_=update_)
