"""The bucket plan of one collective: how a list of tensors is cut into bounded buckets, a
pure function of the tensors' metadata.

Tensors are grouped by ``(device, dtype)`` in order of first appearance (so nothing is
ever promoted: a bf16 tensor is reduced as bf16), and each group's elements are
streamed, in order, into buckets of at most ``bucket_bytes``. Every bucket is
*staged*: its pieces are copied into one flat buffer, the buffer is reduced, and the
result is copied back only once its collective has succeeded — so a tensor never
holds a partial sum, whatever fails.

A contiguous tensor may be cut between buckets: a bucket holds *pieces*, flat element
ranges ``[start, stop)`` of a tensor. A non-contiguous tensor is never cut (a bucket
holds it whole; one larger than ``bucket_bytes`` gets a bucket of its own size).
Pieces of one tensor come in increasing order and buckets complete in order, so after
``k`` buckets every tensor holds its result in a leading range of its elements and its
old values after it.

The plan depends only on the tensors' devices, dtypes, sizes and contiguity; the
collective checks those are equal on every rank before it reduces (unless told not
to), so every rank issues the same collectives in the same order.

Two types, one for each question: :class:`PlannedBucket` is what :func:`plan_buckets`
cuts (which pieces, how many bytes); :class:`BucketLayout` adds, once per layout, what
staging it needs (device, dtype, the shapes of its views, the cut pieces' ranges).

This module must not allocate, copy or communicate: it reads metadata only.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

_FOLD_BYTES = 1 << 18
"""Average piece size from which a bucket divides into its targets (256 KiB: a pass
over them costs more than a kernel launch per piece on any device)."""


class Piece(NamedTuple):
    """Elements ``[start, stop)`` (flat, row-major) of the tensor at ``index``."""

    index: int
    start: int
    stop: int


class PlannedBucket(NamedTuple):
    """One collective call over a staging buffer.

    Attributes:
        pieces: what the buffer holds, in buffer order.
        nbytes: the buffer's size.
    """

    pieces: tuple[Piece, ...]
    nbytes: int


def plan_buckets(
    tensors: Sequence[torch.Tensor], bucket_bytes: int | Callable[[torch.device], int], *, alone_from: int | None = None
) -> list[PlannedBucket]:
    """Stream ``tensors`` into buckets of at most ``bucket_bytes`` of one device and dtype.

    Args:
        tensors: the tensors to reduce, in the (rank-consistent) order given.
        bucket_bytes: the staging size of one bucket, ``>= 1`` (a bucket holds at least
            one element, and a non-contiguous tensor whole); or a function giving it
            for a device.
        alone_from: contiguous tensors of at least this many bytes get buckets of
            their own (cut at ``bucket_bytes``), never shared with another tensor: a
            broadcast source then sends them from their own storage, with no copy.

    Returns:
        The buckets, in the order their collectives are issued; every element of every
        tensor lies in exactly one piece.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype), []).append(index)

    buckets: list[PlannedBucket] = []
    for (device, _), indices in groups.items():
        limit = bucket_bytes(device) if callable(bucket_bytes) else bucket_bytes
        pieces: list[Piece] = []
        used = 0

        def close() -> None:
            nonlocal pieces, used
            if pieces:
                buckets.append(PlannedBucket(tuple(pieces), used))
            pieces, used = [], 0

        for index in indices:
            tensor = tensors[index]
            numel, size = tensor.numel(), tensor.element_size()
            if not tensor.is_contiguous():
                if used + numel * size > limit:
                    close()
                pieces.append(Piece(index, 0, numel))
                used += numel * size
                continue
            alone = alone_from is not None and numel * size >= alone_from
            if alone:
                close()
            start = 0
            while start < numel:
                room = (limit - used) // size
                if room <= 0 and pieces:
                    close()
                    continue
                stop = min(numel, start + max(room, 1))
                pieces.append(Piece(index, start, stop))
                used += (stop - start) * size
                start = stop
            if alone:
                close()
        close()
    return buckets


class BucketLayout(NamedTuple):
    """One bucket of a plan with what staging it needs, derived once per layout.

    Attributes:
        position: the bucket's index in the plan.
        planned: its pieces and size.
        device, dtype: of every piece (a bucket holds one of each).
        numels, shapes: of each piece's staging view (a whole tensor's shape; a cut
            piece is flat).
        cuts: ``(position in the bucket, tensor index, start, stop)`` of the pieces
            that are cut out of a tensor (at most the first and the last).
        indices: each piece's tensor index, in buffer order.
        divides_into_targets: a division after the collective writes its quotient
            straight into the targets (one pass over the bytes instead of two) rather
            than dividing the buffer and copying it (one kernel per bucket instead of
            one per piece): for pieces of :data:`_FOLD_BYTES` or more on average,
            where the bytes cost more than the launches.
    """

    position: int
    planned: PlannedBucket
    device: torch.device
    dtype: torch.dtype
    numels: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    cuts: tuple[tuple[int, int, int, int], ...]
    divides_into_targets: bool
    indices: tuple[int, ...]

    def targets(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors (or flat ranges of them) this bucket's pieces are, in buffer order."""
        targets = list(map(tensors.__getitem__, self.indices))  # (in C: no Python work per piece)
        for k, index, start, stop in self.cuts:
            targets[k] = targets[k].detach().view(-1)[start:stop]
        return targets

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Views of a staging ``buffer`` shaped like the targets (written under ``no_grad``)."""
        with torch.no_grad():
            return [flat.view(shape) for flat, shape in zip(buffer.split(self.numels), self.shapes)]


def bucket_layouts(tensors: Sequence[torch.Tensor], plan: Sequence[PlannedBucket]) -> tuple[BucketLayout, ...]:
    """The :class:`BucketLayout` of each bucket of ``plan`` over ``tensors``."""
    layouts = []
    for position, bucket in enumerate(plan):
        first = tensors[bucket.pieces[0].index]
        numels, shapes, cuts = [], [], []
        for k, piece in enumerate(bucket.pieces):
            tensor = tensors[piece.index]
            whole = piece.start == 0 and piece.stop == tensor.numel()
            numels.append(piece.stop - piece.start)
            shapes.append(tuple(tensor.shape) if whole else (piece.stop - piece.start,))
            if not whole:
                cuts.append((k, piece.index, piece.start, piece.stop))
        folds = bucket.nbytes >= _FOLD_BYTES * len(bucket.pieces)
        layouts.append(BucketLayout(position, bucket, first.device, first.dtype, tuple(numels), tuple(shapes),
                                    tuple(cuts), folds, tuple(piece.index for piece in bucket.pieces)))
    return tuple(layouts)
