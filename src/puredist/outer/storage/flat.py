"""The flat storage: a fragment whose global copy (and outer state, and residuals)
are views of one buffer each (:mod:`~puredist.outer.storage.flat_layout` lays them
out at ``init``), synchronized as one tensor: the pseudo-gradient taken into the
fragment's own buffer, that one buffer averaged (or compressed, with the residuals'
buffer), the outer step taken on the buffers: a few kernels per fragment instead of a
few per leaf. Elementwise, the results are those of the per-leaf storage, bit for bit
in fp32 and fp64 with torch's for-loop and multi-tensor kernels; in 16-bit dtypes on a
CPU, and with the fused kernels (``fused=True``) in any, they may differ in the last
bit (those kernels round the vectorized body of a tensor and its tail differently,
and the flat buffer's tails are elsewhere).

Where the tensors of a step are not views of one buffer (a state rebuilt per leaf by
the pure ``update``'s copies, pseudo-gradients loaded from a checkpoint), each method
does what :class:`~puredist.outer.storage.base.Storage` does, per leaf.

This module must not communicate but through the collective it is given.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from puredist._inputs import checked
from puredist._layout import views_like
from puredist.collectives import Collective
from puredist.compression import Compressor, compressed_mean_flat_
from puredist.outer.storage.base import Fragment, Payload, Storage
from puredist.outer.storage.flat_layout import flat_base, flat_state


_SCRATCH: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Per flat global copy (held weakly): ``{purpose: (buffer, its per-leaf views)}``,
the buffers a synchronization of the fragment takes its pseudo-gradients and its
snapshot into, made once (views made at every synchronization would be host work
per leaf)."""


def _scratch(global_flat: torch.Tensor, globals_: Sequence[torch.Tensor],
             purpose: str) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The fragment's own buffer for ``purpose``, shaped as ``global_flat`` and viewed
    as ``globals_``: reused at each of its synchronizations (at most one of a
    fragment's is in flight: ``delay < sync_every``); it lives as long as the global
    copy (one more copy of the fragment, which the per-leaf path allocates at every
    synchronization instead)."""
    buffers = _SCRATCH.get(global_flat)
    if buffers is None:
        buffers = _SCRATCH[global_flat] = {}
    entry = buffers.get(purpose)
    if entry is None:
        buffer = torch.empty_like(global_flat)
        entry = buffers[purpose] = (buffer, tuple(views_like(buffer, globals_)))
    return entry


def flat_pseudo_gradient(global_flat: torch.Tensor, globals_: Sequence[torch.Tensor],
                         locals_: Sequence[torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``global - local`` of a flat fragment (its global copy ``global_flat``, viewed
    as ``globals_``) in the fragment's pseudo-gradient buffer (see :func:`_scratch`):
    ``(buffer, its views per leaf)``."""
    buffer, views = _scratch(global_flat, globals_, "pseudo-gradient")
    with torch.no_grad():
        torch._foreach_copy_(list(views), list(locals_))
        torch.sub(global_flat, buffer, out=buffer)
    return buffer, views


def flat_snapshot(global_flat: torch.Tensor, globals_: Sequence[torch.Tensor],
                  locals_: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A copy of a flat fragment's local parameters ``locals_``, as views of the
    fragment's snapshot buffer (see :func:`_scratch`): one multi-tensor copy."""
    _, views = _scratch(global_flat, globals_, "snapshot")
    with torch.no_grad():
        torch._foreach_copy_(list(views), list(locals_))
    return views


class Flat(Storage):
    """A fragment laid out flat, on real ranks (simulated ones need the replica axis
    leading in every tensor they average)."""

    def pseudo_gradient(self, fragment: Fragment) -> Payload:
        flat = flat_base(fragment.globals)
        if flat is None:
            return super().pseudo_gradient(fragment)
        buffer, views = flat_pseudo_gradient(flat, fragment.globals, fragment.locals)
        return Payload(checked([buffer]), views)

    def snapshot(self, fragment: Fragment) -> tuple:
        flat = flat_base(fragment.globals)
        if flat is None:
            return super().snapshot(fragment)
        return flat_snapshot(flat, fragment.globals, fragment.locals)

    def compress(self, payload: Payload, fragment: Fragment, compressor: Compressor, collective: Collective, *,
                 context: object) -> tuple[Sequence[torch.Tensor], list]:
        """With the residuals one buffer of the payload's size, both are overwritten
        in place once the synchronization succeeded (at most one fragment starts a
        synchronization at a count, and nothing communicates between its start and
        its application)."""
        residual = flat_base(fragment.residuals) if flat_base(fragment.globals) is not None else None
        if residual is None or residual.numel() != payload.sent[0].numel():  # (else the payload is per leaf)
            return super().compress(payload, fragment, compressor, collective, context=context)
        compressed_mean_flat_(payload.sent[0], residual, compressor, collective, context=context,
                              leaves=payload.leaves, residuals=fragment.residuals)
        return payload.leaves, fragment.residuals

    def establish(self, fragment: Fragment, grads: list) -> list:
        flats = _flats(fragment, grads)
        if flats is None:
            return super().establish(fragment, grads)
        with torch.no_grad():
            flats[0].sub_(flats[1])
        return fragment.globals

    def outer_step(self, fragment: Fragment, grads: list) -> tuple[list, list]:
        """One step of the buffers where the outer state is flat too (a field the
        optimizer returns anew is copied into its buffer, so the views stay the
        state); per leaf where not (e.g. a momentum buffer not made yet)."""
        flats = _flats(fragment, grads)
        state = flat_state(fragment.states) if flats is not None else None
        if state is None:
            return super().outer_step(fragment, grads)
        with torch.no_grad():
            (stepped,) = self.outer.update_([flats[0]], [flats[1]], [state])
            for old, new in zip(state, stepped):
                if new is not old:
                    old.copy_(new)
        return fragment.globals, fragment.states


def _flats(fragment: Fragment, grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(the global copy's buffer, the mean pseudo-gradients' buffer)`` where both are
    one buffer of the same shape, dtype and device (the flat pseudo-gradient
    made the second); ``None`` where not."""
    flat = flat_base(fragment.globals)
    sent = grads[0]._base if flat is not None else None  # (per-leaf views of one buffer, or a loaded checkpoint's)
    if (sent is None or sent.data_ptr() != grads[0].data_ptr() or sent.shape != flat.shape
            or sent.dtype != flat.dtype or sent.device != flat.device):
        return None
    return flat, sent
