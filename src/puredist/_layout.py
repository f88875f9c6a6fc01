"""What a list of tensors' metadata decides, worked out once and reused.

Validation (:mod:`puredist._inputs`), the rank check's layout summary
(:mod:`puredist._consistency`) and the bucket plan (:mod:`puredist._buckets`) depend
only on the tensors' metadata: addresses, shapes, strides, dtypes and devices. A
training loop passes the same tensors every step, so all of it is computed at the
first call and looked up afterwards: a call's host work is then one pass reading each
tensor's metadata (the cache key) plus work per bucket, instead of string formatting
and checks per tensor.

The cache holds metadata only, never a tensor: it keeps no memory alive, and a tensor
freed and another allocated at the same address with the same metadata gets the same
(still correct) entry. New storage (``p.data = ...``), a new shape, stride, dtype or
device makes a new key, which is validated and planned afresh. DTensors (their
sharding is part of what must match) and tensors whose metadata cannot be read
(sparse, functorch-wrapped) are not cached: a fresh :class:`Layout` serves one call.

This module must not touch tensor values or talk to other ranks (it makes views:
:func:`views_like`).
"""

from __future__ import annotations

import hashlib
import operator
from typing import Any, Callable, Sequence

import torch

from puredist._dtensors import sharding_signature

_CAPACITY = 64
"""Layouts kept (the oldest made dropped first): a few per model and collective."""

_CACHE: dict[tuple, "Layout"] = {}


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


def _key(tensors: Sequence[object]) -> tuple | None:
    """The cache key of ``tensors``, or ``None`` when they are not to be cached."""
    kinds = set(map(type, tensors))
    if not kinds <= PLAIN_TYPES:
        return None  # DTensors, other subclasses, non-tensors: one call at a time
    try:
        return (
            tuple(map(torch.Tensor.data_ptr, tensors)),
            tuple(map(torch.Tensor.stride, tensors)),
            tuple(map(_METADATA, tensors)),
            # an inference tensor may be written only in inference mode: both decide the in-place checks
            tuple(map(torch.Tensor.is_inference, tensors)),
            torch.is_inference_mode_enabled(),
        )
    except (RuntimeError, NotImplementedError):  # sparse or functorch-wrapped: no storage to key on
        return None


PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
"""The tensor types whose metadata is read as it is (no DTensor, no other subclass)."""
_METADATA = operator.attrgetter("shape", "dtype", "device")


def layout_of(tensors: Sequence[object]) -> Layout:
    """The (cached) :class:`Layout` of ``tensors``: the same object for every list of
    the same metadata, while it stays among the last ``_CAPACITY`` made."""
    key = _key(tensors)
    if key is None:
        return Layout(tensors)
    layout = _CACHE.get(key)  # one lookup: hashing the key is a pass over every tensor's metadata
    if layout is None:
        if len(_CACHE) >= _CAPACITY:
            del _CACHE[next(iter(_CACHE))]
        layout = _CACHE[key] = Layout(tensors, plain=True)
    return layout


def views_like(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the 1-D ``flat`` shaped like ``like``, end to end (one C++ call)."""
    return list(torch._C._nn.unflatten_dense_tensors(flat, list(like)))
