"""Collectives as an explicit argument: the mean over a group of ranks.

Three backends implement the same small protocol, :class:`Collective`:

- :class:`DistributedCollective`: real ranks over ``torch.distributed`` process
  groups (Gloo, NCCL, ...). It writes the mean into the tensors' own storage
  (``data_ptr()`` never changes), reducing bounded staging buckets of one device and
  dtype (no promotion), with no device synchronization, after checking that every
  rank passes the same tensors and the same context (schedule and step). A tensor
  is written only once its bucket's all-reduce has succeeded, so a failure leaves
  every element at its old value or its mean (:class:`CollectiveError` says which).
- :class:`SimulatedCollective`: ``R`` ranks in one process. Every tensor carries a
  leading replica axis ``[R, *shape]``; the mean is taken within contiguous groups
  of replicas, exactly as ``dist.new_subgroups`` groups ranks. It is what
  ``vmap(axis_name=...)`` with ``lax.pmean`` gives JAX users: the same pure code
  runs ``R`` ranks at once, for property-based tests.
- :class:`~puredist.VmapCollective`: the same for code running under
  ``torch.func.vmap`` over the replica axis (JAX's ``pmean`` under ``vmap``).

Each has ``mean_`` (in place) and ``mean`` (new tensors, differentiable: the adjoint of
a mean over a group is the mean of the gradients over the same group).

In both, ``group_size`` selects the level: ``None`` (or the full size) averages
over the whole group; a smaller ``g`` averages within each block of ``g``
consecutive ranks. The mean's division rule (divide before the sum for dtypes
narrower than fp32) is :func:`divides_first`'s.

One concern a module:

- :mod:`puredist.collectives.base`: the protocol, the division rule
  (:func:`divides_first`, :func:`block_mean`), :func:`check_is_collective`,
  :func:`~puredist.collectives.base.check_group_sizes`, and a
  rank's refusal told to its peers before it raises (:class:`~puredist.collectives.base.refusing`);
- :mod:`puredist.collectives.distributed`: :class:`DistributedCollective` and its
  differentiable mean (:class:`~puredist.collectives.distributed.AllReduceMean`);
- :mod:`puredist.collectives.simulated`: :class:`SimulatedCollective` and
  :class:`~puredist.collectives.simulated.ReplicaGroups`;
- :mod:`puredist.collectives.vmap`: :class:`~puredist.VmapCollective` and
  :func:`replica_mean`, collectives as ``torch.library`` operators with ``vmap`` rules.

This package only re-exports.
"""

from puredist._groups import subgroup
from puredist.collectives.base import (
    Collective,
    block_mean,
    check_is_collective,
    divides_first,
    refusing,
)
from puredist.collectives.distributed import (
    BROADCAST_IN_PLACE_MIN_BYTES,
    DEFAULT_BUCKET_CAP_BYTES,
    DEFAULT_DEVICE_BUCKET_CAP_BYTES,
    DistributedCollective,
)
from puredist.collectives.simulated import ReplicaGroups, SimulatedCollective
from puredist.collectives.vmap import VmapCollective, replica_mean
from puredist.errors import CollectiveError
from puredist.staging import CollectiveHandle

__all__ = [
    "DEFAULT_BUCKET_CAP_BYTES",
    "DEFAULT_DEVICE_BUCKET_CAP_BYTES",
    "Collective",
    "CollectiveError",
    "CollectiveHandle",
    "DistributedCollective",
    "SimulatedCollective",
    "VmapCollective",
    "divides_first",
    "replica_mean",
    "subgroup",
]
