"""The bucket plan of one all-reduce: a pure function of the tensors' metadata.

Tensors are grouped by ``(device, dtype)`` in order of first appearance (so nothing is
ever promoted: a bf16 tensor is reduced as bf16), and each group is cut, in order,
into buckets of at most ``bucket_bytes``. A contiguous tensor of at least
``IN_PLACE_MIN_BYTES`` (or of ``bucket_bytes``) is reduced alone in its own storage,
with no copy: past that size one more all-reduce call costs less than copying the
tensor in and out of a staging buffer (on 2 Gloo ranks a call costs ~0.3 ms, a copy
~0.1 ms per MiB each way). Smaller tensors are *staged*: packed into one flat buffer,
reduced, and copied back. A non-contiguous tensor larger than ``bucket_bytes`` is
staged alone.

The plan depends only on the tensors' devices, dtypes, sizes and contiguity; the
collective checks those are equal on every rank before it reduces (unless told not
to), so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

IN_PLACE_MIN_BYTES = 2**20
"""Contiguous tensors from this size up are all-reduced in place, never copied."""


class Bucket(NamedTuple):
    """One all-reduce.

    Attributes:
        indices: positions, in the reduced tensor list, of the tensors it holds.
        staged: whether they are packed into a staging buffer (``False``: the single
            tensor is reduced in its own storage).
        nbytes: bytes of staging memory it needs (0 when not staged).
    """

    indices: tuple[int, ...]
    staged: bool
    nbytes: int


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _close(tensors: Sequence[torch.Tensor], indices: list[int]) -> Bucket:
    if len(indices) == 1 and tensors[indices[0]].is_contiguous():
        return Bucket(tuple(indices), staged=False, nbytes=0)
    return Bucket(tuple(indices), staged=True, nbytes=sum(_nbytes(tensors[i]) for i in indices))


def plan_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    """Cut ``tensors`` into buckets of at most ``bucket_bytes`` of one device and dtype.

    Args:
        tensors: the tensors to reduce, in the (rank-consistent) order given.
        bucket_bytes: the staging size of one bucket, ``>= 1``.

    Returns:
        The buckets, in the order their all-reduces are issued; every index of
        ``tensors`` appears in exactly one bucket.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype), []).append(index)

    buckets: list[Bucket] = []
    for indices in groups.values():
        current: list[int] = []
        current_bytes = 0
        for index in indices:
            nbytes = _nbytes(tensors[index])
            if nbytes >= bucket_bytes or (nbytes >= IN_PLACE_MIN_BYTES and tensors[index].is_contiguous()):
                buckets.append(_close(tensors, [index]))
                continue
            if current and current_bytes + nbytes > bucket_bytes:
                buckets.append(_close(tensors, current))
                current, current_bytes = [], 0
            current.append(index)
            current_bytes += nbytes
        if current:
            buckets.append(_close(tensors, current))
    return buckets
