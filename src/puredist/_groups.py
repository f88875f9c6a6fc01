"""Making process groups: subgroups of consecutive ranks, and the groups of a
:class:`~torch.distributed.device_mesh.DeviceMesh`'s dimensions.

A process group holds sockets and threads, so each is made once per set of ranks
(collectively, as torch requires: every rank asks for the same groups in the same
order) and reused; where every rank takes part, a device-only (NCCL) group gets its
Gloo twin for the rank check (:mod:`puredist._host_groups`).

This module must not move tensor values.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Sequence

import torch.distributed as dist

from puredist._group_memo import GroupMemo
from puredist._host_groups import make_twins
from puredist._validation import Rule, check

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def mesh_group(mesh: "DeviceMesh", names: tuple[str, ...]) -> dist.ProcessGroup:
    """This rank's process group spanning the mesh dimensions ``names`` (the mesh's
    own for one dimension; for several, created collectively over every such group)."""
    order = [mesh.mesh_dim_names.index(name) for name in names]
    others = [d for d in range(mesh.ndim) if d not in order]
    ranks = mesh.mesh.permute(*others, *order).reshape(-1, math.prod(mesh.mesh.shape[d] for d in order)).tolist()
    if len(names) == 1:
        group = mesh.get_group(names[0])
    else:
        key = tuple(map(tuple, ranks))
        group = _MESH_GROUPS.get(key)
        if group is None:  # a process group holds sockets and threads: one per set of ranks and world
            group, _ = dist.new_subgroups_by_enumeration(ranks)
            _MESH_GROUPS[key] = group
    if mesh.mesh.numel() == dist.get_world_size():  # every rank is here: device-only groups get their Gloo twins
        make_twins(ranks, like=group)
    return group


_MESH_GROUPS = GroupMemo()
"""the rank lists of a group over several mesh dimensions -> this rank's group"""

_SUBGROUPS = GroupMemo()
"""(a weak reference to the whole group, the subgroups' size) -> this rank's subgroup"""


def subgroup(whole: dist.ProcessGroup, size: int) -> dist.ProcessGroup:
    """This rank's subgroup of ``size`` consecutive ranks of ``whole``, made by
    ``dist.new_subgroups`` the first time (a collective: every rank of ``whole``
    asks for the same sizes in the same order, as torch requires), then reused —
    a process group holds sockets and threads, so making new ones for every averager
    leaks them."""
    key = (weakref.ref(whole), size)  # (equal while ``whole`` lives; a dead one equals no other)
    group = _SUBGROUPS.get(key)
    if group is None:
        group = _SUBGROUPS[key] = dist.new_subgroups(group_size=size, group=whole)[0]
        ranks = dist.get_process_group_ranks(whole)
        if len(ranks) == dist.get_world_size():  # every rank is here: device-only subgroups get their Gloo twins
            make_twins([ranks[i : i + size] for i in range(0, len(ranks), size)], like=group)
    return group


def subgroups_of(whole: dist.ProcessGroup, sizes: Sequence[int]) -> dict[int, dist.ProcessGroup]:
    """``{size: subgroup(whole, size)}`` for each size in ``sizes`` but the whole's own."""
    world_size = dist.get_world_size(whole)
    return {size: subgroup(whole, size) for size in dict.fromkeys(sizes) if size != world_size}


_DIMS = Rule(lambda v, b: bool(v) and set(v) <= set(b["known"]) and len(set(v)) == len(v), ValueError,
             "Arg ``{arg}`` {dims!r}: the mesh's dimensions are {known}; got unknown, repeated or no names.")
_WHOLE_MESH = Rule(lambda v, b: len(b["names"]) <= 1 or v == b["world_size"], ValueError,  # v: the mesh's ranks
                   "Arg ``{arg}`` covers {value} of the {world_size} ranks (a slice of a larger mesh): groups over "
                   "several dimensions {names} are created by every rank together; pass the whole mesh.")


def mesh_groups(mesh: "DeviceMesh", dims: str | Sequence[str]) -> tuple[dist.ProcessGroup, dict[int, dist.ProcessGroup]]:
    """``(whole, {size: subgroup})``: this rank's group spanning the mesh dimension(s)
    ``dims`` (outermost first) and, for several, each inner suffix's group by its size
    (see :meth:`~puredist.DistributedCollective.from_mesh`).

    Raises:
        ValueError: an unknown or repeated dimension name, or none; several
            dimensions of a mesh that does not cover every rank (a slice).
    """
    names = (dims,) if isinstance(dims, str) else tuple(dims)
    known = mesh.mesh_dim_names or ()
    check("dims", names, _DIMS, dims=dims, known=known)
    check("mesh", mesh.mesh.numel(), _WHOLE_MESH, names=names, world_size=dist.get_world_size())
    groups = [mesh_group(mesh, names[i:]) for i in range(len(names))]  # whole first, then inner suffixes
    subgroups = {dist.get_world_size(g): g for g in groups[1:] if dist.get_world_size(g) != dist.get_world_size(groups[0])}
    return groups[0], subgroups
