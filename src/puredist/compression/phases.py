"""How compressed payloads travel and are averaged: the two phases over fixed chunk
owners (an all-to-all, then an all-gather; over real ranks, simulated ones, or a
``vmap``'s replica axis), or one gather of every rank's whole payload (for a
compressor that asks for it, :attr:`~puredist.compression.Compressor.gathered`, and
over a torchft quorum),
each returning the mean every rank gets and what this rank's payloads lost (its next
residual). The package docstring (:mod:`puredist.compression`) states the rule.

This module must not check its inputs: :mod:`puredist.compression.averager` has done it.
"""

from collections.abc import Iterable

import torch
import torch.distributed as dist

from puredist._consistency import REFUSED
from puredist.collectives import Collective, DistributedCollective
from puredist.compression.codecs import Compressor, Payload
from puredist.errors import CollectiveError, RankMismatchError, nothing_changed


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


def _mean_in_rank_order(terms: Iterable[torch.Tensor], count: int) -> torch.Tensor:
    """fp32 mean of the ``count`` ``terms``, summed in their order: the same bits
    wherever it is computed. Each term is read once, as it comes, so a generator (of
    decoded payloads) holds one at a time, not ``count``. The sum is taken in fp64 and
    divided there, then rounded to fp32 once, so a mean within fp32's range is finite
    however large its terms (an fp32 sum overflows for terms above ``FLT_MAX / W``, and
    a sum of terms divided first can round past ``FLT_MAX``: an inf mean, then inf or
    NaN residuals, which every later call would refuse)."""
    return (sum(term.double() for term in terms) / count).float()


def gathered_mean(rows: torch.Tensor, compressor: Compressor, collective: Collective, finite: bool,
                   context: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, left)`` of this replica's row (``[1, numel]``) over a torchft quorum:
    every contributing replica's whole row, compressed, gathered by all
    (:func:`gather_mean`'s rule, in quorum order). A replica with non-finite values
    refuses in the quorum's rank check (and sends zeros), so that every replica raises
    the same ``ValueError`` before any payload is read."""
    payload = compressor.encode(rows[0] if finite else torch.zeros_like(rows[0]))
    try:
        gathered = collective.all_gather_rows(list(payload), context=context, refused=not finite)
    except ValueError as refusal:  # some replica refused (every one voted against the step: not committed)
        raise_non_finite([f"this replica: {context.split(REFUSED)[-1]}" if not finite else str(refusal)], context)
    except (RankMismatchError, CollectiveError):
        if not finite:  # (it voted against the step: not committed)
            raise_non_finite([f"this replica: {context.split(REFUSED)[-1]}"], context)
        raise
    return _decoded_mean(gathered, compressor, rows.shape[1]), rows - compressor.decode(payload, rows.shape[1])


def gather_mean(rows: torch.Tensor, compressor: Compressor, collective: Collective, simulated: bool,
                leaves: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, left)`` of ``rows`` (``[count, numel]``, one row per simulated rank or
    this rank's) by one phase: every rank's whole row, compressed, gathered by every
    rank (an all-gather), and the mean of the decoded rows in rank order (the same
    bits everywhere); what a row's payload lost is its residual. Bytes per rank:
    ``W - 1`` payloads. ``leaves`` only name what a failed collective left unchanged."""
    numel = rows.shape[1]
    payloads = [compressor.encode(row) for row in rows]
    sent = torch.stack([compressor.decode(payload, numel) for payload in payloads])
    if simulated:  # every rank's payload is here, decoded once
        return _mean_in_rank_order(sent, len(sent)), rows - sent
    try:
        gathered = _gathered_payloads(payloads[0], collective)
    except RuntimeError as error:  # a peer died, a timeout: nothing was written anywhere
        raise nothing_changed(leaves, "A compressed averaging", error, stage="its all-gather") from error
    mine = collective.rank  # (its own payload is decoded already)
    decoded = (sent[0] if q == mine else compressor.decode(tuple(p), numel) for q, p in enumerate(gathered))
    return _mean_in_rank_order(decoded, len(gathered)), rows - sent


def exchanged_gather(rows: torch.Tensor, compressor: Compressor, collective: Collective) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gather_mean` of this replica's row (``[1, numel]``) over a replica axis
    (:class:`~puredist.VmapCollective`'s ``all_gather``)."""
    payload = compressor.encode(rows[0])
    gathered = collective.all_gather(list(payload))  # row q: replica q's payload
    rows_of = [tuple(t[q] for t in gathered) for q in range(collective.world_size)]
    return _decoded_mean(rows_of, compressor, rows.shape[1]), rows - compressor.decode(payload, rows.shape[1])


def _decoded_mean(payloads: list[Payload], compressor: Compressor, numel: int) -> torch.Tensor:
    """The mean of ``payloads`` decoded, in list order (:func:`_mean_in_rank_order`)."""
    return _mean_in_rank_order((compressor.decode(tuple(payload), numel) for payload in payloads), len(payloads))


def raise_non_finite(where: list[str], context: str) -> None:
    raise ValueError(
        f"Arg ``params`` (plus the error-feedback residuals) holds inf or NaN ({'; '.join(where)}): a block's scale, "
        f"and then the residual, would be non-finite for good. Nothing was sent, on any rank, and the state passed "
        f"in is unchanged. Where the params are (an AMP overflow), skip this step; where a residual is (marked "
        f"'its residual'), or both are finite and their sum is not, no later step clears it: reset the residuals "
        f"(zeros, as init makes them) or reload a checkpoint. {context}"
    )


def two_phase_mean(
    rows: torch.Tensor, compressor: Compressor, collective: Collective, simulated: bool, leaves: list[torch.Tensor],
    context: str,
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
        means = [_mean_in_rank_order((kept[q, c] for q in range(world)), world) for c in owners]
    else:
        try:
            stand_in = next(p for p in payloads[0] if p is not None)  # the slot to oneself: never sent, never read
            received = _exchanged_chunks(_stacked([p if p is not None else stand_in for p in payloads[0]]), collective)
        except RuntimeError as error:  # a peer died, a timeout: nothing was written anywhere
            raise nothing_changed(leaves, "A compressed averaging", error, stage="its all-to-all (phase 1)") from error
        mine = collective.rank
        means = [_mean_in_rank_order(
            (kept[0, mine] if q == mine else compressor.decode(p, chunk) for q, p in enumerate(received)), world
        )]
    # phase 2: every owner's mean, compressed, to everybody
    final_payloads, finals, owed = zip(*(_phase_two(m, compressor, world) for m in means))
    if simulated:
        decoded = finals
    else:
        try:
            gathered = _gathered_payloads(final_payloads[0], collective)
        except RuntimeError as error:
            raise nothing_changed(leaves, "A compressed averaging", error, stage="its all-gather (phase 2)") from error
        decoded = [finals[0] if c == collective.rank else compressor.decode(p, chunk) for c, p in enumerate(gathered)]
    mean = torch.cat(decoded)
    if not bool(torch.isfinite(mean).all()):  # (finite rows: only an owner's refusal makes it non-finite)
        raise_unheld([c for c, d in enumerate(decoded) if not torch.isfinite(d).all()], chunk, numel, world, context)
    left = chunks - kept
    for row, owner in enumerate(owners):  # the owner sends its chunk exact next time, with what phase 2 lost
        left[row, owner] = owed[row]
    return mean[:numel], left.reshape(count, -1)[:, :numel]


def exchanged_mean(rows: torch.Tensor, compressor: Compressor, collective: Collective) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, left)`` of this replica's row (``[1, numel]``) by the two phases over a
    replica axis (:class:`~puredist.VmapCollective`'s ``all_to_all`` and
    ``all_gather``). The replica's index is a tensor there, so what depends on it is a
    selection, not a branch: every chunk is encoded (its own too, never read). The
    values are not read on the host: an inf or NaN, or an owner's residual that fp32
    cannot hold, is not refused here but spreads into the means and the residuals
    (the same step on a SimulatedCollective, or a real rank, refuses it)."""
    world, numel = collective.world_size, rows.shape[1]
    chunk = -(-numel // world)
    chunks = torch.nn.functional.pad(rows[0], (0, chunk * world - numel)).view(world, chunk)
    index = collective.replica_index(rows)
    mine = (torch.arange(world, device=rows.device) == index)[:, None]  # this replica's chunk, [world, 1]
    payloads = [compressor.encode(chunks[c]) for c in range(world)]
    kept = torch.where(mine, chunks, torch.stack([compressor.decode(p, chunk) for p in payloads]))
    received = collective.all_to_all(list(_stacked(payloads)))  # row q: replica q's payload of this one's chunk
    own = chunks.index_select(0, index.view(1))[0]
    mean = _mean_in_rank_order((torch.where(mine[q], own, compressor.decode(tuple(t[q] for t in received), chunk))
                                for q in range(world)), world)
    final_payload, _, owed = _phase_two(mean, compressor, world)
    gathered = collective.all_gather(list(final_payload))  # row c: owner c's
    decoded = torch.cat([compressor.decode(tuple(t[c] for t in gathered), chunk) for c in range(world)])
    left = torch.where(mine, owed, chunks - kept)
    return decoded[:numel], left.reshape(1, -1)[:, :numel]


def _phase_two(mean: torch.Tensor, compressor: Compressor, world: int) -> tuple[Payload, torch.Tensor, torch.Tensor]:
    """An owner's phase-2 payload of its ``mean`` (a chunk), that payload decoded, and
    the owner's next residual there: ``world * (mean - decoded)``, what phase 2 lost,
    scaled to be sent exact next time (computed in fp64, rounded to fp32 once). Where
    fp32 cannot hold it (a loss above ``FLT_MAX / world``: top-k dropping a mean near
    fp32's largest, a half step of a 4-bit block at 15 ranks or more), error feedback
    cannot carry what was lost: the payload's floating-point tensors are NaN, so that
    every rank decodes a non-finite chunk (the owner's refusal, told to every rank
    without a collective of its own). No value is read on the host here."""
    payload = compressor.encode(mean)
    owed = (world * (mean.double() - compressor.decode(payload, mean.numel()).double())).float()
    held = torch.isfinite(owed).all()
    payload = tuple(torch.where(held, t, torch.nan) if t.is_floating_point() else t for t in payload)
    return payload, compressor.decode(payload, mean.numel()), owed


def raise_unheld(chunks: list[int], size: int, numel: int, world: int, context: str) -> None:
    """Every rank's refusal of a step whose owners of ``chunks`` (of ``size`` elements
    of the ``numel`` in the flat row) could not hold their residual in fp32 (see
    :func:`_phase_two`)."""
    raise ValueError(
        f"Arg ``params`` (plus the error-feedback residuals): on chunk(s) {_named(chunks, size, numel)} of the flat "
        f"row, {world} times what the compressed mean lost exceeds fp32's largest value, so error feedback cannot "
        f"carry it (values this near fp32's largest). Nothing was changed, on any rank, and the state passed in is "
        f"unchanged. Scale these values down, or average them uncompressed. {context}"
    )


def _named(chunks: list[int], size: int, numel: int) -> str:
    """The first three of ``chunks`` (of ``size`` elements of ``numel``) with their elements, and how many more."""
    named = ", ".join(f"{c} (elements {c * size} to {min((c + 1) * size, numel) - 1})" for c in chunks[:3])
    return named + (f" and {len(chunks) - 3} more" if len(chunks) > 3 else "")
