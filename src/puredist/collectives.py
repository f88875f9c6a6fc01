"""Collectives as an explicit argument: the mean over a group of ranks.

Two backends implement the same small protocol, :class:`Collective`:

- :class:`DistributedCollective`: real ranks over ``torch.distributed`` process
  groups (Gloo, NCCL, ...). It averages in place in the tensors' own storage
  (``data_ptr()`` never changes), in bounded buckets of one device and dtype (no
  promotion), as SUM followed by one division (NCCL: its native ``AVG``), with no
  device synchronization, after checking that every rank passes the same tensors.
- :class:`SimulatedCollective`: ``R`` ranks in one process. Every tensor carries a
  leading replica axis ``[R, *shape]``; the mean is taken within contiguous groups
  of replicas, exactly as ``dist.new_subgroups`` groups ranks. It is what
  ``vmap(axis_name=...)`` with ``lax.pmean`` gives JAX users: the same pure code
  runs ``R`` ranks at once, for property-based tests.

In both, ``group_size`` selects the level: ``None`` (or the full size) averages
over the whole group; a smaller ``g`` averages within each block of ``g``
consecutive ranks.
"""

from __future__ import annotations

from collections import deque
from typing import Mapping, Protocol, Sequence

import torch
import torch.distributed as dist

from puredist._buckets import Bucket, plan_buckets
from puredist._consistency import check_same_tensors_on_all_ranks
from puredist._validation import check_bucket_cap_bytes

DEFAULT_BUCKET_CAP_BYTES = 32 * 2**20
"""Staging memory one averaging may use beyond the parameters: 32 MiB."""


class Collective(Protocol):
    """What the averaging functions need from a backend.

    Attributes:
        world_size: number of ranks in the whole group.
        group_sizes: the group sizes ``mean_`` accepts (always includes
            ``world_size``).
        is_member: whether this process takes part (``False``: ``mean_`` is a no-op).
    """

    @property
    def world_size(self) -> int: ...

    @property
    def group_sizes(self) -> tuple[int, ...]: ...

    @property
    def is_member(self) -> bool: ...

    def mean_(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        group_size: int | None = None,
        async_op: bool = False,
    ) -> "CollectiveHandle | None":
        """Replace each tensor, in place, by its mean over the group of ``group_size``
        ranks this rank belongs to; with ``async_op`` return a handle to wait on."""
        ...


class CollectiveHandle:
    """Collectives still in flight; :meth:`wait` completes them, in issue order.

    The tensors must not be read or written until :meth:`wait` returns.
    """

    def __init__(self, pending: "deque[_InFlight]") -> None:
        self._pending = pending

    @classmethod
    def merged(cls, handles: Sequence["CollectiveHandle"]) -> "CollectiveHandle":
        """One handle completing ``handles``' collectives, in order."""
        return cls(deque(item for handle in handles for item in handle._pending))

    def is_completed(self) -> bool:
        """True once :meth:`wait` has finished every collective."""
        return not self._pending

    def wait(self) -> None:
        """Block until every collective is done and written into its tensors."""
        while self._pending:
            self._pending.popleft().finish()


class _InFlight:
    """One bucket's collective: the buffer it runs on and how to write it back.

    Args:
        bucket: the tensors' positions and whether they are staged.
        tensors: the full tensor list the bucket indexes.
        launch: issues the asynchronous collective on a buffer, returns its work.
        packed: whether a staging buffer starts with the tensors' values (else it
            starts empty: the collective only writes it, as a broadcast receiver).
        divisor: divide the result by this after the collective (``None``: no).
        write_back: copy the result into the tensors (a broadcast source does not).
    """

    def __init__(self, bucket: Bucket, tensors, launch, *, packed: bool, divisor: int | None, write_back: bool):
        self.bucket = bucket
        self._targets = [tensors[i].detach() for i in bucket.indices]
        if not bucket.staged:
            self._buffer = self._targets[0]
        elif packed:
            self._buffer = torch.cat([t.reshape(-1) for t in self._targets])
        else:
            first = self._targets[0]
            self._buffer = torch.empty(sum(t.numel() for t in self._targets), dtype=first.dtype, device=first.device)
        self._divisor = divisor
        self._write_back = write_back
        self._work = launch(self._buffer)

    def finish(self) -> None:
        self._work.wait()
        if self._divisor is not None:
            self._buffer.div_(self._divisor)
        if self.bucket.staged and self._write_back:
            pieces = self._buffer.split([t.numel() for t in self._targets])
            torch._foreach_copy_(self._targets, [p.view_as(t) for p, t in zip(pieces, self._targets)])
        # release the staging buffer now (and here, on the training thread)
        self._buffer = self._work = None


def _run_bucketed(
    tensors: Sequence[torch.Tensor], bucket_cap_bytes: int, launch, *, async_op: bool, **in_flight
) -> CollectiveHandle | None:
    """Issue ``launch`` over the bucket plan of ``tensors`` in order, keeping at most
    ``bucket_cap_bytes`` of staging memory in flight (unbounded with ``async_op``,
    which returns the handle instead of waiting)."""
    pending: deque[_InFlight] = deque()
    staged_in_flight = 0
    for bucket in plan_buckets(tensors, max(1, bucket_cap_bytes // 2)):
        while not async_op and pending and staged_in_flight + bucket.nbytes > bucket_cap_bytes:
            done = pending.popleft()
            done.finish()
            staged_in_flight -= done.bucket.nbytes
        pending.append(_InFlight(bucket, tensors, launch, **in_flight))
        staged_in_flight += bucket.nbytes
    handle = CollectiveHandle(pending)
    if async_op:
        return handle
    handle.wait()
    return None


class DistributedCollective:
    """Mean over real ranks of a ``torch.distributed`` process group.

    Args:
        process_group: the whole group; ``None`` means the default (WORLD) group.
        subgroups: for hierarchical averaging, this rank's subgroup for each group
            size ``g`` (as made by ``dist.new_subgroups(g, group=process_group)``);
            see :meth:`with_subgroups`.
        bucket_cap_bytes: staging memory an averaging may use beyond the
            parameters. Tensors are packed into buckets of half of it, so that the
            copy into one bucket overlaps the all-reduce of the previous one.
        check_consistency: verify, with one small all-gather per averaging, that
            every rank passes the same tensors (raises instead of hanging).

    Raises:
        ValueError: ``bucket_cap_bytes < 1``; no process group was initialized.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        subgroups: Mapping[int, dist.ProcessGroup] | None = None,
        bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
        check_consistency: bool = True,
    ) -> None:
        check_bucket_cap_bytes(bucket_cap_bytes)
        if not dist.is_initialized():
            raise ValueError("DistributedCollective needs torch.distributed.init_process_group() first.")
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.bucket_cap_bytes = bucket_cap_bytes
        self.check_consistency = check_consistency
        self._is_member = dist.get_rank(self.process_group) >= 0
        self._world_size = dist.get_world_size(self.process_group) if self._is_member else 0
        self._groups: dict[int, dist.ProcessGroup] = dict(subgroups or {})
        self._groups[self._world_size] = self.process_group

    @classmethod
    def with_subgroups(
        cls, group_sizes: Sequence[int], process_group: dist.ProcessGroup | None = None, **kwargs
    ) -> "DistributedCollective":
        """Create (collectively, on every rank) the subgroups of each size in
        ``group_sizes`` with ``dist.new_subgroups`` and return a collective using them.

        Raises:
            ValueError: a size does not divide the group's size (from torch).
        """
        whole = process_group if process_group is not None else dist.group.WORLD
        world_size = dist.get_world_size(whole)
        subgroups = {
            size: dist.new_subgroups(group_size=size, group=whole)[0]
            for size in dict.fromkeys(group_sizes)
            if size != world_size
        }
        return cls(process_group, subgroups=subgroups, **kwargs)

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def group_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._groups))

    @property
    def is_member(self) -> bool:
        return self._is_member

    def _group(self, group_size: int | None) -> dist.ProcessGroup:
        size = self._world_size if group_size is None else group_size
        if size not in self._groups:
            raise ValueError(
                f"Arg ``group_size`` {group_size} has no process group here; this "
                f"collective averages within groups of sizes {self.group_sizes} "
                "(build it with DistributedCollective.with_subgroups)."
            )
        return self._groups[size]

    def mean_(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        group_size: int | None = None,
        async_op: bool = False,
    ) -> CollectiveHandle | None:
        """Average ``tensors`` in place over this rank's group of ``group_size``.

        Args:
            tensors: floating-point tensors, the same devices, dtypes and shapes in
                the same order on every rank of the group.
            group_size: ``None`` for the whole group, else one of
                :attr:`group_sizes`.
            async_op: return an :class:`CollectiveHandle` at once instead of
                waiting. All buckets are then in flight together, so the staging
                memory is that of every tensor that is not reduced in place.

        Returns:
            ``None``, or the handle when ``async_op``.

        Raises:
            ValueError: unknown ``group_size``.
            RankMismatchError: on every rank, when ranks pass different tensors.
        """
        group = self._group(group_size) if self._is_member else None
        if group is None or dist.get_world_size(group) == 1:
            return CollectiveHandle(deque()) if async_op else None
        tensors = list(tensors)
        self._check_same(tensors, group, context="", what="one averaging all-reduce")
        divisor = None if dist.get_backend(group) == "nccl" else dist.get_world_size(group)
        op = dist.ReduceOp.SUM if divisor is not None else dist.ReduceOp.AVG
        return _run_bucketed(
            tensors,
            self.bucket_cap_bytes,
            lambda buffer: dist.all_reduce(buffer, op=op, group=group, async_op=True),
            async_op=async_op,
            packed=True,
            divisor=divisor,
            write_back=True,
        )

    def check_same_on_all_ranks(self, tensors: Sequence[torch.Tensor], *, context: str, what: str) -> None:
        """Raise :class:`~puredist.RankMismatchError` on every rank of the whole group
        unless all pass tensors of the same layouts and the same ``context`` (one
        small all-gather; skipped when ``check_consistency`` is off)."""
        if self._is_member and self._world_size > 1:
            self._check_same(list(tensors), self.process_group, context=context, what=what)

    def _check_same(self, tensors: list[torch.Tensor], group: dist.ProcessGroup, *, context: str, what: str) -> None:
        if self.check_consistency:
            check_same_tensors_on_all_ranks(tensors, group, _summary_device(group), context=context, what=what)

    @property
    def rank(self) -> int:
        """This process's rank within the whole group (-1 outside it)."""
        return dist.get_rank(self.process_group)

    def broadcast_(
        self, tensors: Sequence[torch.Tensor], *, src: int, async_op: bool = False
    ) -> CollectiveHandle | None:
        """Overwrite ``tensors`` on every rank with rank ``src``'s values (``src`` is
        a rank *within* the whole group), in the same bounded buckets as
        :meth:`mean_`; contiguous tensors of 1 MiB or more are received in place.

        The caller guarantees the same tensor layouts on every rank (no check here:
        the ZeRO step checks its plan and gradients before it updates anything).
        """
        if not self._is_member or self._world_size == 1:
            return CollectiveHandle(deque()) if async_op else None
        group = self.process_group
        is_source = dist.get_rank(group) == src
        global_src = dist.get_global_rank(group, src)
        return _run_bucketed(
            list(tensors),
            self.bucket_cap_bytes,
            lambda buffer: dist.broadcast(buffer, src=global_src, group=group, async_op=True),
            async_op=async_op,
            packed=is_source,
            divisor=None,
            write_back=not is_source,
        )


def _summary_device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class SimulatedCollective:
    """Mean over ``num_replicas`` simulated ranks stacked on a leading axis.

    Every tensor passed to :meth:`mean_` has shape ``[num_replicas, *shape]``; row
    ``r`` is rank ``r``'s value. The mean is computed as a sum then one division in
    the tensor's dtype, as :class:`DistributedCollective` does over Gloo.

    Args:
        num_replicas: the number of simulated ranks, ``>= 1``.

    Raises:
        ValueError: ``num_replicas < 1``.
    """

    def __init__(self, num_replicas: int) -> None:
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"Arg ``num_replicas`` must be a positive int, got {num_replicas!r}.")
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

    def mean_(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        group_size: int | None = None,
        async_op: bool = False,
    ) -> CollectiveHandle | None:
        """Average each ``[R, *shape]`` tensor in place within blocks of
        ``group_size`` consecutive replicas (``None``: all ``R``).

        Raises:
            ValueError: ``group_size`` does not divide ``R``, or a tensor's leading
                dimension is not ``R`` (checked for all before any is written).
        """
        size = self.num_replicas if group_size is None else group_size
        if size not in self.group_sizes:
            raise ValueError(
                f"Arg ``group_size`` {group_size} must divide the number of replicas "
                f"{self.num_replicas}."
            )
        for tensor in tensors:
            if tensor.dim() == 0 or tensor.shape[0] != self.num_replicas:
                raise ValueError(
                    f"Every tensor needs a leading replica axis of size {self.num_replicas}, "
                    f"got shape {tuple(tensor.shape)}."
                )
        with torch.no_grad():
            for tensor in tensors:
                blocks = tensor.detach().unflatten(0, (self.num_replicas // size, size))
                blocks.copy_(blocks.sum(dim=1, keepdim=True).div_(size))
        return CollectiveHandle(deque()) if async_op else None
