"""Mean over simulated ranks in one process: :class:`SimulatedCollective`, and what
the one-process backends share (:class:`ReplicaGroups`).

Every tensor carries a leading replica axis ``[R, *shape]``; the mean is taken within
contiguous groups of replicas, exactly as ``dist.new_subgroups`` groups ranks. It is
what ``vmap(axis_name=...)`` with ``lax.pmean`` gives JAX users: the same pure code
runs ``R`` ranks at once, for property-based tests.

This module must not import ``torch.distributed`` collectives: it runs without a
process group.
"""

from __future__ import annotations

from typing import Sequence

import torch

from puredist._inputs import check_stacked, checked_for_reduction
from puredist._validation import AT_LEAST_ONE, check
from puredist.collectives.base import Collective, block_mean, group_size_rule
from puredist.staging import CollectiveHandle

__all__ = ["ReplicaGroups", "SimulatedCollective"]

_GROUP_SIZE = group_size_rule("divide the number of replicas {replicas}.")


class ReplicaGroups:
    """What the one-process backends share: ``num_replicas`` simulated ranks, grouped
    in blocks of consecutive replicas as ``dist.new_subgroups`` groups ranks.

    Args:
        num_replicas: the number of simulated ranks, ``>= 1``.

    Raises:
        ValueError: ``num_replicas < 1``.
    """

    simulated = True

    def __init__(self, num_replicas: int) -> None:
        check("num_replicas", num_replicas, AT_LEAST_ONE)
        self.num_replicas = num_replicas

    @property
    def world_size(self) -> int:
        return self.num_replicas

    @property
    def group_sizes(self) -> tuple[int, ...]:
        return tuple(g for g in range(1, self.num_replicas + 1) if self.num_replicas % g == 0)

    @property
    def is_member(self) -> bool:
        return True

    def _size(self, group_size: int | None) -> int:
        """``group_size`` resolved (``None``: all replicas) and checked."""
        check("group_size", group_size, _GROUP_SIZE, sizes=self.group_sizes, replicas=self.num_replicas)
        return self.num_replicas if group_size is None else group_size


_STACKED = ("simulated, every tensor is stacked [{rows}, *shape] (one row per rank): pass tensors of {rows} rows, or "
            "a SimulatedCollective of as many replicas as they have rows.")
"""Why :meth:`SimulatedCollective.check_stacked` refuses a tensor."""


class SimulatedCollective(ReplicaGroups, Collective):
    """Mean over ``num_replicas`` simulated ranks stacked on a leading axis.

    Every tensor passed to :meth:`mean_` has shape ``[num_replicas, *shape]``; row
    ``r`` is rank ``r``'s value. The mean is computed as a sum then one division in
    the tensor's dtype, as :class:`DistributedCollective` does over Gloo.

    Args:
        num_replicas: the number of simulated ranks, ``>= 1``.

    Raises:
        ValueError: ``num_replicas < 1``.
    """

    def mean_(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        group_size: int | None = None,
        async_op: bool = False,
        context: str = "",
    ) -> CollectiveHandle | None:
        """Average each ``[R, *shape]`` tensor in place within blocks of
        ``group_size`` consecutive replicas (``None``: all ``R``), with the division
        rule of :class:`DistributedCollective` (``context`` is accepted for the same
        signature: one process cannot disagree with itself).

        Raises:
            TypeError, ValueError: a tensor that cannot be averaged, ``group_size``
                does not divide ``R``, or a tensor's leading dimension is not ``R``
                (checked for all before any is written).
        """
        del context
        tensors = checked_for_reduction(tensors)
        size = self._size(group_size)
        self.check_stacked(tensors)
        with torch.no_grad():
            for tensor in tensors:
                tensor.copy_(block_mean(tensor.detach(), size))
        return CollectiveHandle() if async_op else None

    def mean(
        self, tensors: Sequence[torch.Tensor], *, group_size: int | None = None, context: str = ""
    ) -> list[torch.Tensor]:
        """New ``[R, *shape]`` tensors holding the means of :meth:`mean_`; the inputs
        are only read. Differentiable (plain torch operations)."""
        del context
        tensors = checked_for_reduction(tensors, in_place=False)
        size = self._size(group_size)
        self.check_stacked(tensors)
        return [block_mean(tensor, size) for tensor in tensors]

    def check_stacked(self, tensors: Sequence[torch.Tensor], *, arg: str = "tensors") -> None:
        """Raise ``ValueError`` naming ``arg`` (an argument's name, or what the tensors
        are) unless every tensor is stacked ``[num_replicas, *shape]`` (one row per
        simulated rank)."""
        check_stacked(tensors, self.num_replicas, arg=arg, noun="tensor", why=_STACKED)

    def value_digests(self, tensors: Sequence[torch.Tensor], *, what: str, context: str = "") -> list[list[int]]:
        """Each replica's digests of its row of each ``[R, *shape]`` tensor (see
        :meth:`~puredist.Collective.value_digests`; ``context`` as for :meth:`mean_`).

        Raises:
            ValueError: a tensor's leading dimension is not ``R`` (as :meth:`check_stacked`).
        """
        del context
        self.check_stacked(tensors, arg=what)
        return replica_digests(tensors, self.num_replicas)


def replica_digests(stacked: Sequence[torch.Tensor | None], num_replicas: int) -> list[list[int]]:
    """Row ``r``: for each ``[num_replicas, *shape]`` tensor of ``stacked``, 0 where
    replica ``r``'s row is bit for bit replica 0's, else 1 (0 for ``None``: a tensor the
    same on every replica by construction). All the replicas are in this process, so
    the rows are compared where they live, against replica 0's (row 0 reads all 0):
    one small host read per tensor, no copy of the values to the host."""
    columns = [[0] * num_replicas if t is None else _differs_from_first(t, num_replicas) for t in stacked]
    return [[column[r] for column in columns] for r in range(num_replicas)]


def _differs_from_first(stacked: torch.Tensor, num_replicas: int) -> list[int]:
    rows = stacked.detach().contiguous().reshape(num_replicas, -1).view(torch.uint8)  # (bits: NaN equals NaN)
    return (rows != rows[:1]).any(dim=1).int().tolist()
