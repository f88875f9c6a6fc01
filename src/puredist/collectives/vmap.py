"""Simulated ranks as a ``torch.func.vmap`` axis: JAX's ``pmean`` under ``vmap``.

One training-step function, written once for one rank, runs ``R`` simulated ranks in
one process under ``torch.func.vmap`` with a :class:`VmapCollective` and runs
unchanged on real ranks with a :class:`~puredist.DistributedCollective`::

    step = lambda params, batch, collective: ...  # calls puredist.average(..., collective=collective)
    vmap(step, in_dims=(0, 0, None))(stacked_params, stacked_batches, VmapCollective(R))
    step(params, batch, DistributedCollective())  # under torchrun

The replica axis is the innermost ``vmap`` around the call (other ``vmap`` levels
outside it batch whole simulations). The mean within groups of ``group_size``
consecutive replicas is the same division rule as the other backends
(:func:`~puredist.collectives.block_mean`); it is differentiable (the adjoint of a mean
is the mean of the gradients over the same group), composes with ``torch.func.grad``
(either side of the ``vmap``) and compiles with ``torch.compile(fullgraph=True)``.
The all-to-all and the all-gather of a compressed averaging are the batched tensor
with its replica axis swapped with its row axis, and the batched tensor itself seen
by every replica (not differentiable: their payloads are integers).

How: a ``torch.library`` custom operator whose ``vmap`` rule takes the mean over the
batched dimension (it sees all replicas at once there), wrapped in an
``autograd.Function`` whose backward is the operator again (``torch.library``'s own
autograd registration does not compose with ``torch.func.grad`` in torch 2.13).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.library import custom_op

from puredist._inputs import check_stacked, check_tensors, checked_for_reduction
from puredist._transforms import vmap_levels
from puredist._validation import BELOW, INT, Rule, check
from puredist.collectives.base import Collective, block_mean
from puredist.collectives.simulated import ReplicaGroups, replica_digests
from puredist.staging import CollectiveHandle

__all__ = ["VmapCollective", "replica_mean"]

_ONE_ROW_EACH = "an all-to-all over {rows} replicas sends one row to each, [{rows}, *shape]."
"""Why :meth:`VmapCollective.all_to_all` refuses a tensor (its rows, one per replica)."""


def _no_replica_axis(num_replicas: int, act: str, tensor: str = "a tensor") -> RuntimeError:
    """The error of a :class:`VmapCollective` that finds no replica axis to ``act`` over
    ``tensor``: outside ``torch.func.vmap``, or on a tensor its innermost ``vmap`` does
    not map. Every operation's outside-``vmap`` path raises it."""
    return RuntimeError(
        f"A VmapCollective over {num_replicas} replicas was used outside torch.func.vmap, or given {tensor}, which the "
        f"innermost torch.func.vmap (the replica axis) does not map: there is no replica axis to {act}. Vmap the step "
        "written for one replica over the stacked tensors, every tensor mapped (in_dims=None maps none: pass it "
        f"expanded), the replica axis the innermost vmap; for stacked [{num_replicas}, *shape] tensors outside vmap, "
        f"use SimulatedCollective({num_replicas})."
    )


@custom_op("puredist::replica_mean", mutates_args=())
def _replica_mean_op(tensor: torch.Tensor, group_size: int, num_replicas: int) -> torch.Tensor:
    """Outside ``vmap`` there is no replica axis: only a group of one is a mean."""
    if group_size != 1:
        raise _no_replica_axis(num_replicas, "average over")
    return tensor.clone()


@_replica_mean_op.register_fake
def _(tensor: torch.Tensor, group_size: int, num_replicas: int) -> torch.Tensor:
    return torch.empty_like(tensor)


_REPLICA_AXIS = Rule(lambda v, b: v == b["replicas"], ValueError,
                     "The VmapCollective has {replicas} replicas, but the innermost vmap around it maps over {value}.")
"""The replica axis's rule: the innermost ``vmap`` around a replica operation (its
batch size, the value checked) maps over the collective's ``replicas``."""


def _replica_mean_vmap(info, in_dims, tensor: torch.Tensor, group_size: int, num_replicas: int):
    dim = in_dims[0]  # functorch calls the rule only for a tensor mapped at this level
    check("vmap", info.batch_size, _REPLICA_AXIS, replicas=num_replicas)
    return block_mean(tensor.movedim(dim, 0), group_size), 0


_replica_mean_op.register_vmap(_replica_mean_vmap)


class _ReplicaMean(torch.autograd.Function):
    generate_vmap_rule = True  # vmap runs forward/backward, where the operator's rule applies

    @staticmethod
    def forward(tensor: torch.Tensor, group_size: int, num_replicas: int) -> torch.Tensor:
        return _replica_mean_op(tensor, group_size, num_replicas)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.sizes = inputs[1:]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _ReplicaMean.apply(grad, *ctx.sizes), None, None


def replica_mean(tensor: torch.Tensor, group_size: int, num_replicas: int) -> torch.Tensor:
    """Inside ``vmap`` over ``num_replicas`` replicas: the mean of ``tensor`` within
    this replica's group of ``group_size`` consecutive replicas.

    Raises:
        RuntimeError: outside ``vmap`` with ``group_size > 1``.
        ValueError: the innermost ``vmap`` does not map over ``num_replicas``, or
            ``group_size`` does not divide ``num_replicas`` (``num_replicas < 1``).
    """
    ReplicaGroups(num_replicas)._size(group_size)
    return _ReplicaMean.apply(tensor, group_size, num_replicas)


@custom_op("puredist::replica_select", mutates_args=())
def _replica_select_op(tensor: torch.Tensor, source: int, num_replicas: int) -> torch.Tensor:
    """Outside ``vmap`` there is no replica axis: only one replica has a value to give."""
    if num_replicas != 1:
        raise _no_replica_axis(num_replicas, f"take replica {source}'s value from")
    return tensor.clone()


@_replica_select_op.register_fake
def _(tensor: torch.Tensor, source: int, num_replicas: int) -> torch.Tensor:
    return torch.empty_like(tensor)


def _replica_select_vmap(info, in_dims, tensor: torch.Tensor, source: int, num_replicas: int):
    check("vmap", info.batch_size, _REPLICA_AXIS, replicas=num_replicas)
    rows = tensor.movedim(in_dims[0], 0)
    return rows[source].unsqueeze(0).expand_as(rows).contiguous(), 0


_replica_select_op.register_vmap(_replica_select_vmap)


@custom_op("puredist::replica_gather", mutates_args=())
def _replica_gather_op(tensor: torch.Tensor, source: int, num_replicas: int) -> torch.Tensor:
    """The adjoint of :func:`_replica_select_op`: outside ``vmap``, one replica's own."""
    if num_replicas != 1:
        raise _no_replica_axis(num_replicas, "sum a broadcast's gradient over")
    return tensor.clone()


@_replica_gather_op.register_fake
def _(tensor: torch.Tensor, source: int, num_replicas: int) -> torch.Tensor:
    return torch.empty_like(tensor)


def _replica_gather_vmap(info, in_dims, tensor: torch.Tensor, source: int, num_replicas: int):
    check("vmap", info.batch_size, _REPLICA_AXIS, replicas=num_replicas)
    rows = tensor.movedim(in_dims[0], 0)
    gathered = torch.zeros_like(rows)
    gathered[source] = rows.sum(0)  # every replica's copy of the source's value came from the source
    return gathered, 0


_replica_gather_op.register_vmap(_replica_gather_vmap)


class _ReplicaSelect(torch.autograd.Function):
    """Replica ``source``'s value on every replica (``gather=False``), or its adjoint
    (``gather=True``): the incoming gradients summed into the source, zero on the
    others. Each is the other's adjoint, so both are differentiable any number of times."""

    generate_vmap_rule = True

    @staticmethod
    def forward(tensor: torch.Tensor, source: int, num_replicas: int, gather: bool) -> torch.Tensor:
        return (_replica_gather_op if gather else _replica_select_op)(tensor, source, num_replicas)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.source, ctx.num_replicas, ctx.gather = inputs[1:]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _ReplicaSelect.apply(grad, ctx.source, ctx.num_replicas, not ctx.gather), None, None, None


@custom_op("puredist::replica_exchange", mutates_args=())
def _replica_exchange_op(tensor: torch.Tensor, transpose: bool, num_replicas: int) -> torch.Tensor:
    """Outside ``vmap`` there is no replica axis: one replica's own rows (an all-to-all,
    ``transpose``) or its value alone (an all-gather)."""
    if num_replicas != 1:
        raise _no_replica_axis(num_replicas, "exchange it over")
    return tensor.clone() if transpose else tensor.unsqueeze(0).clone()


@_replica_exchange_op.register_fake
def _(tensor: torch.Tensor, transpose: bool, num_replicas: int) -> torch.Tensor:
    return torch.empty_like(tensor) if transpose else tensor.new_empty((1, *tensor.shape))


def _replica_exchange_vmap(info, in_dims, tensor: torch.Tensor, transpose: bool, num_replicas: int):
    """Replica ``r``'s rows ``X[r]``: an all-to-all gives replica ``c`` the rows
    ``X[q, c]`` over ``q`` (the replica axis swapped with the row axis); an all-gather
    gives every replica all of ``X``."""
    check("vmap", info.batch_size, _REPLICA_AXIS, replicas=num_replicas)
    rows = tensor.movedim(in_dims[0], 0)
    if transpose:
        return rows.transpose(0, 1).contiguous(), 0
    return rows.unsqueeze(0).expand(num_replicas, *rows.shape).contiguous(), 0


_replica_exchange_op.register_vmap(_replica_exchange_vmap)


@custom_op("puredist::replica_index", mutates_args=())
def _replica_index_op(like: torch.Tensor, num_replicas: int) -> torch.Tensor:
    """Outside ``vmap``: the one replica, 0."""
    return torch.zeros((), dtype=torch.int64, device=like.device)


@_replica_index_op.register_fake
def _(like: torch.Tensor, num_replicas: int) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device=like.device)


def _replica_index_vmap(info, in_dims, like: torch.Tensor, num_replicas: int):
    check("vmap", info.batch_size, _REPLICA_AXIS, replicas=num_replicas)
    return torch.arange(num_replicas, device=like.device), 0


_replica_index_op.register_vmap(_replica_index_vmap)


def _unmapped(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The positions of ``tensors`` that the innermost ``vmap`` active does not map
    (looked for through any ``torch.func.grad`` wrappers): the same on every
    replica. Under ``torch.compile``, which traces ``vmap`` itself and cannot read
    functorch's stack, every tensor is taken as mapped: the replica operators then
    raise for one that no vmap maps (an outer vmap's tensor is not told apart there)."""
    if torch.compiler.is_compiling():
        return []
    levels = _vmap_levels_active()
    if not levels:
        return list(range(len(tensors)))

    return [k for k, t in enumerate(tensors) if levels[-1] not in vmap_levels(t)]


def _vmap_levels_active() -> list[int]:
    """The levels of the ``torch.func.vmap`` transforms active, innermost last (read
    eagerly only: the compiler traces ``vmap`` itself)."""
    functorch = torch._C._functorch
    return [i.level() for i in functorch.get_interpreter_stack() or () if i.key() == functorch.TransformType.Vmap]


class VmapCollective(ReplicaGroups, Collective):
    """The :class:`~puredist.Collective` for code running under ``torch.func.vmap``
    over ``num_replicas`` simulated ranks (see the module docstring).

    Args:
        num_replicas: the size of the vmapped replica axis, ``>= 1``.

    Raises:
        ValueError: ``num_replicas < 1``.
    """

    def mean(
        self, tensors: Sequence[torch.Tensor], *, group_size: int | None = None, context: str = ""
    ) -> list[torch.Tensor]:
        """Each tensor's mean over this replica's group (new tensors; differentiable).
        ``context`` is accepted for the protocol: the replicas share one program."""
        del context
        size = self._size(group_size)
        tensors = checked_for_reduction(tensors, in_place=False)
        if size > 1:  # (an outer vmap would otherwise average whole simulations together)
            self._check_inside_vmap("average over")
            unmapped = _unmapped(tensors)
            if unmapped:
                raise _no_replica_axis(self.num_replicas, "average it over", f"tensor {unmapped[0]}")
        return [_ReplicaMean.apply(t, size, self.num_replicas) for t in tensors]  # (size checked: once, not per leaf)

    def mean_(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        group_size: int | None = None,
        async_op: bool = False,
        context: str = "",
    ) -> CollectiveHandle | None:
        """Write each tensor's mean into it (under ``vmap``, into the batched tensor)."""
        means = self.mean(tensors, group_size=group_size, context=context)
        with torch.no_grad():
            for tensor, mean in zip(tensors, means):
                tensor.copy_(mean)
        return CollectiveHandle() if async_op else None

    def broadcast(self, tensors: Sequence[torch.Tensor], *, src: int) -> list[torch.Tensor]:
        """Replica ``src``'s value of each tensor, on every replica (new tensors; a
        tensor the innermost ``vmap`` does not map is the same on every replica
        already). Differentiable: the gradient of replica ``src``'s value is the sum
        of the incoming gradients over the replicas, zero for the others.

        Under ``torch.compile`` every tensor must be mapped (the compiler traces
        ``vmap`` itself, so an unmapped one cannot be told apart: it raises).

        Raises:
            TypeError: ``src`` is not an int, or a tensor is not one.
            ValueError: ``src`` is not a replica.
            RuntimeError: outside ``torch.func.vmap`` (over more than one replica):
                there is no replica axis to take replica ``src``'s value from.
        """
        check("src", src, INT, BELOW, stop=self.num_replicas)
        check_tensors(tensors, arg="tensors", noun="element")  # (any dtype: a broadcast does no arithmetic)
        if self.num_replicas > 1:  # (every tensor would pass as unmapped: each replica's own value, silently)
            self._check_inside_vmap("take the source replica's value from")
        unmapped = set(_unmapped(tensors))
        return [t.clone() if k in unmapped else _ReplicaSelect.apply(t, src, self.num_replicas, False)
                for k, t in enumerate(tensors)]

    def all_to_all(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor ``[R, *shape]`` sent row by row: row ``c`` to replica ``c``; returns
        ``[R, *shape]`` tensors whose row ``q`` is what replica ``q`` sent to this one
        (new tensors, any dtype; not differentiable). Under ``vmap``, the replica axis
        swapped with the row axis. Every tensor must be mapped by the replica axis.

        Raises:
            RuntimeError: outside ``torch.func.vmap`` (over more than one replica).
        """
        return self._exchanged(tensors, transpose=True)

    def all_gather(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor's value on every replica, stacked ``[R, *shape]`` in replica order
        (new tensors, any dtype; not differentiable). Under ``vmap``, the batched
        tensor itself, seen by every replica. Every tensor must be mapped by the
        replica axis.

        Raises:
            RuntimeError: outside ``torch.func.vmap`` (over more than one replica).
        """
        return self._exchanged(tensors, transpose=False)

    def _exchanged(self, tensors: Sequence[torch.Tensor], *, transpose: bool) -> list[torch.Tensor]:
        if self.num_replicas > 1:
            self._check_inside_vmap("exchange over")
        if transpose:
            check_stacked(tensors, self.num_replicas, arg="tensors", noun="element", why=_ONE_ROW_EACH)
        return [_replica_exchange_op(t, transpose, self.num_replicas) for t in tensors]

    def replica_index(self, like: torch.Tensor) -> torch.Tensor:
        """This replica's index, a 0-dim int64 tensor on ``like``'s device (``lax.axis_index``):
        under ``vmap``, mapped by the replica axis; ``like`` is any tensor that axis maps."""
        if self.num_replicas > 1:
            self._check_inside_vmap("index")
        return _replica_index_op(like, self.num_replicas)

    def _check_inside_vmap(self, act: str) -> None:
        """Raise :func:`_no_replica_axis`'s ``RuntimeError`` (nothing to ``act``) where no
        ``torch.func.vmap`` runs around the call (read eagerly only: the compiler traces
        ``vmap`` itself)."""
        if not torch.compiler.is_compiling() and not _vmap_levels_active():
            raise _no_replica_axis(self.num_replicas, act)

    def value_digests(self, tensors: Sequence[torch.Tensor], *, what: str, context: str = "") -> list[list[int]]:
        """Each replica's digests of its value of each tensor (see
        :meth:`~puredist.Collective.value_digests`, whose comparison
        :meth:`check_replicated` is; a tensor the replica axis does not map reads 0 on
        every replica: it is replicated by construction). Eagerly the values are read
        through the ``vmap`` (its batched tensors hold the stacked rows). ``[]`` while
        ``torch.compile`` traces, and 0 for a tensor that a transform outside the
        replica axis wraps too (an outer ``vmap`` or ``grad``): neither has values to
        read on the host, and a check inside the traced step would be a host read of
        device values at every call. The eager run of the same step checks it, as does
        :meth:`SimulatedCollective.check_replicated` on the stacked tensors before the ``vmap``.

        Raises:
            RuntimeError: outside ``torch.func.vmap`` (see :meth:`mean`).
            ValueError: the innermost ``vmap`` does not map over ``num_replicas``.
        """
        del context, what
        if torch.compiler.is_compiling():
            return []
        self._check_inside_vmap("compare values over")
        level = _vmap_levels_active()[-1]
        rows = [_replica_rows(t, level) for t in tensors]
        for r in [r for r in rows if r is not None][:1]:
            check("vmap", r.shape[0], _REPLICA_AXIS, replicas=self.num_replicas)
        return replica_digests(rows, self.num_replicas)


def _replica_rows(tensor: torch.Tensor, level: int) -> torch.Tensor | None:
    """The stacked ``[R, *shape]`` values of ``tensor`` over the ``vmap`` at ``level``
    (looked for through ``torch.func.grad``'s wrappers); ``None`` where that ``vmap``
    does not map it, or where another transform wraps the values too. (private:
    ``torch._C._functorch``'s wrapper queries)"""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(tensor):
        if functorch.is_batchedtensor(tensor) and functorch.maybe_get_level(tensor) == level:
            value = functorch.get_unwrapped(tensor)
            return None if functorch.is_functorch_wrapped_tensor(value) else value.movedim(
                functorch.maybe_get_bdim(tensor), 0)
        tensor = functorch.get_unwrapped(tensor)
    return None
