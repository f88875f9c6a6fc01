"""Where a tensor's elements lie in memory, read from its metadata: whether two of
its elements may share a location (:func:`may_overlap_itself`), the bytes it may
touch (:func:`byte_span`), and whether two tensors whose byte ranges overlap have an
element in common (:func:`share_elements`). What an in-place collective refuses of
them is :mod:`puredist._inputs`'s.

This module must not import anything of puredist.
"""

from __future__ import annotations

import torch


def may_overlap_itself(tensor: torch.Tensor) -> bool:
    """Whether two elements of ``tensor`` may share memory: unless, taking its
    dimensions by increasing stride, each stride steps over everything the smaller
    ones span (true of every contiguous tensor, permutation and slice)."""
    spanned = 0
    for size, stride in sorted(((n, abs(s)) for n, s in zip(tensor.shape, tensor.stride()) if n > 1), key=lambda d: d[1]):
        if stride <= spanned:
            return True
        spanned += (size - 1) * stride
    return False


def byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` bytes of memory ``tensor`` may touch."""
    extent = sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.data_ptr()
    return start, start + (extent + 1) * tensor.element_size()


_EXACT_SPAN = 1 << 22
"""Elements up to which two tensors whose byte ranges overlap are compared element by
element (an int64 index per element of their common range: 32 MiB); beyond, they are
taken to share memory."""


def share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b``, whose byte ranges overlap, have an element in common:
    exactly for views of one element size on one grid (column slices, even and odd
    elements, a complex tensor's real and imaginary parts), else assumed."""
    size = a.element_size()
    (a_start, a_end), (b_start, b_end) = byte_span(a), byte_span(b)
    start, end = min(a_start, b_start), max(a_end, b_end)
    if b.element_size() != size or (a_start - b_start) % size:
        return True
    exact = _share_on_one_lattice(a, b, (b_start - a_start) // size)
    if exact is not None:
        return exact
    if (end - start) // size > _EXACT_SPAN:
        return True
    grid = torch.arange((end - start) // size)  # the common range's elements, numbered

    def elements(tensor: torch.Tensor, first: int) -> torch.Tensor:
        return grid.as_strided(tensor.shape, tensor.stride(), (first - start) // size).reshape(-1)

    return bool(torch.isin(elements(a, a_start), elements(b, b_start)).any())


def _share_on_one_lattice(a: torch.Tensor, b: torch.Tensor, offset: int) -> bool | None:
    """Whether ``a`` and ``b`` (same element size; ``b`` starts ``offset`` elements
    after ``a``) have an element in common, where both step through memory with the
    same strides (column slices of one matrix, of any size); ``None`` elsewhere, or
    where the search below would take more than ``_LATTICE_STEPS`` steps.

    An element is shared iff ``offset = sum_d k_d * stride_d`` for some index
    differences ``-(b.shape[d] - 1) <= k_d <= a.shape[d] - 1``. Largest stride first,
    only the ``k_d`` that leave a remainder the smaller strides can still reach are
    tried: one or two per dimension for views of one tensor."""
    if a.stride() != b.stride():
        return None
    dims = sorted((stride, n - 1, m - 1) for stride, n, m in zip(a.stride(), a.shape, b.shape) if n > 1 or m > 1)
    reach = []  # per dimension: the lowest and highest sum the smaller strides' terms reach
    low = high = 0
    for stride, up, down in dims:
        reach.append((low, high))
        low, high = low - down * stride, high + up * stride
    steps = [0]

    def solvable(d: int, rest: int) -> bool | None:
        if d < 0:
            return rest == 0
        steps[0] += 1
        if steps[0] > _LATTICE_STEPS:
            return None
        (stride, up, down), (low, high) = dims[d], reach[d]
        undecided = False
        for k in range(max(-down, -((high - rest) // stride)), min(up, (rest - low) // stride) + 1):
            found = solvable(d - 1, rest - k * stride)
            if found:
                return True
            undecided = undecided or found is None
        return None if undecided else False

    return solvable(len(dims) - 1, offset)


_LATTICE_STEPS = 256
