"""The sharded storage: DTensor leaves (FSDP2) synchronized on their local shards.

DiLoCo's global copy and outer state are DTensors sharded like the parameters
(:mod:`puredist._dtensors`), and every step of a synchronization is elementwise
between tensors of one spec: its result on each rank is the same arithmetic on the
local shards. Run through DTensor's dispatch, each operation of each leaf costs tens
of microseconds of host work (81 ms a synchronization at 256 leaves where plain
tensors take 5). Here, for a synchronous, uncompressed synchronization of DTensor
leaves in the global copy's own dtype (``same_place``) with an elementwise outer
optimizer, the pseudo-gradients are taken on the shards by one multi-tensor kernel,
averaged as plain tensors (the rank check's context carries the DTensors' layout
digest, so ranks sharding differently still raise), the outer optimizer steps the
shards of the global copy and of its state in place, and the shards are written
back: the state stays DTensors (a state field the optimizer makes anew is wrapped in
the global copy's spec), so checkpoints are unchanged.

This module must not communicate but through the collective it is given.
"""

from __future__ import annotations

import operator
from typing import NamedTuple, Sequence

import torch

from puredist._dtensors import dtensor_type, is_dtensor, like, local_shard, local_shards
from puredist._inputs import checked_like
from puredist._layout import Layout
from puredist._seq import rows_of
from puredist.collectives import Collective, CollectiveHandle
from puredist.optim import Optimizer
from puredist.outer.config import OuterConfig
from puredist.outer.storage.base import Fragment, Payload, Storage


class ShardedContext(NamedTuple):
    """The rank-check context of a synchronization sent as local shards: its own
    context and the DTensors' layout digest (placements, meshes, shapes)."""

    context: object
    layout_digest: int

    def __str__(self) -> str:
        return f"{self.context} over shards of layout {self.layout_digest & 0xFFFFFFFF:08x}"


def _on_shards(states: Sequence[NamedTuple]) -> list:
    """``states`` (of one kind) with each DTensor field its local shard, field by field
    (no Python frame per state where a field holds DTensors only, or none)."""
    if not states or not states[0]._fields:
        return list(states)
    columns = []
    for column in zip(*states):
        kinds = set(map(type, column))
        if kinds == {dtensor_type()}:
            columns.append(local_shards(column))
        else:
            columns.append(list(map(local_shard, column)) if dtensor_type() in kinds else column)
    return rows_of(type(states[0]), *columns)


def _stepped_in_place(shards: Sequence[NamedTuple], stepped: Sequence[NamedTuple]) -> bool:
    """Whether the optimizer returned the states of shards it was given, each field the
    same tensor (stepped in place): their DTensors are then the states as they were
    (compared field by field: no Python frame per state)."""
    if not shards or set(map(type, stepped)) != {type(shards[0])}:
        return not shards
    return all(all(map(operator.is_, new, old)) for new, old in zip(zip(*stepped), zip(*shards)))


def _as_dtensors(old: NamedTuple, new: NamedTuple, target: torch.Tensor) -> NamedTuple:
    """``new`` (a state of shards) as DTensors again, field by field (by name: a state
    may change kind, e.g. when a momentum buffer is made): a field that is still its
    old DTensor's shard, stepped in place, is that DTensor; one made anew where the
    old state had a DTensor or nothing is wrapped in ``target``'s spec; the rest (a
    step count) as it is."""
    shard = local_shard(target)

    def field_of(name: str, field: object) -> object:
        was = getattr(old, name, None)
        if not isinstance(field, torch.Tensor) or is_dtensor(field):
            return field
        if is_dtensor(was):
            return was if field is local_shard(was) else like(target, field)
        return like(target, field) if was is None and field.shape == shard.shape else field

    fields = [field_of(name, field) for name, field in zip(new._fields, new)]
    return old if type(new) is type(old) and all(map(operator.is_, fields, old)) else type(new)(*fields)


class Shards(Storage):
    """DTensor leaves' local shards (see the module docstring).

    Args:
        layout_digest: the DTensor leaves' layout digest (placements, meshes,
            shapes), joined to every rank check's context.
    """

    def __init__(self, config: OuterConfig, outer: Optimizer, layout: Layout, layout_digest: int) -> None:
        super().__init__(config, outer, layout)
        self.layout_digest = layout_digest

    def pseudo_gradient(self, fragment: Fragment) -> Payload:
        """``global - local`` of each leaf's local shard (plain tensors, checked as
        the global copy's shards are: planned once, not at every synchronization)."""
        shards = local_shards(fragment.globals)
        with torch.no_grad():
            pseudo = checked_like(shards, torch._foreach_sub(shards, local_shards(fragment.locals)), why="shards sub")
        return Payload(pseudo, tuple(pseudo))

    def average(self, payload: Payload, collective: Collective, *, context: object,
                async_op: bool) -> tuple[tuple, CollectiveHandle]:
        return super().average(payload, collective, context=ShardedContext(context, self.layout_digest),
                               async_op=async_op)

    def establish(self, fragment: Fragment, grads: list) -> list:
        with torch.no_grad():
            torch._foreach_sub_(local_shards(fragment.globals), grads)
        return fragment.globals

    def outer_step(self, fragment: Fragment, grads: list) -> tuple[list, list]:
        """The outer optimizer on the shards of the global copy and its states, in
        place; the new states are DTensors again."""
        targets, states = fragment.globals, fragment.states
        shards = _on_shards(states)
        with torch.no_grad():
            stepped = self.outer.update_(local_shards(targets), grads, shards)
        if _stepped_in_place(shards, stepped):
            return targets, states
        return targets, [_as_dtensors(old, new, target) for old, new, target in zip(states, stepped, targets)]

    def write_back(self, fragment: Fragment, globals_: list, snapshot: tuple) -> list:
        """The new global copy's shards into the leaves' shards (one multi-tensor copy)."""
        with torch.no_grad():
            torch._foreach_copy_(local_shards(fragment.locals), local_shards(globals_))
        return fragment.locals
