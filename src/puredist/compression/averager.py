"""Compressed averaging with error feedback of a list of leaves
(:func:`compressed_mean`, its flat in-place twin) and of a pytree
(:func:`compressed_averager`): the leaves and their residuals laid end to end as rows,
checked, then averaged by :mod:`puredist.compression.phases`.

This module must not keep state between calls: residuals go in and out explicitly.
"""

from typing import Callable, NamedTuple, Sequence

import torch

from puredist._consistency import refusals, with_refusal
from puredist._docs import fields_documented
from puredist._dtensors import like, local_shard
from puredist._inputs import FLOAT8, check_float_leaves, check_residuals
from puredist._layout import Layout, layout_of, views_like
from puredist._validation import Rule, check
from puredist.collectives import Collective, DistributedCollective, SimulatedCollective, refusing
from puredist.compression.codecs import Compressor, check_compressor
from puredist.compression.phases import (
    exchanged_gather, exchanged_mean, gather_mean, gathered_mean, raise_non_finite, two_phase_mean,
)
from puredist.errors import RankMismatchError
from puredist.tree import PyTree, tree_flatten, tree_unflatten


@fields_documented
class CompressionState(NamedTuple):
    """Error feedback of a :func:`compressed_averager` on one rank.

    Attributes:
        step: completed averagings (part of the rank check).
        residuals: per leaf, the fp32 part of ``x + residual`` not sent yet.
    """

    step: int
    residuals: tuple[torch.Tensor, ...]


@fields_documented
class CompressedAverager(NamedTuple):
    """A compressed averager with error feedback (see :func:`compressed_averager`).

    Attributes:
        init: ``init(params) -> CompressionState``: zero residuals.
        update: ``update(params, state, *, collective) -> (means, state)``: pure.
    """

    init: Callable[[PyTree], CompressionState]
    update: Callable[..., tuple[PyTree, CompressionState]]


def _check_compressible(leaves: list[torch.Tensor], collective: Collective, layout: Layout) -> None:
    """Raise, naming ``params`` or ``collective``, unless a compressed averaging over
    ``collective`` takes ``leaves`` (of ``layout``): floats, a collective that
    compresses, rows stacked per replica where the ranks are simulated."""
    check_float_leaves(leaves, layout, arg="params", needs="compression needs floats")
    check("collective", collective, _COMPRESSING)
    if isinstance(collective, SimulatedCollective):
        collective.check_stacked(leaves, arg="params")


def _gathers(collective: Collective) -> bool:
    """Whether ``collective`` averages compressed payloads by gathering them (a torchft
    quorum, whose membership changes between calls: no fixed chunk owners)."""
    return callable(getattr(collective, "all_gather_rows", None))


def _exchanges(collective: Collective) -> bool:
    """Whether ``collective`` runs the replicas as one program over a replica axis, with
    an all-to-all and an all-gather there (:class:`~puredist.VmapCollective`)."""
    return callable(getattr(collective, "all_to_all", None))


_COMPRESSING = Rule(
    lambda c, b: isinstance(c, (DistributedCollective, SimulatedCollective)) or _gathers(c) or _exchanges(c), TypeError,
    "Arg ``{arg}`` must be a DistributedCollective, a SimulatedCollective, a VmapCollective or a collective that "
    "gathers rows (puredist.ft.ManagerCollective), got {value!r}.")
"""The collectives a compressed averaging runs over (what :func:`_mean_of_rows` dispatches on)."""


def compressed_mean(
    leaves: list[torch.Tensor], residuals: tuple[torch.Tensor, ...], compressor: Compressor, collective: Collective,
    *, context: object,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The means of ``leaves`` (new tensors, their dtypes) and the new fp32 residuals,
    by the two-phase rule of this module; ``context`` joins the rank check (any object:
    a caller's lazily formatted context, ``str()`` taken only where a check or an error
    reads it).

    Raises:
        TypeError: a non-floating-point leaf, or another kind of collective.
        ValueError: an inf or NaN in a leaf plus its residual (on every rank: any
            rank's non-finite value is part of the rank check).
        RankMismatchError: ranks pass different layouts or contexts, or some ranks
            hold non-finite values and others not.
        CollectiveError: the all-to-all or the all-gather failed (nothing was written;
            the residuals passed in are still the state to continue from).
    """
    context = _PayloadsContext(context, compressor.name)  # (their sizes depend on it: ranks must agree)
    layout = layout_of(leaves)
    with refusing(collective, context=context):  # the peers learn a refusal in their rank check, instead of waiting
        _check_compressible(leaves, collective, layout)
        if not torch.compiler.is_compiling():  # (traced once per compilation: the same step run eagerly checks them)
            check_residuals(leaves, residuals, layout, arg="state")
    simulated = isinstance(collective, SimulatedCollective)
    if not collective.is_member or not leaves:  # as mean_: a rank outside the group keeps its values
        return [leaf.detach().clone() for leaf in leaves], [local_shard(r).clone() for r in residuals]
    if not simulated and not _exchanges(collective) and layout.plain and layout.derived("one dtype", lambda: len({t.dtype for t in leaves}) == 1) \
            and leaves[0].dtype not in FLOAT8:  # (no multi-tensor kernel copies float8)
        return _compressed_mean_plain(leaves, residuals, compressor, collective, context)
    count = collective.world_size if simulated else 1  # rows: one per (simulated) rank
    given, leaves = leaves, [local_shard(leaf) for leaf in leaves]  # a DTensor's shard (the rank check sees the DTensor)
    residuals = tuple(local_shard(r) for r in residuals)
    # all leaves in one flat row: blocks may span leaves
    rows = torch.cat(
        [(leaf.detach().float() + residual).reshape(count, -1) for leaf, residual in zip(leaves, residuals, strict=True)],
        dim=1,
    )
    mean, left = _mean_of_rows(rows, given, compressor, collective, simulated, leaves, residuals, context)
    return _outputs(mean, left, leaves, given, residuals, count)


class _PayloadsContext(NamedTuple):
    """A compressed averaging's rank-check context, formatted only where a rank check
    or an error uses it (a compiled step traces no formatting of its step count)."""

    context: object
    compressor: str

    def __str__(self) -> str:
        return f"{self.context}, payloads of {self.compressor}"


def _compressed_mean_plain(leaves: list[torch.Tensor], residuals: tuple[torch.Tensor, ...], compressor: Compressor,
                           collective: Collective, context: object) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`compressed_mean` of plain tensors of one dtype on a real rank: the row
    made and cut by single C++ calls (host work per leaf in C, not in Python). The
    results are tensors of their own (no shared storage or version counter: a
    pure function's outputs), copied out of the flat results by one multi-tensor op
    each (``x * 1`` is ``x`` exactly)."""
    flatten = torch._C._nn.flatten_dense_tensors  # (one tensor: a view of it, never written)
    with torch.no_grad():
        rows = (flatten(leaves).float() + flatten(list(residuals))).view(1, -1)
    mean, left = _mean_of_rows(rows, leaves, compressor, collective, False, leaves, residuals, context)
    with torch.no_grad():
        return (list(torch._foreach_mul(views_like(mean.to(leaves[0].dtype), leaves), 1)),
                list(torch._foreach_mul(views_like(left[0], residuals), 1)))


def compressed_mean_flat_(
    flat: torch.Tensor, residual: torch.Tensor, compressor: Compressor, collective: Collective, *, context: object,
    leaves: Sequence[torch.Tensor], residuals: Sequence[torch.Tensor],
) -> None:
    """:func:`compressed_mean` of leaves laid end to end in one buffer, as one tensor
    and in place: host work per call independent of the number of leaves.

    Args:
        flat: the leaves' buffer (1-D, floating point, plain), overwritten with their
            mean once every collective succeeded.
        residual: the leaves' residuals end to end (1-D fp32, ``flat``'s size),
            overwritten with the new ones then.
        leaves, residuals: the per-leaf views of the two, named in errors only.

    Raises:
        as :func:`compressed_mean`, with ``flat`` and ``residual`` as they were. The
        rank check sees the one tensor: ranks must lay their leaves out alike.
    """
    context = _PayloadsContext(context, compressor.name)
    _check_compressible([flat], collective, layout_of([flat]))
    if not collective.is_member:
        return
    rows = (flat.float() + residual).view(1, -1)
    mean, left = _mean_of_rows(rows, [flat], compressor, collective, False, leaves, residuals, context)
    flat.copy_(mean)
    residual.copy_(left[0])


def _mean_of_rows(rows: torch.Tensor, given: Sequence[torch.Tensor], compressor: Compressor, collective: Collective,
                  simulated: bool, leaves: Sequence[torch.Tensor], residuals: Sequence[torch.Tensor],
                  context: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, left)`` of ``rows`` (``[count, numel]``: ``leaves`` plus their
    ``residuals``, end to end): the rank check over ``given`` (with any rank's
    non-finite values), then the phases of the module (or a torchft quorum's gather)."""
    if _exchanges(collective):  # one program: no rank to check against, no value read on the host
        if collective.world_size == 1:
            return _alone(rows)
        return (exchanged_gather if compressor.gathered else exchanged_mean)(rows, compressor, collective)
    context = str(context)
    finite = bool(torch.isfinite(rows).all())
    where = "" if finite else "inf or NaN in " + ", ".join(
        f"leaf {i}" + ("" if torch.isfinite(residual).all() else " (its residual)")
        for i, (leaf, residual) in enumerate(zip(leaves, residuals))
        if not torch.isfinite(leaf.detach().float() + residual).all()
    )
    if _gathers(collective):  # one torchft step; a replica's non-finite values make its context differ
        return gathered_mean(rows, compressor, collective, finite, with_refusal(context, where))
    if not simulated:  # every rank learns whether any rank has a non-finite value
        try:
            collective.check_same_on_all_ranks(given, context=with_refusal(context, where), what="a compressed averaging")
        except RankMismatchError as error:
            if refusals(error):
                raise_non_finite(refusals(error), context)
            raise
    if not finite:
        raise_non_finite([f"this rank: {where}"], context)
    if collective.world_size == 1:
        return _alone(rows)
    if compressor.gathered:
        return gather_mean(rows, compressor, collective, simulated, leaves)
    return two_phase_mean(rows, compressor, collective, simulated, leaves, context)


def _outputs(mean: torch.Tensor, left: torch.Tensor, leaves, given, residuals, count: int):
    """The flat ``mean`` and ``left`` (``[count, numel]``) cut back into the leaves'
    shapes and dtypes (``given``'s DTensor placements) and the residuals' shapes."""
    sizes = [leaf.numel() // count for leaf in leaves]
    outputs = [
        like(original, part.to(leaf.dtype).expand(count, size).reshape(leaf.shape).clone())
        for part, leaf, original, size in zip(mean.split(sizes), leaves, given, sizes)
    ]
    new_residuals = [part.reshape(r.shape).clone() for part, r in zip(left.split(sizes, dim=1), residuals)]
    return outputs, new_residuals


def compressed_averager(compressor: Compressor) -> CompressedAverager:
    """Average pytrees over all ranks with ``compressor``'s payloads and error feedback.

    For rank ``r`` at step ``t``, with ``v_r = x_r + e_r`` cut into ``W`` chunks, every
    rank returns the same ``mean = (1/W) sum_r (v_r - e_r')`` (in fp32, cast to each
    leaf's dtype: the cast is outside the error feedback), by the two phases of the
    module: ``e_r'`` is what chunk ``c``'s payload lost (``c != r``) and, on its own
    chunk ``r``, ``W`` times what the compressed mean lost.
    All leaves travel as one flat row, so quantization blocks and top-k span leaves.
    With a :class:`~puredist.SimulatedCollective` the leaves are stacked ``[W, *shape]``
    and so are the residuals; with a :class:`~puredist.VmapCollective`, under
    ``torch.func.vmap`` (compiled too), each replica's own, the same bits.

    Returns:
        A :class:`CompressedAverager`. ``update`` is pure: the inputs and the state
        passed in are never written, so a failed collective changes nothing.

    Raises:
        TypeError: ``compressor`` is not a :class:`Compressor`; at ``update``, a
            non-floating-point leaf, or another kind of collective.
        ValueError: (at ``update``, on every rank, nothing sent) an inf or NaN in a
            leaf plus its residual on any rank, or a state whose residuals are not
            one fp32 tensor per leaf, shaped like it.
        RankMismatchError: (at ``update``) ranks pass different layouts or are at
            different steps.
        CollectiveError: (at ``update``) a collective failed; nothing was written.
    """
    check_compressor(compressor)

    def init(params: PyTree) -> CompressionState:
        """Zero residuals shaped like ``params``' leaves (fp32; a DTensor's: like its local shard)."""
        leaves, _ = tree_flatten(params)
        return CompressionState(0, tuple(torch.zeros_like(local_shard(leaf), dtype=torch.float32) for leaf in leaves))

    def update(params: PyTree, state: CompressionState, *, collective: Collective):
        """Pure: ``(pytree of the means, state with the new residuals, step + 1)``."""
        leaves, spec = tree_flatten(params)
        means, residuals = compressed_mean(
            leaves, state.residuals, compressor, collective,
            context=f"compressed_averager({compressor.name}) step {state.step}",
        )
        return tree_unflatten(spec, means), CompressionState(state.step + 1, tuple(residuals))

    return CompressedAverager(init, update)


def _alone(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, left)`` for a world of one rank or replica, whatever the backend: the
    mean of its ``x + e`` is itself; nothing is sent and nothing is left over."""
    return rows[0], torch.zeros_like(rows)
