"""The storage protocol: how one fragment's tensors are held, and the four things a
synchronization asks of them (the pseudo-gradient, a snapshot, the outer step, the
write-back), so that :mod:`puredist.outer.sync` holds the algorithm alone.

:class:`Storage` is the protocol and its most common implementation: a global copy
in the parameters' own device and dtype, sent as it is, worked on in place with
multi-tensor kernels over a fragment's leaves. The other implementations override
what differs (:mod:`~puredist.outer.storage.choose` picks one per layout of the
parameters): :mod:`~puredist.outer.storage.flat` (a fragment's global copy, outer
state and payload as views of one buffer each), :mod:`~puredist.outer.storage.converted`
(a global copy on the parameters' device in another dtype, or sent in another),
:mod:`~puredist.outer.storage.per_leaf` (a host global copy, mixed dtypes or
devices: one conversion per leaf), :mod:`~puredist.outer.storage.shards` (DTensor
leaves, on their local shards) and :mod:`~puredist.outer.storage.traced` (out of
place, under ``torch.func`` transforms and ``torch.compile``).

Every method takes and returns lists aligned with the fragment's leaves; an in-place
storage returns the tensors it was given, written; the traced one returns new ones.

This module must not decide when a synchronization runs. A storage holds no tensor: it
is chosen once per layout and kept with it (a flat fragment's scratch buffers live
with its global copy, :mod:`~puredist.outer.storage.flat`).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from puredist._inputs import checked_like
from puredist._layout import Layout
from puredist.collectives import Collective, CollectiveHandle
from puredist.compression import Compressor, compressed_mean
from puredist.optim import Optimizer, copies
from puredist.outer.config import OuterConfig


COMPLETED = CollectiveHandle()
"""A completed handle (nothing in flight), shared by every synchronous averaging: none
is made on a traced path (``torch.compile`` cannot trace a handle's making)."""


class Fragment(NamedTuple):
    """One fragment's tensors at one step, aligned leaf by leaf.

    Attributes:
        index: the fragment's index.
        locals: its parameter leaves (the local parameters).
        globals: its global copy.
        states: the outer optimizer's per-parameter states.
        residuals: with a compressor, this rank's error-feedback residuals; else ``[]``.
    """

    index: int
    locals: list
    globals: list
    states: list
    residuals: list


class Payload(NamedTuple):
    """A fragment's pseudo-gradients as they are averaged.

    Attributes:
        sent: what the collective averages in place (one flat buffer, or the leaves).
        leaves: the pseudo-gradients per leaf (views of ``sent`` where it is one
            buffer): what a synchronization in flight carries.
    """

    sent: list
    leaves: tuple


class Storage:
    """A fragment's global copy in the parameters' own place, stepped in place with
    multi-tensor kernels (see the module docstring for the others).

    Args:
        config: the transform's options.
        outer: the outer optimizer, as it steps these tensors (replica by replica
            where they are stacked replicas: :func:`~puredist.outer.storage.choose.storage_for`).
        layout: the layout of the parameter leaves it was chosen for.
    """

    def __init__(self, config: OuterConfig, outer: Optimizer, layout: Layout | None) -> None:
        self.config = config
        self.outer = outer
        self.layout = layout

    def pseudo_gradient(self, fragment: Fragment) -> Payload:
        """``global - local`` per leaf, in the global copy's dtype, as it is sent."""
        with torch.no_grad():
            # the differences' strides follow both operands': their layout is kept per layout of the leaves too
            pseudo = checked_like(fragment.globals, torch._foreach_sub(fragment.globals, fragment.locals),
                                  why=("foreach_sub", self.layout))
        return Payload(pseudo, tuple(pseudo))

    def snapshot(self, fragment: Fragment) -> tuple:
        """A copy of the local parameters (a delayed synchronization keeps the
        progress made after it: ``local <- global_new + (local - snapshot)``)."""
        return tuple(copies(fragment.locals))

    def average(self, payload: Payload, collective: Collective, *, context: object,
                async_op: bool) -> tuple[tuple, CollectiveHandle]:
        """``(the mean pseudo-gradients per leaf, a handle to wait on)``: averaged in
        place (in the background with ``async_op``)."""
        if async_op:
            return payload.leaves, collective.mean_(payload.sent, async_op=True, context=context)
        collective.mean_(payload.sent, context=context)
        return payload.leaves, COMPLETED

    def compress(self, payload: Payload, fragment: Fragment, compressor: Compressor, collective: Collective, *,
                 context: object) -> tuple[Sequence[torch.Tensor], list]:
        """``(means per leaf, new residuals)``: the pseudo-gradients averaged with
        ``compressor``'s payloads and error feedback (synchronous)."""
        means, left = compressed_mean(list(payload.leaves), tuple(fragment.residuals), compressor, collective,
                                      context=context)
        return means, list(left)

    def outer_grads(self, averaged: Sequence[torch.Tensor], fragment: Fragment) -> list:
        """The mean pseudo-gradients as the outer step takes them: on the global
        copy's device, in its dtype."""
        return list(averaged)

    def establish(self, fragment: Fragment, grads: list) -> list:
        """The global copy established by plain averaging: ``g - mean(g - l) = mean(l)``."""
        with torch.no_grad():
            torch._foreach_sub_(fragment.globals, grads)
        return fragment.globals

    def outer_step(self, fragment: Fragment, grads: list) -> tuple[list, list]:
        """``(global copy, outer states)`` after one step of the outer optimizer."""
        with torch.no_grad():
            states = self.outer.update_(fragment.globals, grads, fragment.states)
        return fragment.globals, list(states)

    def write_back(self, fragment: Fragment, globals_: list, snapshot: tuple) -> list:
        """The local parameters after a synchronization: the new global copy, plus
        the progress made since ``snapshot`` where there is one."""
        with torch.no_grad():
            if snapshot:
                torch._foreach_sub_(fragment.locals, list(snapshot))
                torch._foreach_add_(fragment.locals, globals_)
            else:
                torch._foreach_copy_(fragment.locals, globals_)
        return fragment.locals

    def mean_within(self, tensors: list, collective: Collective, *, group_size: int, context: object) -> list:
        """``tensors`` averaged within groups of ``group_size`` (a lower level)."""
        collective.mean_(tensors, group_size=group_size, context=context)
        return tensors
