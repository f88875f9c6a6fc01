"""Mean over real ranks: :class:`DistributedCollective`, over ``torch.distributed``
process groups (Gloo, NCCL, ...), and its differentiable mean (:class:`AllReduceMean`).

It writes the mean into the tensors' own storage (``data_ptr()`` never changes),
reducing bounded staging buckets of one device and dtype (no promotion, see
:mod:`puredist.staging`), with no device synchronization, after checking that every
rank passes the same tensors and the same context (schedule and step,
:mod:`puredist._consistency`). A tensor is written only once its bucket's all-reduce
has succeeded, so a failure leaves every element at its old value or its mean
(:class:`~puredist.CollectiveError` says which).

This module must not be imported by :mod:`puredist.collectives.base` (the protocol
every backend shares).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist

from puredist._consistency import check_same_on_all_ranks, gather_value_digests, refuse_on_all_ranks, start_rank_check
from puredist._groups import mesh_groups, subgroups_of
from puredist._host_groups import averages_natively, backends_by_device, make_twins
from puredist._inputs import checked, checked_for_reduction, checked_like
from puredist._layout import Checked
from puredist._validation import POSITIVE_INTS, check, check_bucket_cap_bytes
from puredist.collectives.base import SUPPORTED_GROUP_SIZE, Collective, divides_first, refusing
from puredist.staging.pool import DEVICE_BUCKET_CAP_BYTES, HOST_BUCKET_CAP_BYTES, StagingPool
from puredist.staging.run import CollectiveHandle, StagingOptions, run_staged

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "BROADCAST_IN_PLACE_MIN_BYTES",
    "DEFAULT_BUCKET_CAP_BYTES",
    "DEFAULT_DEVICE_BUCKET_CAP_BYTES",
    "AllReduceMean",
    "DistributedCollective",
]

BROADCAST_IN_PLACE_MIN_BYTES = 2**20
"""A broadcast source sends contiguous tensors from this size up from their own
storage (receivers still stage them, so a failed receive leaves them untouched)."""

DEFAULT_BUCKET_CAP_BYTES = HOST_BUCKET_CAP_BYTES
"""Staging memory one averaging of host tensors may use beyond the parameters: 32 MiB."""

DEFAULT_DEVICE_BUCKET_CAP_BYTES = DEVICE_BUCKET_CAP_BYTES
"""The same for tensors that go over NCCL: 256 MiB (a collective's launch costs tens
of microseconds of host time there: fewer, larger buckets)."""


def _cap_options(bucket_cap_bytes: int | None, backends: Mapping[str, str]) -> str:
    """The staging caps as the rank check compares them: the caps in effect, so that a
    collective given the default's value equals one given none."""
    if bucket_cap_bytes is not None:
        return f"bucket_cap_bytes={bucket_cap_bytes}"
    if "nccl" in backends.values():
        return f"bucket_cap_bytes={HOST_BUCKET_CAP_BYTES} (NCCL's tensors: {DEVICE_BUCKET_CAP_BYTES})"
    return f"bucket_cap_bytes={HOST_BUCKET_CAP_BYTES}"


def _runs_eagerly(method):
    """Keep ``torch.compile`` out of a method that talks to other ranks: it runs as
    written, between the compiled graphs (dynamo tracing through its staging buffers,
    rank check and backend calls broke it into pieces that averaged the wrong values).
    Decided per call, so that eager code never imports the compiler."""

    @functools.wraps(method)
    def runs_eagerly(*args, **kwargs):
        if torch.compiler.is_compiling():  # dynamo is tracing this call: it runs between the graphs
            return torch.compiler.disable(method, recursive=True)(*args, **kwargs)
        return method(*args, **kwargs)

    return runs_eagerly


class _WithOptions(NamedTuple):
    """A rank-check context with the collective's own options before it, formatted
    only when the check runs (the caller's context may be a lazily formatted object)."""

    options: str
    context: object

    def __str__(self) -> str:
        return f"{self.options}; {self.context}" if str(self.context) else self.options


class DistributedCollective(Collective):
    """Mean over real ranks of a ``torch.distributed`` process group.

    Args:
        process_group: the whole group; ``None`` means the default (WORLD) group.
        subgroups: for hierarchical averaging, this rank's subgroup for each group
            size ``g`` (as made by ``dist.new_subgroups(g, group=process_group)``);
            see :meth:`with_subgroups`.
        bucket_cap_bytes: staging memory an averaging may use beyond the
            parameters, per device, kept between calls (allocated at the first, as
            large as that call needs, up to the cap). Tensors are packed into buckets
            of half of it, so that the copy into one bucket overlaps the all-reduce of
            the previous one. ``None``: :data:`DEFAULT_DEVICE_BUCKET_CAP_BYTES`
            (256 MiB) for the tensors the group reduces over NCCL, where each
            collective's launch costs tens of microseconds of host time, and
            :data:`DEFAULT_BUCKET_CAP_BYTES` (32 MiB) for the others (host tensors; a
            GPU's over Gloo, whose copies through the host overlap between buckets).
        check_consistency: verify, with one small all-gather per averaging, that
            every rank passes the same tensors (raises instead of hanging). The
            all-gather is of host tensors, over the group itself when it has a CPU
            backend or over a Gloo twin of a device-only (NCCL) group; see
            :mod:`puredist._host_groups` for which groups have one. On the whole
            world of a device-only backend, every rank constructs its collective
            (collectively: the twin is created here).

    Raises:
        ValueError: ``bucket_cap_bytes < 1``; no process group was initialized (torch's
            own error, from ``dist.get_rank``).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        subgroups: Mapping[int, dist.ProcessGroup] | None = None,
        bucket_cap_bytes: int | None = None,
        check_consistency: bool = True,
    ) -> None:
        if bucket_cap_bytes is not None:
            check_bucket_cap_bytes(bucket_cap_bytes)
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.bucket_cap_bytes = bucket_cap_bytes
        self.check_consistency = check_consistency
        self._is_member = dist.get_rank(self.process_group) >= 0
        self._world_size = dist.get_world_size(self.process_group) if self._is_member else 0
        self._groups: dict[int, dist.ProcessGroup] = dict(subgroups or {})
        self._groups[self._world_size] = self.process_group
        self._group_sizes = tuple(sorted(self._groups))  # (read by every call's group_size check)
        backends = backends_by_device(self.process_group) if self._is_member else None
        self._pool = StagingPool(bucket_cap_bytes, backends=backends)
        self._options = _cap_options(bucket_cap_bytes, backends or {})
        if check_consistency and self.process_group is dist.group.WORLD:  # every rank builds it: a device-only
            # world gets its Gloo twin for the check
            make_twins([range(dist.get_world_size())], like=self.process_group)

    @classmethod
    def with_subgroups(
        cls, group_sizes: Sequence[int], process_group: dist.ProcessGroup | None = None, **kwargs
    ) -> "DistributedCollective":
        """Get the subgroups of each size in ``group_sizes`` (see ``subgroup``:
        created collectively on first use, then reused) and return a collective
        using them.

        Raises:
            ValueError: a size that is not a positive int, or does not divide the
                group's size (from torch).
        """
        group_sizes = list(group_sizes)  # (an iterator is read once)
        check("group_sizes", group_sizes, POSITIVE_INTS)
        whole = process_group if process_group is not None else dist.group.WORLD
        return cls(process_group, subgroups=subgroups_of(whole, group_sizes), **kwargs)

    @classmethod
    def from_mesh(cls, mesh: "DeviceMesh", dims: str | Sequence[str], **kwargs) -> "DistributedCollective":
        """Average across the ranks that differ only in the mesh dimension(s) ``dims``:
        e.g. ``from_mesh(mesh, "replicate")`` on a ``("replicate", "shard")`` mesh
        averages each FSDP2 shard with the same shard of the other replica groups.

        With several dimensions, outermost first (``("dc", "replicate")``), the whole
        group spans all of them and each inner suffix is a subgroup for hierarchical
        averaging: group sizes ``|replicate|`` and ``|dc| * |replicate|``; then every
        rank of the default group must call this with the whole mesh (groups spanning
        several dimensions are created collectively, once per set of ranks). So must
        it for one dimension on a device-only (NCCL) mesh: the groups' Gloo twins for
        the rank check are created together.
        ``kwargs`` go to the constructor.

        Raises:
            ValueError: an unknown or repeated dimension name, or none; several
                dimensions of a mesh that does not cover every rank (a slice).
        """
        whole, subgroups = mesh_groups(mesh, dims)
        return cls(whole, subgroups=subgroups, **kwargs)

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def group_sizes(self) -> tuple[int, ...]:
        return self._group_sizes

    @property
    def is_member(self) -> bool:
        return self._is_member

    def _group(self, group_size: int | None) -> dist.ProcessGroup:
        """The process group of ``group_size`` (``None``: the whole group), checked."""
        check("group_size", group_size, SUPPORTED_GROUP_SIZE, sizes=self.group_sizes)
        return self._groups[self._world_size if group_size is None else group_size]

    @_runs_eagerly
    def mean_(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        group_size: int | None = None,
        async_op: bool = False,
        context: str = "",
    ) -> CollectiveHandle | None:
        """Average ``tensors`` in place over this rank's group of ``group_size``.

        Args:
            tensors: dense floating-point or complex tensors, no two sharing memory,
                the same devices, dtypes and shapes in the same order on every rank.
            group_size: ``None`` for the whole group, else one of
                ``group_sizes``.
            async_op: return a :class:`CollectiveHandle` at once instead of waiting.
                Every bucket is then staged at once (memory: the tensors' size), and
                :meth:`CollectiveHandle.wait` writes all results or none.
            context: more that must be equal on every rank (the caller's schedule
                and step); part of the rank check.

        Returns:
            ``None``, or the handle when ``async_op``.

        Raises:
            TypeError, ValueError: a tensor that cannot be averaged, or an unknown
                ``group_size`` — before anything is communicated.
            RankMismatchError: on every rank, when ranks pass different tensors or
                contexts; nothing is changed.
            CollectiveError: an all-reduce failed (a peer died, a timeout); every
                element holds its old value or its mean, as the error details.
        """
        with refusing(self, group_size=group_size, context=context):
            given = checked(tensors)
        group = self._group(group_size) if self._is_member else None
        if group is None or dist.get_world_size(group) == 1:
            return CollectiveHandle() if async_op else None
        return self._average_over(group, given, async_op=async_op, context=context)

    def refuse_on_all_ranks(self, reason: str, *, group_size: int | None = None, context: object = "") -> None:
        """Take part, refusing for ``reason``, in the rank check that this rank's peers
        in the group of ``group_size`` run before their averaging: they raise
        :class:`~puredist.RankMismatchError` at once, its message showing ``reason``,
        instead of waiting for this rank until the backend's timeout. Returns (the
        caller then raises its own error); a no-op where nothing is checked (as
        :meth:`check_same_on_all_ranks`)."""
        refuse_on_all_ranks(self.check_same_on_all_ranks, reason, group_size=group_size, context=context)

    def _average_over(self, group: dist.ProcessGroup, given: Checked, *, async_op: bool, context: str) -> CollectiveHandle | None:
        """:meth:`mean_` over ``group`` once the tensors are checked, at any group size."""
        size = dist.get_world_size(group)
        # the tensors as passed: a DTensor's sharding is part of the check, finished while the first bucket packs
        finish_check = self._start_check(given, group, context=context, what="one averaging all-reduce")

        native = functools.cache(lambda device: averages_natively(group, device))  # (per bucket: read once a device)

        def scales(buffer: torch.Tensor) -> tuple[int | None, int | None]:
            if divides_first(buffer.dtype):
                return size, None
            return None, (None if native(buffer.device) else size)

        def launch(buffer: torch.Tensor):
            average = native(buffer.device) and not divides_first(buffer.dtype)
            op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
            return dist.all_reduce(buffer, op=op, group=group, async_op=True)

        options = StagingOptions(f"Averaging over {size} ranks", scales=scales, bucket_cap_bytes=self.bucket_cap_bytes)
        return run_staged(given.reduced, launch, options, pool=self._pool, async_op=async_op, layout=given.layout,
                          gate=finish_check)

    @_runs_eagerly
    def mean(
        self, tensors: Sequence[torch.Tensor], *, group_size: int | None = None, context: str = ""
    ) -> list[torch.Tensor]:
        """New tensors holding the means (see :meth:`mean_`); ``tensors`` are only
        read. Differentiable: the backward averages the gradients over the same group,
        so every rank must run it (as with DDP). Not usable under ``torch.func.vmap``
        (simulated ranks take :class:`~puredist.VmapCollective`).

        Raises:
            as :meth:`mean_`.
        """
        with refusing(self, group_size=group_size, context=context):
            checked_for_reduction(tensors, in_place=False)  # refused before anything is copied
        return list(AllReduceMean.apply(self, group_size, context, *tensors))

    @_runs_eagerly
    def check_same_on_all_ranks(self, tensors: Sequence[torch.Tensor], *, context: str, what: str,
                                group_size: int | None = None) -> None:
        """Raise :class:`~puredist.RankMismatchError` on every rank of the group of
        ``group_size`` (``None``: the whole group) unless all pass tensors of the same
        layouts and the same ``context`` (one small all-gather); if its own collective
        fails (a peer is gone), a :class:`CollectiveError` saying that nothing was
        changed. A no-op where nothing is checked: ``check_consistency`` off, not a
        member, one rank, no group of that size."""
        check_same_on_all_ranks(tensors, self._group_to_check(group_size),
                                layout=tensors.layout if isinstance(tensors, Checked) else None,
                                context=_WithOptions(self._options, context), what=what)

    def _group_to_check(self, group_size: int | None) -> dist.ProcessGroup | None:
        """The group of ``group_size`` that :meth:`check_same_on_all_ranks` checks:
        ``None`` where it checks nothing (``check_consistency`` off, not a member, no
        group of that size)."""
        if not (self.check_consistency and self._is_member):
            return None
        return self._groups.get(self._world_size if group_size is None else group_size)

    def _start_check(self, given: Checked, group: dist.ProcessGroup, *, context: str, what: str
                     ) -> Callable[[], None] | None:
        """The rank check of :meth:`check_same_on_all_ranks` over ``group``, begun: this
        rank's summary is sent, and the call returned finishes the check (raising as
        :meth:`check_same_on_all_ranks` does, with this collective's options that shape
        the messages, the bucket cap, in the context); ``None``
        where nothing is checked. Nothing may be sent between the two."""
        if not self.check_consistency:
            return None
        return start_rank_check(given, group, layout=given.layout, context=_WithOptions(self._options, context),
                                what=what).finish

    @_runs_eagerly
    def value_digests(self, tensors: Sequence[torch.Tensor], *, what: str, context: str = "") -> list[list[int]]:
        """Every rank's digests of ``tensors``' values (see
        :meth:`~puredist.Collective.value_digests`, whose comparison
        :meth:`check_replicated` is): after the usual rank check over the whole group
        (layouts and ``context``, so that a rank elsewhere in its schedule cannot pair
        its collectives with this one), a digest of each tensor's bytes, hashed on the
        host, goes through one small all-gather."""
        if not self._is_member or self._world_size == 1:
            return []
        self.check_same_on_all_ranks(tensors, context=context, what=what)
        return gather_value_digests(tensors, self.process_group)

    @property
    def rank(self) -> int:
        """This process's rank within the whole group (-1 outside it)."""
        return dist.get_rank(self.process_group)

    @_runs_eagerly
    def broadcast_(
        self, tensors: Sequence[torch.Tensor], *, src: int, async_op: bool = False
    ) -> CollectiveHandle | None:
        """Overwrite ``tensors`` on every rank with rank ``src``'s values (``src`` is
        a rank *within* the whole group), in the same bounded staging buckets as
        :meth:`mean_`: a receiver's tensor is written only once its bucket has
        arrived whole.

        The caller guarantees the same tensor layouts on every rank (no check here:
        the ZeRO step checks its plan and gradients before it updates anything).

        Raises:
            CollectiveError: a broadcast failed; every element holds its old value
                or ``src``'s, as the error details.
        """
        given = checked(tensors)
        if not self._is_member or self._world_size == 1:
            return CollectiveHandle() if async_op else None
        group = self.process_group
        is_source = dist.get_rank(group) == src
        global_src = dist.get_global_rank(group, src)
        options = StagingOptions(f"Broadcast from rank {src}", pack=is_source, write_back=not is_source,
                                 bucket_cap_bytes=self.bucket_cap_bytes, alone_from=BROADCAST_IN_PLACE_MIN_BYTES)
        return run_staged(
            given.reduced, lambda buffer: dist.broadcast(buffer, src=global_src, group=group, async_op=True), options,
            pool=self._pool, async_op=async_op, layout=given.layout,
        )


class AllReduceMean(torch.autograd.Function):
    """``DistributedCollective.mean`` as a differentiable function: forward averages
    copies of the inputs, backward averages the incoming gradients over the same
    group (every rank runs the backward, as every rank ran the forward).

    Not usable under ``torch.func.vmap`` (each process is one rank): its ``vmap`` rule
    raises and names :class:`~puredist.VmapCollective`."""

    @staticmethod
    def forward(collective: "DistributedCollective", group_size: int | None, context: str, *tensors: torch.Tensor):
        copies = [t.detach().clone() for t in tensors]
        collective.mean_(checked_like(tensors, copies, why="clone"), group_size=group_size, context=context)
        return tuple(copies)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.collective, ctx.group_size, ctx.context = inputs[:3]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        # the function again (under torch.func its forward sees plain tensors): and
        # so differentiable twice
        means = AllReduceMean.apply(ctx.collective, ctx.group_size, f"backward of {ctx.context}", *grads)
        return (None, None, None, *means)

    @staticmethod
    def vmap(info, in_dims, *args):
        raise ValueError(
            "A DistributedCollective cannot average inside torch.func.vmap (each process is one rank); "
            "for simulated ranks mapped by vmap use puredist.VmapCollective(num_replicas)."
        )
