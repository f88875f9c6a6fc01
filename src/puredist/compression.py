"""Averaging with compressed payloads and error feedback, as pure state.

A :class:`Compressor` turns a flat fp32 tensor into a small payload and back:

- :func:`int8_blocks` / :func:`int4_blocks`: block-wise absmax quantization, one fp32
  scale per block of ``block_size`` values (int4: two values a byte). Per element,
  ``|x - decode(encode(x))| <= absmax(block) / (2 * levels)`` (levels: 127, 7; for
  scales in fp32's normal range: a block of subnormals rounds coarser).
- :func:`top_k`: the ``ceil(fraction * n)`` values of largest magnitude and their
  indices (int32); the rest are sent as zeros.

:func:`compressed_averager` averages a parameter (or pseudo-gradient) pytree over the
``W`` ranks with those payloads, in two phases, like a reduce-scatter then an all-gather:
every rank adds its error-feedback residual ``e`` to its tensor (``v = x + e``) and cuts
it into ``W`` equal chunks; rank ``c`` owns chunk ``c``.

1. Every rank sends chunk ``c`` compressed to its owner (an all-to-all); the owner
   decodes them and takes the mean ``m_c`` (summed in rank order in fp64, rounded to
   fp32 once), its own chunk exact.
2. Every owner compresses ``m_c`` and sends it to all (an all-gather); every rank
   decodes every chunk: the same result, bit for bit, on every rank.

What a rank's chunks lost in phase 1 is its next residual there; what ``m_c`` lost in
phase 2, times ``W``, is the owner's next residual on chunk ``c`` (which it sends exact
next time). So the result is ``(1/W) sum_r (x_r + e_r - e_r')`` and error feedback
telescopes: ``sum_t result_t + (1/W) sum_r e_r,T = sum_t (1/W) sum_r x_r,t``. The one
exception is at fp32's edge: the owner's residual is computed in fp64 and rounded to
fp32 saturating at ``±FLT_MAX``, so that finite inputs leave finite residuals; where ``W``
times what phase 2 lost exceeds that (a dropped mean entry above ``FLT_MAX / W``, as
top-k can drop), the excess is lost. The
residuals are the state (checkpoint them with the rest). All of this is in fp32: leaves
of other float dtypes enter as fp32 and their means are cast back, so what that cast
loses (a 16-bit leaf's rounding, an fp64 leaf's digits beyond fp32's) is outside the
feedback.

Over a torchft quorum (:class:`puredist.ft.ManagerCollective`), whose members change
between calls, there are no fixed chunk owners: every contributing replica's whole row,
compressed, is gathered by all, and each decodes the rows and takes their mean in quorum
order (one phase; ``W - 1`` payloads per replica). A row's residual is what its payload
lost, so error feedback telescopes as above.

Bytes on the wire per rank: ``2 (W - 1) / W`` payloads of the whole tensor, as a ring
all-reduce sends ``2 (W - 1) / W`` tensors: the format's ratio (payload of ``n`` floats:
int8 ``n + 4 n / block_size``, int4 ``n / 2 + 4 n / block_size``, top-k ``8 k``; top-k
selects within each chunk).

This module must not keep state between calls: residuals go in and out explicitly.
"""

import functools
import math
import operator
from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from puredist._consistency import REFUSED, refusals, with_refusal
from puredist._dtensors import check_not_pending, like, local_shard
from puredist._inputs import FLOAT8
from puredist._layout import Layout, layout_of, views_like
from puredist.collectives import Collective, DistributedCollective, SimulatedCollective, refuse_on_all_ranks
from puredist.errors import CollectiveError, RankMismatchError, nothing_changed
from puredist.tree import PyTree, tree_flatten, tree_unflatten
from puredist._docs import fields_documented

__all__ = [
    "CompressedAverager",
    "CompressionState",
    "Compressor",
    "compressed_averager",
    "compressed_mean",
    "int4_blocks",
    "int8_blocks",
    "top_k",
]

Payload = tuple[torch.Tensor, ...]


@fields_documented
class Compressor(NamedTuple):
    """A lossy code for flat fp32 tensors.

    Attributes:
        name: what it is, with its settings (part of the rank check).
        encode: ``encode(x) -> payload`` for a 1-D fp32 tensor; the payload's tensor
            shapes depend only on ``x.numel()``.
        decode: ``decode(payload, numel) -> x'``, a 1-D fp32 tensor.
    """

    name: str
    encode: Callable[[torch.Tensor], Payload]
    decode: Callable[[Payload, int], torch.Tensor]


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"Arg ``block_size`` must be a positive int, got {block_size!r}.")


def _blocks(x: torch.Tensor, block_size: int, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` zero-padded into rows of ``block_size``, and each row's scale divisor. A
    block longer than ``x`` shrinks to ``x`` (rounded up to a ``multiple``): the same
    one scale, without sending the padding."""
    block = min(block_size, max(multiple, -(-x.numel() // multiple) * multiple))
    padded = torch.nn.functional.pad(x, (0, -x.numel() % block)).view(-1, block)
    return padded, padded.abs().amax(dim=1, keepdim=True)


def _quantized(x: torch.Tensor, block_size: int, levels: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Integers in ``[-levels, levels]`` per block and the fp32 scales."""
    padded, absmax = _blocks(x, block_size, multiple)
    scales = (absmax / levels).clamp_(max=_largest_scale(levels))  # (absmax = FLT_MAX: 127 * scale would be inf)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(padded / safe).clamp_(-levels, levels), scales


@functools.cache
def _largest_scale(levels: int) -> float:
    """The largest fp32 scale whose ``levels`` multiple is finite in fp32 (decoding
    multiplies by it: ``FLT_MAX / levels`` rounded to fp32 may round up)."""
    scale = torch.tensor(torch.finfo(torch.float32).max / levels, dtype=torch.float32)
    while not torch.isfinite(scale * levels):
        scale = torch.nextafter(scale, torch.zeros(()))
    return scale.item()


def int8_blocks(block_size: int = 128) -> Compressor:
    """Block-wise absmax int8: ``round(x / scale)`` with ``scale = absmax / 127``.

    Raises:
        ValueError: ``block_size < 1``.
    """
    _check_block_size(block_size)

    def encode(x: torch.Tensor) -> Payload:
        q, scales = _quantized(x, block_size, 127)
        return q.to(torch.int8), scales.flatten()

    def decode(payload: Payload, numel: int) -> torch.Tensor:
        q, scales = payload
        return (q.float() * scales[:, None]).flatten()[:numel]

    return Compressor(f"int8_blocks({block_size})", encode, decode)


def int4_blocks(block_size: int = 128) -> Compressor:
    """Block-wise absmax 4-bit: integers in ``[-7, 7]``, two a byte.

    Raises:
        ValueError: ``block_size`` not a positive even int.
    """
    _check_block_size(block_size)
    if block_size % 2:
        raise ValueError(f"Arg ``block_size`` must be even (two values a byte), got {block_size}.")

    def encode(x: torch.Tensor) -> Payload:
        q, scales = _quantized(x, block_size, 7, multiple=2)
        nibbles = (q + 8).to(torch.uint8).view(-1, 2)
        return nibbles[:, 0] | (nibbles[:, 1] << 4), scales.flatten()

    def decode(payload: Payload, numel: int) -> torch.Tensor:
        packed, scales = payload
        block = 2 * packed.numel() // max(scales.numel(), 1)  # (a block each scale)
        nibbles = torch.stack((packed & 15, packed >> 4), dim=1).view(-1, max(block, 2))
        return ((nibbles.float() - 8) * scales[:, None]).flatten()[:numel]

    return Compressor(f"int4_blocks({block_size})", encode, decode)


def top_k(fraction: float) -> Compressor:
    """The ``ceil(fraction * n)`` entries of largest magnitude (values fp32, indices
    int32); ties broken by ``torch.topk``.

    Raises:
        ValueError: ``fraction`` not in ``(0, 1]``.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"Arg ``fraction`` must be in (0, 1], got {fraction!r}.")

    def encode(x: torch.Tensor) -> Payload:
        k = max(1, math.ceil(round(fraction * x.numel(), 9))) if x.numel() else 0  # 0.07 * 100 is 7, not 8
        indices = x.abs().topk(k, sorted=False).indices
        return x[indices], indices.to(torch.int32)

    def decode(payload: Payload, numel: int) -> torch.Tensor:
        values, indices = payload
        return torch.zeros(numel, dtype=torch.float32, device=values.device).index_put_((indices.long(),), values)

    return Compressor(f"top_k({fraction})", encode, decode)


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


def _exchanged_chunks(payload: Payload, collective: DistributedCollective) -> list[Payload]:
    """Phase 1: ``payload``'s tensors are stacked per destination rank (row ``c`` goes
    to rank ``c``); returns the row each rank sent to this one, in rank order."""
    parts = []
    for tensor in payload:
        received = torch.empty_like(tensor)
        dist.all_to_all_single(received, tensor.contiguous(), group=collective.process_group)
        parts.append(received.unbind(0))
    return list(zip(*parts))


def _gathered_payloads(payload: Payload, collective: DistributedCollective) -> list[Payload]:
    """Phase 2: every rank's payload, in rank order."""
    group, size = collective.process_group, collective.world_size
    parts = []
    for tensor in payload:
        received = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(received, tensor.contiguous(), group=group)
        parts.append(received)
    return list(zip(*parts))


def _stacked(payloads: list[Payload]) -> Payload:
    return tuple(torch.stack(tensors) for tensors in zip(*payloads))


def _mean_in_rank_order(chunks: list[torch.Tensor]) -> torch.Tensor:
    """fp32 mean, summed in list order: the same bits wherever it is computed. The
    sum is taken in fp64 and divided there, then rounded to fp32 once, so a mean
    within fp32's range is finite however large its terms (an fp32 sum overflows for
    terms above ``FLT_MAX / W``, and a sum of terms divided first can round past
    ``FLT_MAX``: an inf mean, then inf or NaN residuals, which every later call would
    refuse)."""
    return (sum(chunk.double() for chunk in chunks) / len(chunks)).float()


def _check_compressible(leaves: list[torch.Tensor], collective: Collective, layout: Layout) -> bool:
    """Raises on a non-float leaf or another kind of collective (the leaves checked
    once per ``layout``, theirs); True if simulated."""
    layout.derived("compressible", lambda: _check_leaves(leaves))
    simulated = isinstance(collective, SimulatedCollective)
    if simulated:
        collective.check_stacked(leaves, arg="params")
    if not simulated and not isinstance(collective, DistributedCollective) and not _gathers(collective):
        raise TypeError(
            "Arg ``collective`` must be a DistributedCollective, a SimulatedCollective or a collective that gathers "
            f"rows (puredist.ft.ManagerCollective), got {collective!r}."
        )
    return simulated


def _check_leaves(leaves: list[torch.Tensor]) -> bool:
    """Raise ``TypeError`` on a non-floating-point leaf, ``ValueError`` on a pending DTensor; True."""
    for position, leaf in enumerate(leaves):
        if not leaf.is_floating_point():
            raise TypeError(f"Arg ``params``: leaf {position} has dtype {leaf.dtype}; compression needs floats.")
        check_not_pending(leaf, "params", lambda: f"leaf {position}")
    return True


def _gathers(collective: Collective) -> bool:
    """Whether ``collective`` averages compressed payloads by gathering them (a torchft
    quorum, whose membership changes between calls: no fixed chunk owners)."""
    return callable(getattr(collective, "all_gather_rows", None))


def _gathered_mean(rows: torch.Tensor, compressor: Compressor, collective: Collective, finite: bool,
                   context: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, left)`` of this replica's row (``[1, numel]``) by one phase: every
    contributing replica's whole row, compressed, gathered by all; the mean of the
    decoded rows in quorum order (the same bits everywhere); what this row's payload
    lost is its residual. Bytes per replica: ``W - 1`` payloads (the two phases send
    ``2 (W - 1) / W``). A replica with non-finite values refuses in the quorum's
    rank check (and sends zeros), so that every replica raises the same ``ValueError``
    before any payload is read."""
    numel = rows.shape[1]
    payload = compressor.encode(rows[0] if finite else torch.zeros_like(rows[0]))
    try:
        gathered = collective.all_gather_rows(list(payload), context=context, refused=not finite)
    except ValueError as refusal:  # some replica refused (every one voted against the step: not committed)
        _raise_non_finite([f"this replica: {context.split(REFUSED)[-1]}" if not finite else str(refusal)], context)
    except (RankMismatchError, CollectiveError):
        if not finite:  # (it voted against the step: not committed)
            _raise_non_finite([f"this replica: {context.split(REFUSED)[-1]}"], context)
        raise
    mean = _mean_in_rank_order([compressor.decode(tuple(row), numel) for row in gathered])
    return mean, rows - compressor.decode(payload, numel)


def _raise_non_finite(where: list[str], context: str) -> None:
    raise ValueError(
        f"Arg ``params`` (plus the error-feedback residuals) holds inf or NaN ({'; '.join(where)}): a block's scale, "
        f"and then the residual, would be non-finite for good. Nothing was sent, on any rank, and the state passed "
        f"in is unchanged. Where the params are (an AMP overflow), skip this step; where a residual is (marked "
        f"'its residual'), or both are finite and their sum is not, no later step clears it: reset the residuals "
        f"(zeros, as init makes them) or reload a checkpoint. {context}"
    )


def compressed_mean(
    leaves: list[torch.Tensor], residuals: tuple[torch.Tensor, ...], compressor: Compressor, collective: Collective,
    *, context: str,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The means of ``leaves`` (new tensors, their dtypes) and the new fp32 residuals,
    by the two-phase rule of this module; ``context`` joins the rank check.

    Raises:
        TypeError: a non-floating-point leaf, or another kind of collective.
        ValueError: an inf or NaN in a leaf plus its residual (on every rank: any
            rank's non-finite value is part of the rank check).
        RankMismatchError: ranks pass different layouts or contexts, or some ranks
            hold non-finite values and others not.
        CollectiveError: the all-to-all or the all-gather failed (nothing was written;
            the residuals passed in are still the state to continue from).
    """
    context = f"{context}, payloads of {compressor.name}"  # (their sizes depend on it: ranks must agree)
    layout = layout_of(leaves)
    try:
        simulated = _check_compressible(leaves, collective, layout)
        _check_residuals(leaves, residuals, layout)
    except (TypeError, ValueError) as error:  # the peers learn it in their rank check, instead of waiting
        refuse_on_all_ranks(collective, error, context=context)
        raise
    if not collective.is_member or not leaves:  # as mean_: a rank outside the group keeps its values
        return [leaf.detach().clone() for leaf in leaves], [local_shard(r).clone() for r in residuals]
    if not simulated and layout.plain and layout.derived("one dtype", lambda: len({t.dtype for t in leaves}) == 1) \
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


def _compressed_mean_plain(leaves: list[torch.Tensor], residuals: tuple[torch.Tensor, ...], compressor: Compressor,
                           collective: Collective, context: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
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


_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")


def _check_residuals(leaves: list[torch.Tensor], residuals: Sequence[torch.Tensor], layout: Layout) -> None:
    """Raise ``ValueError`` unless ``residuals`` are one fp32 tensor per leaf, shaped as
    its local shard (the payloads' sizes follow from them: a residual of another shape
    would broadcast, or make this rank's payloads another size than its peers')."""
    if len(residuals) != len(leaves):
        raise ValueError(f"Arg ``state`` holds {len(residuals)} residuals for {len(leaves)} leaves.")
    shards = leaves
    if not layout.plain:  # a DTensor's residual: its local shard's, or a DTensor holding that shard
        shards, residuals = [local_shard(leaf) for leaf in leaves], [local_shard(r) for r in residuals]
    shapes = list(map(_SHAPE, residuals))
    if shapes != list(map(_SHAPE, shards)):
        i = next(i for i, (r, leaf) in enumerate(zip(shapes, shards)) if r != leaf.shape)
        raise ValueError(f"Arg ``state``: residual {i} has shape {tuple(shapes[i])}, its leaf {tuple(shards[i].shape)}.")
    if residuals and set(map(_DTYPE, residuals)) != {torch.float32}:
        i = next(i for i, r in enumerate(residuals) if r.dtype != torch.float32)
        raise ValueError(f"Arg ``state``: residual {i} has dtype {residuals[i].dtype}; residuals are fp32 (as init "
                         "makes them).")


def compressed_mean_flat_(
    flat: torch.Tensor, residual: torch.Tensor, compressor: Compressor, collective: Collective, *, context: str,
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
    context = f"{context}, payloads of {compressor.name}"
    _check_compressible([flat], collective, layout_of([flat]))
    if not collective.is_member:
        return
    rows = (flat.float() + residual).view(1, -1)
    mean, left = _mean_of_rows(rows, [flat], compressor, collective, False, leaves, residuals, context)
    flat.copy_(mean)
    residual.copy_(left[0])


def _mean_of_rows(rows: torch.Tensor, given: Sequence[torch.Tensor], compressor: Compressor, collective: Collective,
                  simulated: bool, leaves: Sequence[torch.Tensor], residuals: Sequence[torch.Tensor],
                  context: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, left)`` of ``rows`` (``[count, numel]``: ``leaves`` plus their
    ``residuals``, end to end): the rank check over ``given`` (with any rank's
    non-finite values), then the phases of the module (or a torchft quorum's gather)."""
    finite = bool(torch.isfinite(rows).all())
    where = "" if finite else "inf or NaN in " + ", ".join(
        f"leaf {i}" + ("" if torch.isfinite(residual).all() else " (its residual)")
        for i, (leaf, residual) in enumerate(zip(leaves, residuals))
        if not torch.isfinite(leaf.detach().float() + residual).all()
    )
    if _gathers(collective):  # one torchft step; a replica's non-finite values make its context differ
        return _gathered_mean(rows, compressor, collective, finite, with_refusal(context, where))
    if not simulated:  # every rank learns whether any rank has a non-finite value
        try:
            collective.check_same_on_all_ranks(given, context=with_refusal(context, where), what="a compressed averaging")
        except RankMismatchError as error:
            if refusals(error):
                _raise_non_finite(refusals(error), context)
            raise
    if not finite:
        _raise_non_finite([f"this rank: {where}"], context)
    if collective.world_size == 1:  # the mean of one rank's x + e is itself: nothing to send, nothing left over
        return rows[0], torch.zeros_like(rows)
    return _two_phase_mean(rows, compressor, collective, simulated, leaves)


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


def _two_phase_mean(
    rows: torch.Tensor, compressor: Compressor, collective: Collective, simulated: bool, leaves: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, left)`` of ``rows`` (``[count, numel]``, one row per simulated rank or
    this rank's) by the module's two phases: the flat mean every rank gets, and each
    row's new residual. ``leaves`` only name what a failed collective left unchanged."""
    world, (count, numel) = collective.world_size, rows.shape
    chunk = -(-numel // world)  # zero-padded into W equal chunks
    chunks = torch.nn.functional.pad(rows, (0, chunk * world - numel)).view(count, world, chunk)
    # phase 1: chunk c of every row, compressed, to its owner c (the owner's own chunk exact, never encoded)
    owners = range(world) if simulated else [collective.rank]  # the rank of each row
    payloads = [
        [None if c == owner else compressor.encode(chunks[row, c]) for c in range(world)]
        for row, owner in enumerate(owners)
    ]
    kept = torch.stack([  # what the owners receive: each row's chunks as decoded, its own exact
        torch.stack([chunks[row, c] if c == owner else compressor.decode(payloads[row][c], chunk) for c in range(world)])
        for row, owner in enumerate(owners)
    ])
    if simulated:
        means = [_mean_in_rank_order([kept[q, c] for q in range(world)]) for c in owners]
    else:
        try:
            stand_in = next(p for p in payloads[0] if p is not None)  # the slot to oneself: never sent, never read
            received = _exchanged_chunks(_stacked([p if p is not None else stand_in for p in payloads[0]]), collective)
        except RuntimeError as error:  # a peer died, a timeout: nothing was written anywhere
            raise nothing_changed(leaves, "A compressed averaging", error, stage="its all-to-all (phase 1)") from error
        mine = collective.rank
        means = [_mean_in_rank_order(
            [kept[0, mine] if q == mine else compressor.decode(p, chunk) for q, p in enumerate(received)]
        )]
    # phase 2: every owner's mean, compressed, to everybody
    final_payloads = [compressor.encode(m) for m in means]
    finals = [compressor.decode(p, chunk) for p in final_payloads]
    if simulated:
        decoded = finals
    else:
        try:
            gathered = _gathered_payloads(final_payloads[0], collective)
        except RuntimeError as error:
            raise nothing_changed(leaves, "A compressed averaging", error, stage="its all-gather (phase 2)") from error
        decoded = [finals[0] if c == collective.rank else compressor.decode(p, chunk) for c, p in enumerate(gathered)]
    left = chunks - kept
    for row, owner in enumerate(owners):  # the owner sends its chunk exact next time, with what phase 2 lost
        left[row, owner] = _owner_residual(means[row], finals[row], world)
    return torch.cat(decoded)[:numel], left.reshape(count, -1)[:, :numel]


_FLT_MAX = torch.finfo(torch.float32).max


def _owner_residual(mean: torch.Tensor, final: torch.Tensor, world: int) -> torch.Tensor:
    """``world * (mean - final)``: what phase 2 lost of an owner's mean, scaled to be
    sent exact next time. Computed in fp64 and rounded to fp32 once, saturating at
    ``±FLT_MAX``: in fp32 a loss above ``FLT_MAX / world`` (top-k dropping a mean near
    fp32's largest) gave ``inf``, which every later call refused, the mass lost all
    the same; saturated, the residual stays finite and sends what fp32 can hold."""
    return (world * (mean.double() - final.double())).clamp_(-_FLT_MAX, _FLT_MAX).float()


def check_compressor(compressor: object) -> None:
    """Raise ``TypeError`` unless ``compressor`` is a :class:`Compressor`."""
    if not isinstance(compressor, Compressor):
        raise TypeError(f"Arg ``compressor`` must be a puredist Compressor (e.g. int8_blocks()), got {compressor!r}.")


def compressed_averager(compressor: Compressor) -> CompressedAverager:
    """Average pytrees over all ranks with ``compressor``'s payloads and error feedback.

    For rank ``r`` at step ``t``, with ``v_r = x_r + e_r`` cut into ``W`` chunks, every
    rank returns the same ``mean = (1/W) sum_r (v_r - e_r')`` (in fp32, cast to each
    leaf's dtype: the cast is outside the error feedback), by the two phases of the
    module: ``e_r'`` is what chunk ``c``'s payload lost (``c != r``) and, on its own
    chunk ``r``, ``W`` times what the compressed mean lost.
    All leaves travel as one flat row, so quantization blocks and top-k span leaves.
    With a :class:`~puredist.SimulatedCollective` the leaves are stacked ``[W, *shape]``
    and so are the residuals.

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
