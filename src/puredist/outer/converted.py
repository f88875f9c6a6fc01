"""Converted fragments: a global copy on the parameters' device but in another dtype
(``global_dtype``) or sent in another (``comm_dtype``), synchronized with multi-tensor
kernels instead of a few kernels and conversions per leaf.

Where a fragment's leaves are plain tensors of one dtype on one device and the global
copy is on that device, at least as wide (no ``global_device``, no compressor), :func:`pseudo_gradient`
takes ``global - local`` in the global copy's dtype, a chunk of leaves at a time, into
one flat buffer in the dtype it is sent in (the fragment is then averaged as one
tensor); :func:`outer_grads` converts the mean back to the global copy's dtype in one
kernel; :func:`write_back` writes the new global parameters into the leaves
(converted; with a delay, ``local - snapshot + global``, the global copy rounded to
the leaves' dtype first). Each is elementwise what the per-leaf path of
:mod:`puredist.outer.sync` computes, so the results are the same bit for bit.

This module must not communicate.
"""

from __future__ import annotations

from typing import Sequence

import torch

from puredist._layout import Checked, layout_of, views_like
from puredist.collectives import Collective, DistributedCollective
from puredist.outer.config import OuterConfig

_CHUNK_BYTES = 1 << 26
"""Leaves whose differences are taken at once (64 MiB in the global copy's dtype): the
temporaries of a chunk stay small beside the fragment's buffer being sent."""


def on_device(config: OuterConfig, leaves: Checked) -> bool:
    """Whether ``leaves`` (a fragment's, or all) and their global copy are converted
    with multi-tensor kernels: plain tensors of one dtype on one device, the global
    copy on their device."""
    return config.global_device is None and leaves.layout.plain and leaves.layout.derived(
        "one dtype and device", lambda: len({(t.dtype, t.device) for t in leaves}) == 1
    )


def converts(config: OuterConfig, leaves: Checked, collective: Collective) -> bool:
    """Whether a synchronization of ``leaves`` sends one flat converted buffer: as
    :func:`on_device`, without a compressor, on real ranks (simulated ones need the
    replica axis leading in every tensor), with a global copy at least as wide as the
    leaves (a multi-tensor difference promotes: of a narrower copy it would round
    once in the leaves' dtype, where the per-leaf path rounds the leaf first)."""
    if config.same_place or config.compressor is not None or not isinstance(collective, DistributedCollective):
        return False
    if not on_device(config, leaves):
        return False
    leaf_dtype = leaves[0].dtype
    global_dtype = config.global_dtype or leaf_dtype
    return torch.promote_types(leaf_dtype, global_dtype) == global_dtype


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


def pseudo_gradient(globals_: list[torch.Tensor], locals_: list[torch.Tensor],
                    dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``global - local`` of each leaf, in the global copy's dtype, sent in ``dtype``:
    ``(one flat buffer, its views shaped like the leaves)``."""
    layout = layout_of(globals_)
    _, numel, _ = layout.summary(globals_)
    flat = torch.empty(numel, dtype=dtype, device=locals_[0].device)
    views = views_like(flat, globals_)
    with torch.no_grad():
        for start, end in layout.derived("chunks", lambda: _chunks(globals_)):
            torch._foreach_copy_(views[start:end], torch._foreach_sub(globals_[start:end], locals_[start:end]))
    return flat, views


def outer_grads(pseudo: Sequence[torch.Tensor], targets: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The averaged pseudo-gradients in the global copy's dtype, where they are the
    views :func:`pseudo_gradient` made (one conversion of the buffer); ``None`` where
    they are not (a loaded checkpoint's, one tensor per leaf)."""
    sent = pseudo[0]._base  # (per-call views: looked at, not cached by layout)
    if sent is None or sent.dim() != 1 or sent.data_ptr() != pseudo[0].data_ptr() \
            or sent.numel() != layout_of(targets).summary(targets)[1]:
        return None
    dtype = targets[0].dtype
    return list(pseudo) if sent.dtype == dtype else views_like(sent.to(dtype), targets)


def write_back(locals_: list[torch.Tensor], targets: list[torch.Tensor], snapshot: Sequence[torch.Tensor]) -> None:
    """The new global parameters ``targets`` into the leaves ``locals_``, converted to
    their dtype; with a ``snapshot`` (a delay), the progress made while the
    synchronization ran is kept: ``local - snapshot + global``."""
    with torch.no_grad():
        if not snapshot:
            torch._foreach_copy_(locals_, targets)
            return
        if targets[0].dtype != locals_[0].dtype:  # (converted first: no allocation between the writes)
            _, numel, _ = layout_of(targets).summary(targets)
            converted = views_like(torch.empty(numel, dtype=locals_[0].dtype, device=locals_[0].device), targets)
            torch._foreach_copy_(converted, targets)
            targets = converted
        torch._foreach_sub_(locals_, list(snapshot))
        torch._foreach_add_(locals_, targets)


def snapshot(locals_: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A copy of the leaves (one dtype and device): views of one new buffer."""
    _, numel, _ = layout_of(locals_).summary(locals_)
    copy = views_like(torch.empty(numel, dtype=locals_[0].dtype, device=locals_[0].device), locals_)
    with torch.no_grad():
        torch._foreach_copy_(copy, locals_)
    return tuple(copy)
