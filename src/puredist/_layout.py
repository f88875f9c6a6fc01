"""What a list of tensors' metadata decides, worked out once and reused.

Validation (:mod:`puredist._inputs`), the rank check's layout summary
(:mod:`puredist._consistency`) and the bucket plan (:mod:`puredist._buckets`) depend
only on the tensors' metadata: addresses, shapes, strides, dtypes and devices. A
training loop passes the same tensors every step, so all of it is computed at the
first call and looked up afterwards: a call's host work is then a read of each
tensor's address (the cache key) and one C++ check of the rest of its metadata (the
guard ``torch.compile`` puts on its inputs), plus work per bucket, instead of string
formatting and checks per tensor.

The cache holds metadata only, never a tensor: it keeps no memory alive, and a tensor
freed and another allocated at the same address with the same metadata gets the same
(still correct) entry. New storage (``p.data = ...``), a new shape, stride, dtype or
device, or a change of ``requires_grad``, inference mode or autocast, misses the
cache: the tensors are validated and planned afresh. DTensors (their
sharding is part of what must match) and tensors whose metadata cannot be read
(sparse, functorch-wrapped) are not cached: a fresh :class:`Layout` serves one call.

This module must not touch tensor values or talk to other ranks (it makes views:
:func:`views_like`).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence

import torch
from torch._C._dynamo.guards import TensorGuards

from puredist._dtensors import sharding_signature

_CAPACITY = 64
"""Layouts kept (the oldest made dropped first): a few per model and collective."""

_VARIANTS = 4
"""Layouts kept per list of addresses (the oldest dropped first): the same tensors
seen in and out of inference mode or autocast, with and without ``requires_grad``."""

_CACHE: dict[tuple[int, ...], list[tuple[TensorGuards, "Layout"]]] = {}


def digest(text: str) -> int:
    """A signed 64-bit digest of ``text`` (the same on every rank and run)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


class Layout:
    """The metadata-derived facts of one list of tensors.

    Attributes:
        count: how many tensors.
        plain: every tensor is a plain tensor or parameter (no DTensor, no other
            subclass): what multi-tensor kernels take as they are.
        checked: whether the list passed the in-place reduction checks
            (:func:`puredist._inputs.checked`); set once it has.
        memo: derived data keyed by its maker's choice (bucket plans by cap, the
            rank check's summary): see :meth:`derived`.
    """

    __slots__ = ("count", "plain", "checked", "memo")

    def __init__(self, tensors: Sequence[torch.Tensor], *, plain: bool = False) -> None:
        self.count = len(tensors)
        self.plain = plain
        self.checked = False
        self.memo: dict[Any, Any] = {}

    def derived(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, computed at the first call with ``key`` and remembered."""
        value = self.memo.get(key)
        if value is None:
            value = self.memo[key] = make()
        return value

    def summary(self, tensors: Sequence[torch.Tensor]) -> tuple[int, int, int]:
        """``(count, total elements, digest of the layouts)`` of ``tensors`` (the list
        this layout describes): everything a bucket plan depends on, and a DTensor's
        sharding; what the rank check compares."""
        return self.derived("summary", lambda: _summary(tensors))


def _summary(tensors: Sequence[torch.Tensor]) -> tuple[int, int, int]:
    layouts = ";".join(
        f"{t.device.type},{t.dtype},{tuple(t.shape)},{t.is_contiguous()}{sharding_signature(t)}" for t in tensors
    )
    return len(tensors), sum(t.numel() for t in tensors), digest(layouts)


PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
"""The tensor types whose metadata is read as it is (no DTensor, no other subclass)."""


def _addresses(tensors: Sequence[object]) -> tuple[int, ...] | None:
    """The cache key of ``tensors``: their data addresses, or ``None`` when they are
    not to be cached (DTensors, other subclasses, non-tensors; sparse or
    functorch-wrapped tensors, which have no storage to key on)."""
    if not set(map(type, tensors)) <= PLAIN_TYPES:
        return None
    try:
        return tuple(map(torch.Tensor.data_ptr, tensors))
    except (RuntimeError, NotImplementedError):
        return None


def _guards(tensors: Sequence[torch.Tensor]) -> TensorGuards:
    """A check, in one C++ pass, that tensors have ``tensors``' metadata: dtypes,
    devices, shapes, strides, ``requires_grad`` and dispatch keys as seen under the
    current dispatch state. The keys tell an inference tensor from another and see
    inference mode and autocast, which decide whether the tensors may be written in
    place. (torch.compile's guard on its graph inputs.)"""
    return TensorGuards(
        *tensors,
        dynamic_dims_sizes=[list(t.shape) for t in tensors],  # sizes and strides as they are: none is dynamic
        dynamic_dims_strides=[list(t.stride()) for t in tensors],
    )


def layout_of(tensors: Sequence[object]) -> Layout:
    """The (cached) :class:`Layout` of ``tensors``: the same object for every list of
    the same addresses and metadata (``_guards``), while it stays among the last
    ``_CAPACITY`` made. A call's cost is a read of each address and one C++ check."""
    addresses = _addresses(tensors)
    if addresses is None:
        return Layout(tensors)
    known = _CACHE.get(addresses)
    for guards, layout in known or ():
        if guards.check(*tensors):
            return layout
    if known is None:
        if len(_CACHE) >= _CAPACITY:
            del _CACHE[next(iter(_CACHE))]
        known = _CACHE[addresses] = []
    elif len(known) >= _VARIANTS:
        del known[0]
    layout = Layout(tensors, plain=True)
    known.append((_guards(tensors), layout))
    return layout


def views_like(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the 1-D ``flat`` shaped like ``like``, end to end (one C++ call)."""
    return list(torch._C._nn.unflatten_dense_tensors(flat, list(like)))
