"""Converted storages: a global copy on the parameters' device but in another dtype
(``global_dtype``) or sent in another (``comm_dtype``), of plain leaves of one dtype
on one device, synchronized with multi-tensor kernels instead of a few kernels and
conversions per leaf.

:class:`OnDevice` converts the mean back to the global copy's dtype in one kernel
(where the mean is one buffer) and writes the new global parameters into the leaves
with multi-tensor copies (converted; with a delay, ``local - snapshot + global``,
the global copy rounded to the leaves' dtype first). :class:`Converted` also takes
``global - local`` in the global copy's dtype, a chunk of leaves at a time, into one
flat buffer in the dtype it is sent in, averaged as one tensor (on real ranks,
without a compressor). Each is elementwise what the per-leaf storage
(:mod:`~puredist.outer.storage.per_leaf`) computes, so the results are the same bit
for bit.

This module must not communicate.
"""

from __future__ import annotations

from typing import Sequence

import torch

from puredist._inputs import checked_like
from puredist._layout import layout_of, views_like
from puredist.outer.storage.base import Fragment, Payload
from puredist.outer.storage.per_leaf import PerLeaf, fetched

_CHUNK_BYTES = 1 << 26
"""Leaves whose differences are taken at once (64 MiB in the global copy's dtype): the
temporaries of a chunk stay small beside the fragment's buffer being sent."""


class OnDevice(PerLeaf):
    """A global copy on the leaves' device (plain leaves of one dtype and device), the
    pseudo-gradients taken per leaf (sent with a compressor, or on simulated ranks)."""

    def outer_grads(self, averaged: Sequence[torch.Tensor], fragment: Fragment) -> list:
        """One conversion of the buffer where the mean is the views
        :class:`Converted` made; per leaf where not (a loaded checkpoint's)."""
        targets = fragment.globals
        sent = averaged[0]._base  # (per-call views: looked at, not cached by layout)
        if sent is None or sent.dim() != 1 or sent.data_ptr() != averaged[0].data_ptr() \
                or sent.numel() != layout_of(targets).summary(targets)[1]:
            return fetched(averaged, targets)
        dtype = targets[0].dtype
        return list(averaged) if sent.dtype == dtype else views_like(sent.to(dtype), targets)

    def write_back(self, fragment: Fragment, globals_: list, snapshot: tuple) -> list:
        locals_ = fragment.locals
        with torch.no_grad():
            if not snapshot:
                torch._foreach_copy_(locals_, globals_)
                return locals_
            if globals_[0].dtype != locals_[0].dtype:  # (converted first: no allocation between the writes)
                _, numel, _ = layout_of(globals_).summary(globals_)
                converted = views_like(torch.empty(numel, dtype=locals_[0].dtype, device=locals_[0].device), globals_)
                torch._foreach_copy_(converted, globals_)
                globals_ = converted
            torch._foreach_sub_(locals_, list(snapshot))
            torch._foreach_add_(locals_, globals_)
        return locals_


class Converted(OnDevice):
    """:class:`OnDevice` with the pseudo-gradients sent as one flat buffer in the
    dtype they are sent in (a global copy at least as wide as the leaves)."""

    def pseudo_gradient(self, fragment: Fragment) -> Payload:
        """``global - local`` of each leaf, in the global copy's dtype, sent in
        ``comm_dtype`` (or the global copy's): one flat buffer, viewed per leaf."""
        globals_, locals_ = fragment.globals, fragment.locals
        dtype = self.config.comm_dtype or globals_[0].dtype
        layout = layout_of(globals_)
        _, numel, _ = layout.summary(globals_)
        flat = torch.empty(numel, dtype=dtype, device=locals_[0].device)
        views = views_like(flat, globals_)
        with torch.no_grad():
            for start, end in layout.derived("chunks", lambda: _chunks(globals_)):
                torch._foreach_copy_(views[start:end], torch._foreach_sub(globals_[start:end], locals_[start:end]))
        # a new buffer at every call, of the metadata the fragment and the dtype decide: checked once
        return Payload(checked_like(globals_, [flat], why=("converted", dtype)), tuple(views))

    def snapshot(self, fragment: Fragment) -> tuple:
        """A copy of the leaves (one dtype and device): views of one new buffer."""
        locals_ = fragment.locals
        _, numel, _ = layout_of(locals_).summary(locals_)
        copy = views_like(torch.empty(numel, dtype=locals_[0].dtype, device=locals_[0].device), locals_)
        with torch.no_grad():
            torch._foreach_copy_(copy, locals_)
        return tuple(copy)


def _chunks(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: consecutive runs of ``tensors`` of at most
    :data:`_CHUNK_BYTES` each (a larger tensor alone)."""
    chunks, start, size = [], 0, 0
    for end, tensor in enumerate(tensors):
        nbytes = tensor.numel() * tensor.element_size()
        if end > start and size + nbytes > _CHUNK_BYTES:
            chunks.append((start, end))
            start, size = end, 0
        size += nbytes
    chunks.append((start, len(tensors)))
    return chunks
