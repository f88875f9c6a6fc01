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

from puredist._inputs import checked_for_reduction
from puredist._validation import AT_LEAST_ONE, check
from puredist.collectives.base import block_mean
from puredist.errors import RankMismatchError
from puredist.staging import CollectiveHandle

__all__ = ["ReplicaGroups", "SimulatedCollective"]


class ReplicaGroups:
    """What the one-process backends share: ``num_replicas`` simulated ranks, grouped
    in blocks of consecutive replicas as ``dist.new_subgroups`` groups ranks.

    Args:
        num_replicas: the number of simulated ranks, ``>= 1``.

    Raises:
        ValueError: ``num_replicas < 1``.
    """

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
        size = self.num_replicas if group_size is None else group_size
        if isinstance(size, bool) or not isinstance(size, int) or size not in self.group_sizes:
            raise ValueError(
                f"Arg ``group_size`` {group_size} must divide the number of replicas {self.num_replicas}."
            )
        return size


def _named(arg: str) -> str:
    """``arg`` as a message's subject: an argument's name (an identifier) quoted as one."""
    return f"Arg ``{arg}``" if arg.isidentifier() else arg


class SimulatedCollective(ReplicaGroups):
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
        size = self._checked_size(tensors, group_size)
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
        size = self._checked_size(tensors, group_size)
        return [block_mean(tensor, size) for tensor in tensors]

    def _checked_size(self, tensors: Sequence[torch.Tensor], group_size: int | None) -> int:
        size = self._size(group_size)
        self.check_stacked(tensors)
        return size

    def check_stacked(self, tensors: Sequence[torch.Tensor], *, arg: str = "tensors") -> None:
        """Raise ``ValueError`` naming ``arg`` (an argument's name, or what the tensors
        are) unless every tensor is stacked ``[num_replicas, *shape]`` (one row per
        simulated rank)."""
        for position, tensor in enumerate(tensors):
            if tensor.dim() == 0 or tensor.shape[0] != self.num_replicas:
                raise ValueError(
                    f"{_named(arg)}: tensor {position} has shape {tuple(tensor.shape)}; simulated, every tensor is "
                    f"stacked [{self.num_replicas}, *shape] (one row per rank): pass tensors of {self.num_replicas} "
                    "rows, or a SimulatedCollective of as many replicas as they have rows."
                )

    def check_replicated(self, tensors: Sequence[torch.Tensor], *, what: str, context: str = "") -> None:
        """Raise :class:`~puredist.RankMismatchError` unless every replica (row) of
        each ``[R, *shape]`` tensor is bit-identical to the first.

        Raises:
            ValueError: a tensor's leading dimension is not ``R`` (as :meth:`check_stacked`).
        """
        del context
        self.check_stacked(tensors, arg=what)
        rows = [t.detach().contiguous().reshape(self.num_replicas, -1).view(torch.uint8) for t in tensors]
        differing = [i for i, r in enumerate(rows) if not torch.equal(r, r[:1].expand_as(r))]
        if differing:
            raise RankMismatchError.of_values(differing, len(tensors), what, simulated=True)
