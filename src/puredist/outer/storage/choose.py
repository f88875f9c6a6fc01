"""Which storage holds a step's fragments: chosen once per layout of the parameter
leaves, transform and kind of collective (:func:`storage_for`), or the traced one
under ``torch.func`` transforms and ``torch.compile`` (:func:`traced_storage`): the
one choice among the storages (where a fragment's global copy is laid out flat is
decided at ``init``, :mod:`~puredist.outer.storage.flat_layout`).

This module must not touch tensor values or communicate.
"""

from __future__ import annotations

from typing import Sequence

import torch

from puredist._layout import Checked, all_real_shards
from puredist.collectives import Collective, DistributedCollective, SimulatedCollective
from puredist.optim import Optimizer
from puredist.outer.config import OuterConfig
from puredist.outer.storage.base import Storage
from puredist.outer.storage.converted import Converted, OnDevice
from puredist.outer.storage.flat import Flat
from puredist.outer.storage.per_leaf import PerLeaf
from puredist.outer.storage.shards import Shards
from puredist.outer.storage.stacked import replica_by_replica
from puredist.outer.storage.traced import Traced


def storage_for(config: OuterConfig, leaves: Checked, collective: Collective) -> Storage:
    """The storage of ``leaves``' fragments on ``collective``, in this order:

    - the global copy in the parameters' own place (``OuterConfig.same_place``) of
      plain tensors: :class:`~puredist.outer.storage.flat.Flat` on real ranks (a
      fragment laid out flat at ``init`` is averaged as one buffer), else
      :class:`~puredist.outer.storage.base.Storage` (multi-tensor, per leaf);
    - DTensor leaves, synchronous and uncompressed with an elementwise outer
      optimizer (one built by hand may take a norm, which on a shard would be the
      shard's): :class:`~puredist.outer.storage.shards.Shards`;
    - a global copy on the leaves' one device and dtype:
      :class:`~puredist.outer.storage.converted.Converted` where one flat buffer can
      be sent (real ranks, no compressor, a global copy at least as wide as the
      leaves: a multi-tensor difference of a narrower one would round once in the
      leaves' dtype, where the per-leaf storage rounds the leaf first), else
      :class:`~puredist.outer.storage.converted.OnDevice`;
    - else :class:`~puredist.outer.storage.per_leaf.PerLeaf`.
    """
    return leaves.layout.derived(("outer storage", config, type(collective)),
                                 lambda: _chosen(config, leaves, collective))


def traced_storage(config: OuterConfig, collective: Collective) -> Storage:
    """The out-of-place storage (:class:`~puredist.outer.storage.traced.Traced`)."""
    return Traced(config, _outer(config, collective), None)


def _outer(config: OuterConfig, collective: Collective) -> Optimizer:
    """The outer optimizer as it steps tensors on ``collective``: replica by replica
    where they are stacked replicas and it is not elementwise
    (:mod:`~puredist.outer.storage.stacked`)."""
    if isinstance(collective, SimulatedCollective) and not config.outer.elementwise:
        return replica_by_replica(config.outer)
    return config.outer


def _chosen(config: OuterConfig, leaves: Checked, collective: Collective) -> Storage:
    outer, layout, real_ranks = _outer(config, collective), leaves.layout, isinstance(collective, DistributedCollective)
    if config.same_place and layout.plain:
        return (Flat if real_ranks else Storage)(config, outer, layout)
    if (config.same_place and config.compressor is None and not config.delay and config.outer.elementwise
            and all_real_shards(leaves, layout)):
        return Shards(config, outer, layout, layout.summary(leaves)[2])
    if config.global_device is None and layout.plain and _one_dtype_and_device(leaves):
        converts = real_ranks and config.compressor is None and _at_least_as_wide(config, leaves[0].dtype)
        return (Converted if converts else OnDevice)(config, outer, layout)
    return PerLeaf(config, outer, layout)


def _one_dtype_and_device(leaves: Sequence[torch.Tensor]) -> bool:
    return len({(t.dtype, t.device) for t in leaves}) == 1


def _at_least_as_wide(config: OuterConfig, leaf_dtype: torch.dtype) -> bool:
    global_dtype = config.global_dtype or leaf_dtype
    return torch.promote_types(leaf_dtype, global_dtype) == global_dtype
