"""The traced storage: a synchronization out of place, for ``update`` under
``torch.func`` transforms (``vmap`` with a :class:`~puredist.VmapCollective`,
``grad``) and ``torch.compile``: every tensor it returns is new (the collective's
``mean``, the compressor's two phases, the outer optimizer's pure ``update``), so the
step is differentiable without a compressor (its payloads are not). Synchronous only
(``delay=0``): what a delayed synchronization carries, handles and snapshots, no
transform can map.

This module must not communicate but through the collective it is given.
"""

from __future__ import annotations

from typing import Sequence

import torch

from puredist.collectives import Collective, CollectiveHandle
from puredist.outer.storage.base import COMPLETED, Fragment, Payload, Storage
from puredist.outer.storage.per_leaf import pseudo_gradient


class Traced(Storage):
    """Out of place (see the module docstring)."""

    def pseudo_gradient(self, fragment: Fragment) -> Payload:
        comm_dtype = self.config.comm_dtype
        pseudo = [pseudo_gradient(g, leaf, comm_dtype) for g, leaf in zip(fragment.globals, fragment.locals)]
        return Payload(pseudo, tuple(pseudo))

    def average(self, payload: Payload, collective: Collective, *, context: object,
                async_op: bool) -> tuple[tuple, CollectiveHandle]:
        return tuple(collective.mean(list(payload.leaves), context=context)), COMPLETED

    def outer_grads(self, averaged: Sequence[torch.Tensor], fragment: Fragment) -> list:
        return [m.to(g.dtype) for m, g in zip(averaged, fragment.globals)]

    def establish(self, fragment: Fragment, grads: list) -> list:
        return [t - g for t, g in zip(fragment.globals, grads)]

    def outer_step(self, fragment: Fragment, grads: list) -> tuple[list, list]:
        targets, states = self.outer.update(fragment.globals, grads, tuple(fragment.states))
        return list(targets), list(states)

    def write_back(self, fragment: Fragment, globals_: list, snapshot: tuple) -> list:
        return [g.to(leaf.device, leaf.dtype, copy=True) for g, leaf in zip(globals_, fragment.locals)]  # never the copy

    def mean_within(self, tensors: list, collective: Collective, *, group_size: int, context: object) -> list:
        return collective.mean(tensors, group_size=group_size, context=context)
