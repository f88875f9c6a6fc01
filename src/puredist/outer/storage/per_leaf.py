"""The per-leaf storage: a global copy anywhere (on the host, ``global_device``), in any
dtype, of leaves of mixed dtypes or devices: one conversion per leaf on the way out
(the pseudo-gradient, sent in ``comm_dtype``) and on the way back (the mean into the
global copy's place, the write-back into the leaf's).

This module must not communicate.
"""

from __future__ import annotations

from typing import Sequence

import torch

from puredist._dtensors import is_dtensor
from puredist.outer.storage.base import Fragment, Payload, Storage


def pseudo_gradient(global_param: torch.Tensor, leaf: torch.Tensor, comm_dtype: torch.dtype | None) -> torch.Tensor:
    """``global - leaf`` in the global copy's dtype (an fp32 master's difference is
    fp32), on the leaf's device, in the dtype it is sent in (``comm_dtype``, or the
    global copy's). A pinned host copy goes up without blocking: the host writes it
    only after its next wait; a copy down to the host blocks, as the host computes
    with it at once."""
    difference = global_param.to(leaf.device, non_blocking=leaf.is_cuda) - leaf.to(global_param.dtype)
    return difference.to(comm_dtype or global_param.dtype)


def fetched(tensors: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` on the devices and in the dtypes of ``targets``. GPU tensors bound
    for the host are copied into page-locked memory without blocking, then one wait
    for the stream covers them all: the host's one wait of a synchronization with a
    host global copy (it is about to compute with the values)."""
    staged, streams = [], set()
    for tensor, target in zip(tensors, targets):
        if target.device.type == "cpu" and tensor.device.type == "cuda" and not is_dtensor(tensor):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            staged.append(host.copy_(tensor, non_blocking=True))
            streams.add(torch.cuda.current_stream(tensor.device))
        else:
            staged.append(tensor)
    for stream in streams:
        stream.synchronize()
    return [t.to(device=g.device, dtype=g.dtype) for t, g in zip(staged, targets)]


class PerLeaf(Storage):
    """A global copy of any place and dtype, converted leaf by leaf."""

    def pseudo_gradient(self, fragment: Fragment) -> Payload:
        with torch.no_grad():
            pseudo = tuple(pseudo_gradient(g, leaf.detach(), self.config.comm_dtype)
                           for g, leaf in zip(fragment.globals, fragment.locals))
        return Payload(list(pseudo), pseudo)

    def outer_grads(self, averaged: Sequence[torch.Tensor], fragment: Fragment) -> list:
        return fetched(averaged, fragment.globals)

    def write_back(self, fragment: Fragment, globals_: list, snapshot: tuple) -> list:
        """Converted per leaf. From a pinned host copy without blocking: the host
        writes it again only after the wait in :func:`fetched` of a later
        synchronization, which orders after this copy."""
        with torch.no_grad():
            for k, leaf in enumerate(fragment.locals):
                local = leaf.detach()
                if snapshot:  # keep the local progress made while the all-reduce ran
                    local.sub_(snapshot[k].to(local.device)).add_(
                        globals_[k].to(local.device, local.dtype, non_blocking=local.is_cuda))
                else:
                    local.copy_(globals_[k], non_blocking=local.is_cuda)
        return fragment.locals
