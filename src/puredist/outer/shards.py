"""Sharded fragments: DTensor leaves (FSDP2) synchronized on their local shards.

DiLoCo's global copy and outer state are DTensors sharded like the parameters
(:mod:`puredist._dtensors`), and every step of a synchronization is elementwise
between tensors of one spec: its result on each rank is the same arithmetic on the
local shards. Run through DTensor's dispatch, each operation of each leaf costs tens
of microseconds of host work (81 ms a synchronization at 256 leaves where plain
tensors take 5). Here, for a synchronous, uncompressed synchronization of a fragment
of DTensor leaves in the global copy's own dtype (``same_place``), the
pseudo-gradients are taken on the shards by one multi-tensor kernel, averaged as
plain tensors (the rank check's context carries the DTensors' layout digest, so
ranks sharding differently still raise), the outer optimizer steps the shards of
the global copy and of its state in place, and the shards are written back: the
state stays DTensors (a state field the optimizer makes anew is wrapped in the
global copy's spec), so checkpoints are unchanged.

This module must not communicate.
"""

from __future__ import annotations

import operator
from typing import NamedTuple, Sequence

import torch

from puredist._dtensors import is_dtensor, like, local_shard, local_shards
from puredist._inputs import checked_like
from puredist._layout import Checked, all_real_shards
from puredist.outer.config import OuterConfig


def on_shards(config: OuterConfig, leaves: Checked) -> bool:
    """Whether a synchronization of ``leaves`` runs on their local shards: all real
    DTensors, the global copy in their own place, synchronous and uncompressed, and an
    outer optimizer that acts element by element (:attr:`~puredist.Optimizer.elementwise`:
    one built by hand may take a norm, which on a shard would be the shard's)."""
    return (config.same_place and config.compressor is None and not config.delay and config.outer.elementwise
            and not leaves.layout.plain and all_real_shards(leaves, leaves.layout))


class ShardedContext(NamedTuple):
    """The rank-check context of a synchronization sent as local shards: its own
    context and the DTensors' layout digest (placements, meshes, shapes)."""

    context: object
    layout_digest: int

    def __str__(self) -> str:
        return f"{self.context} over shards of layout {self.layout_digest & 0xFFFFFFFF:08x}"


def pseudo_gradient(globals_: Sequence[torch.Tensor], locals_: Sequence[torch.Tensor]) -> Checked:
    """``global - local`` of each leaf's local shard (plain tensors, checked as the
    global copy's shards are: planned once, not at every synchronization)."""
    shards = local_shards(globals_)
    with torch.no_grad():
        return checked_like(shards, torch._foreach_sub(shards, local_shards(locals_)), why="shards sub")


def step(config: OuterConfig, targets: list[torch.Tensor], grads: list[torch.Tensor], states: list[NamedTuple],
         first: bool) -> list[NamedTuple] | None:
    """Step the global copy ``targets`` (DTensors) with the averaged shards ``grads``
    on their shards, in place: plain averaging at a fragment's ``first``
    synchronization (``None`` returned), else the outer optimizer, whose new states
    are returned as DTensors again."""
    shards = local_shards(targets)
    with torch.no_grad():
        if first:
            torch._foreach_sub_(shards, grads)
            return None
        stepped = config.outer.update_(shards, grads, [_on_shards(s) for s in states])
    return [_as_dtensors(old, new, target) for old, new, target in zip(states, stepped, targets)]


def _on_shards(state: NamedTuple) -> NamedTuple:
    return type(state)(*(local_shard(field) if is_dtensor(field) else field for field in state))


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


def write_back(leaves: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> None:
    """The new global copy's shards into the leaves' shards (one multi-tensor copy)."""
    with torch.no_grad():
        torch._foreach_copy_(local_shards(leaves), local_shards(targets))
