"""What a collective accepts: checked for every tensor before any is touched.

A tensor that cannot be averaged correctly is refused with a message naming its
position and the reason, before any collective is issued, so an unsupported tensor
late in a list can never leave the earlier ones averaged and the later ones not:

- sparse (and other non-strided) layouts, ``meta`` tensors (no data), float8 and
  integer or bool dtypes;
- a tensor whose elements overlap in memory (``expand``-ed, stride 0): writing its
  mean would write one memory location several times;
- two tensors sharing memory (the same tensor passed twice, or overlapping views):
  each would be reduced from values the other has already replaced.

Complex tensors are averaged as their real view (real and imaginary parts are
averaged independently, which is the complex mean). A DTensor is averaged as its
local shard (see :mod:`puredist._dtensors`); one with a ``Partial`` placement is
refused.
"""

from __future__ import annotations

from typing import Sequence

import torch

from puredist._dtensors import check_not_pending, local_shard

_FLOAT8 = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


def is_transformed(tensor: object) -> bool:
    """Whether ``tensor`` is wrapped by a ``torch.func`` transform (mapped by ``vmap``,
    tracked by ``grad``): its values cannot be read on the host, nor its memory."""
    return isinstance(tensor, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(tensor)


def _label(noun: str, position: int, tensor: torch.Tensor) -> str:
    return f"{noun} {position} (shape {tuple(tensor.shape)}, {tensor.dtype}, {tensor.device})"


def _may_overlap_itself(tensor: torch.Tensor) -> bool:
    """Whether two elements of ``tensor`` may share memory: unless, taking its
    dimensions by increasing stride, each stride steps over everything the smaller
    ones span (true of every contiguous tensor, permutation and slice)."""
    spanned = 0
    for size, stride in sorted(((n, abs(s)) for n, s in zip(tensor.shape, tensor.stride()) if n > 1), key=lambda d: d[1]):
        if stride <= spanned:
            return True
        spanned += (size - 1) * stride
    return False


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` bytes of memory ``tensor`` may touch."""
    extent = sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.data_ptr()
    return start, start + (extent + 1) * tensor.element_size()


def checked_for_reduction(
    tensors: Sequence[object], *, arg: str = "tensors", noun: str = "tensor", in_place: bool = True
) -> list[torch.Tensor]:
    """Check that every tensor can be reduced, and return them as the real-valued
    tensors to reduce (a complex tensor becomes its ``view_as_real``, a DTensor its
    local shard; writes go to them).

    Args:
        tensors: the tensors, in the order given.
        arg: the argument's name, for messages.
        noun: what an element is called in messages (``"leaf"`` for a pytree's leaves).
        in_place: whether the mean will be written into the tensors. ``False`` (an
            out-of-place mean, which may run under ``torch.func`` transforms, where
            memory is not observable) skips the memory checks and returns the
            tensors as they are, complex ones included.

    Raises:
        TypeError: an element is not a tensor, or has an integer, bool or float8 dtype.
        ValueError: a sparse or meta tensor, overlapping elements, memory shared
            between two tensors, or a DTensor with a ``Partial`` placement — naming
            the tensor(s) and the reason.
    """
    checked: list[torch.Tensor] = []
    for position, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"Arg ``{arg}`` must be a pytree of tensors; {noun} {position} is {type(tensor).__name__}: {tensor!r}."
            )
        label = _label(noun, position, tensor)
        check_not_pending(tensor, arg, label)
        if in_place:
            tensor = local_shard(tensor)  # a DTensor's own shard, written in place
        if tensor.layout != torch.strided:
            raise ValueError(f"Arg ``{arg}``: {label} has layout {tensor.layout}; only dense tensors can be averaged.")
        if tensor.is_meta:
            raise ValueError(f"Arg ``{arg}``: {label} is a meta tensor: it holds no values to average.")
        if tensor.dtype in _FLOAT8:
            raise TypeError(
                f"Arg ``{arg}``: {label}: float8 cannot be summed portably by the backends; "
                "average a bf16 or fp16 copy instead."
            )
        if not (tensor.is_floating_point() or tensor.is_complex()):
            raise TypeError(
                f"Arg ``{arg}``: {label}: averaging needs floating-point or complex tensors "
                "(the mean of integers or bools is not one of them)."
            )
        if not in_place:
            checked.append(tensor)
            continue
        if _may_overlap_itself(tensor):
            raise ValueError(
                f"Arg ``{arg}``: {label} has overlapping elements (strides {tensor.stride()}, e.g. from "
                "expand()): its mean cannot be written back; pass a contiguous copy."
            )
        checked.append(torch.view_as_real(tensor.detach()) if tensor.is_complex() else tensor)
    if in_place:
        _check_disjoint(checked, arg, noun)
    return checked


def _check_disjoint(tensors: Sequence[torch.Tensor], arg: str, noun: str) -> None:
    # sorted by (device, start): a tensor overlapping any later one overlaps the next one
    spans = sorted((str(t.device), *_byte_span(t), position) for position, t in enumerate(tensors) if t.numel() > 0)
    for (device, _, end, first), (next_device, start, _, second) in zip(spans, spans[1:]):
        if device == next_device and start < end:
            a, b = sorted((first, second))
            raise ValueError(
                f"Arg ``{arg}``: {noun}s {a} and {b} share memory (the same tensor twice, or overlapping "
                "views): each would be averaged from values the other already replaced. Pass each "
                "tensor once."
            )
