"""What a list of tensors' metadata decides, worked out once and reused.

Validation (:mod:`puredist._inputs`), the rank check's layout summary
(:mod:`puredist._consistency`) and the bucket plan (:mod:`puredist.staging.plan`) depend
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
cache: the tensors are validated and planned afresh. A list of DTensors (FSDP2's
parameters) is keyed on its local shards and held to the same DTensor specs (the
objects: a DTensor redistributed or rebuilt has a new one; the cache keeps the specs,
metadata that holds the mesh). Mixed lists, other subclasses and tensors whose
metadata cannot be read (sparse, functorch-wrapped) are not cached: a fresh
:class:`Layout` serves one call.

This module must not touch tensor values or talk to other ranks (it makes views:
:func:`views_like`).
"""

from __future__ import annotations

import hashlib
import operator
from typing import Any, Callable, Sequence

import torch
from torch._C._dynamo.guards import TensorGuards

from puredist._dtensors import dtensor_type, is_dtensor, local_shards, sharding_signature

_CAPACITY = 64
"""Lists of addresses kept (the least recently used dropped first): a few per model and collective."""

_VARIANTS = 4
"""Layouts kept per list of addresses (the oldest dropped first): the same tensors
seen in and out of inference mode or autocast, with and without ``requires_grad``."""

_CACHE: dict[tuple[tuple[int, ...], bool], list[tuple[TensorGuards, tuple | None, "Layout"]]] = {}


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


class Checked(list):
    """The tensors to reduce, as :func:`puredist._inputs.checked` returns them: a list
    of the tensors as given (the leaves a caller works with), known to pass the checks.

    Attributes:
        reduced: the real-valued tensors the collective writes (a complex tensor's
            ``view_as_real``, a DTensor's local shard; the others as given).
        layout: their :class:`Layout` (summary, bucket plans).
    """

    reduced: list[torch.Tensor]
    layout: Layout


def all_real_shards(tensors: Sequence[torch.Tensor], layout: Layout) -> bool:
    """Whether ``tensors`` (of ``layout``) are all real-valued DTensors (once per layout)."""
    return layout.derived(
        "real shards", lambda: all(map(is_dtensor, tensors)) and not any(t.is_complex() for t in tensors)
    )


def _summary(tensors: Sequence[torch.Tensor]) -> tuple[int, int, int]:
    layouts = ";".join(
        f"{t.device.type},{t.dtype},{tuple(t.shape)},{t.is_contiguous()}{sharding_signature(t)}" for t in tensors
    )
    return len(tensors), sum(t.numel() for t in tensors), digest(layouts)


PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
"""The tensor types whose metadata is read as it is (no DTensor, no other subclass)."""


_SPEC = operator.attrgetter("_spec")

_IS_NESTED = operator.attrgetter("is_nested")


def _cache_key(tensors: Sequence[object]) -> tuple[tuple[int, ...], Sequence[torch.Tensor], tuple | None] | None:
    """``(key, the tensors the guard checks, the DTensor specs)`` of ``tensors``: for
    plain tensors their data addresses, themselves and ``None``; for DTensors their
    local shards' addresses, the shards and each DTensor's spec (mesh, placements,
    global shape and stride, which decide the rest of a layout). ``None`` when they
    are not to be cached: a mix of kinds, other subclasses, non-tensors, sparse or
    functorch-wrapped tensors (no storage to key on), nested tensors (no shape), and
    while ``torch.compile`` traces (fake tensors; the traced code runs once per compilation)."""
    if torch.compiler.is_compiling():
        return None
    kinds = set(map(type, tensors))
    if kinds <= PLAIN_TYPES:
        guarded, specs = tensors, None
    elif kinds == {dtensor_type()}:  # (None while DTensor's module is not imported: no type is None)
        guarded, specs = local_shards(tensors), tuple(map(_SPEC, tensors))
        if not set(map(type, guarded)) <= PLAIN_TYPES:
            return None
    else:
        return None
    if any(map(_IS_NESTED, guarded)):  # (a guard's check of a nested tensor aborts the process)
        return None
    try:
        return tuple(map(torch.Tensor.data_ptr, guarded)), guarded, specs
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
    the same addresses and metadata (``_guards``; for DTensors, of their local
    shards, and the same specs), while it stays among the ``_CAPACITY`` used last.
    A call's cost is a read of each address (and spec) and one C++ check."""
    key = _cache_key(tensors)
    if key is None:
        return Layout(tensors)
    addresses, guarded, specs = key
    # inside inference mode a guard cannot tell an inference tensor from another (autograd's keys are excluded)
    addresses = (addresses, torch.is_inference_mode_enabled())
    known = _CACHE.pop(addresses, None)
    if known is not None:
        _CACHE[addresses] = known  # the most recently used last: fresh tensors made per call evict the others
    for guards, known_specs, layout in known or ():
        if guards.check(*guarded) and (
            specs is known_specs is None
            or specs is not None and known_specs is not None and all(map(operator.is_, specs, known_specs))
        ):
            return layout
    if known is None:
        if len(_CACHE) >= _CAPACITY:
            del _CACHE[next(iter(_CACHE))]
        known = _CACHE[addresses] = []
    elif len(known) >= _VARIANTS:
        del known[0]
    layout = Layout(tensors, plain=specs is None)
    known.append((_guards(guarded), specs, layout))
    return layout


def views_like(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the 1-D ``flat`` shaped like ``like``, end to end (one C++ call)."""
    return list(torch._C._nn.unflatten_dense_tensors(flat, list(like)))
