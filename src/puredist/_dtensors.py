"""DTensor leaves (FSDP2, tensor parallelism): each rank reduces its local shard.

A model sharded within a replica group (``fully_shard`` over one mesh dimension,
tensor parallelism over another) holds ``DTensor`` parameters. Averaging or an outer
step *across* replica groups is the same operation on every rank's local shard: the
ranks of a replica-crossing group (a mesh dimension, e.g. ``"replicate"``) hold the
same shard of each parameter. So collectives reduce ``to_local()`` — the shard's own
storage, written in place — and the rank check compares each DTensor's sharding
(:func:`sharding_signature`), so that ranks holding different shards raise instead of
averaging unrelated numbers. Elementwise arithmetic on DTensors of one spec (the
outer optimizer's) stays on the shards; nothing here redistributes.

This module must not communicate: it only translates between DTensors and their
local shards.
"""

from __future__ import annotations

import operator
import sys
from typing import Callable, Sequence

import torch

_DTENSOR: type | None = None


def dtensor_type() -> type | None:
    """torch's ``DTensor`` class, or ``None`` while ``torch.distributed.tensor`` is not
    imported: no DTensor can exist before its module is (importing it costs about a
    second, so puredist does not do it for a program that has none)."""
    global _DTENSOR
    if _DTENSOR is None:
        _DTENSOR = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return _DTENSOR


def is_dtensor(tensor: object) -> bool:
    kind = _DTENSOR or dtensor_type()
    return kind is not None and isinstance(tensor, kind)


def check_not_pending(tensor: torch.Tensor, arg: str, label: Callable[[], str]) -> None:
    """Raise ValueError for a DTensor with a ``Partial`` placement (a reduction still
    pending within its mesh: its shards are not values to average); ``label()`` names
    the tensor (built only when raising)."""
    if is_dtensor(tensor) and any(p.is_partial() for p in tensor.placements):
        raise ValueError(
            f"Arg ``{arg}``: {label()} is a DTensor with placements {tensor.placements}: a Partial placement is a "
            "reduction still pending within its mesh. Redistribute it to Shard or Replicate first."
        )


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage, detached from autograd); any other tensor as is.
    (The shard ``to_local()`` returns without autograd, read directly: well under a
    microsecond instead of 24 µs through DTensor's dispatch.)"""
    if not is_dtensor(tensor):
        return tensor
    local = tensor._local_tensor
    return local.detach() if local.requires_grad else local


_LOCAL, _REQUIRES_GRAD = operator.attrgetter("_local_tensor"), operator.attrgetter("requires_grad")


def local_shards(dtensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`local_shard` of each of ``dtensors`` (all DTensors), in one C-level pass
    where no shard requires a gradient (FSDP2's parameters)."""
    shards = list(map(_LOCAL, dtensors))
    return list(map(local_shard, dtensors)) if any(map(_REQUIRES_GRAD, shards)) else shards


def sharding_signature(tensor: torch.Tensor) -> str:
    """What must match between ranks reducing ``tensor`` together: for a DTensor its
    placements, local shape, mesh shape and dimension names, and this rank's coordinate
    along the mesh dimensions that shard it (the same coordinates there are the same
    shard; along a ``Replicate`` dimension — HSDP's replica dimension, say — every
    coordinate holds the same shard); ``""`` for a plain tensor."""
    if not is_dtensor(tensor):
        return ""
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate() or ()
    shard = tuple(c for c, placement in zip(coordinate, tensor.placements) if not placement.is_replicate())
    return (
        f",dtensor{tuple(tensor.placements)},local{tuple(tensor.to_local().shape)},"
        f"mesh{tuple(mesh.shape)}{mesh.mesh_dim_names},shard{shard}"
    )


def like(reference: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor of ``reference``'s kind: for a DTensor reference, a DTensor
    with its mesh, placements, global shape and stride holding ``local`` as this rank's
    shard (no communication); else ``local`` itself."""
    if not is_dtensor(reference):
        return local
    return dtensor_type().from_local(
        local, reference.device_mesh, reference.placements, run_check=False, shape=reference.shape,
        stride=reference.stride(),
    )
