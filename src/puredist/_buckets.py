"""The bucket plan of one collective: a pure function of the tensors' metadata.

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
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch


class Piece(NamedTuple):
    """Elements ``[start, stop)`` (flat, row-major) of the tensor at ``index``."""

    index: int
    start: int
    stop: int


class Bucket(NamedTuple):
    """One collective call over a staging buffer.

    Attributes:
        pieces: what the buffer holds, in buffer order.
        nbytes: the buffer's size.
    """

    pieces: tuple[Piece, ...]
    nbytes: int


def plan_buckets(
    tensors: Sequence[torch.Tensor], bucket_bytes: int | Callable[[torch.device], int], *, alone_from: int | None = None
) -> list[Bucket]:
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

    buckets: list[Bucket] = []
    for (device, _), indices in groups.items():
        limit = bucket_bytes(device) if callable(bucket_bytes) else bucket_bytes
        pieces: list[Piece] = []
        used = 0

        def close() -> None:
            nonlocal pieces, used
            if pieces:
                buckets.append(Bucket(tuple(pieces), used))
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
