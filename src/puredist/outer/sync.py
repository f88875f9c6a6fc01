"""One fragment's synchronization: start it (pseudo-gradients, the averaging, a
snapshot with a delay) and apply it (the outer step on the global copy, the new
global parameters written into the local ones).

A synchronization's pseudo-gradient is ``global - local`` in the global copy's dtype,
sent in ``comm_dtype`` (or a compressor's payloads, with error feedback); applying it
steps the outer optimizer on the global copy (a fragment's first synchronization
only averages: ``g - mean(g - l) = mean(l)``) and writes ``local <- global_new``, or
``local <- global_new + (local - snapshot)`` with a delay (the progress made while
the all-reduce ran is kept).

Where the global copy is the parameters' own device and dtype and is sent as it is
(``OuterConfig.same_place``), pseudo-gradients and
write-backs are multi-tensor kernels over the whole fragment; where it is on their
device in another dtype or sent in another, likewise with conversions through one
flat buffer (:mod:`puredist.outer.converted`); otherwise (a host global copy, mixed
dtypes or devices) one conversion per leaf.

This module must not decide when a synchronization runs: that is
:mod:`puredist.outer.schedule`'s.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from puredist._dtensors import is_dtensor
from puredist._inputs import checked, checked_like
from puredist._layout import Checked
from puredist.collectives import Collective, CollectiveHandle, DistributedCollective
from puredist.compression import compressed_mean, compressed_mean_flat_
from puredist.optim import copies
from puredist.outer import converted, shards
from puredist.outer.config import OuterConfig
from puredist.outer.flat import flat_base, flat_pseudo_gradient, flat_snapshot, flat_state, step_flat
from puredist.outer.schedule import is_first_sync
from puredist.outer.state import InFlight, OuterState


class SyncContext(NamedTuple):
    """The rank-check context of one synchronization, formatted only when checked."""

    config: OuterConfig
    fragment: int
    start_step: int

    def __str__(self) -> str:
        return f"{self.config} sync of fragment {self.fragment} started at step {self.start_step}"


def pseudo_gradient(config: OuterConfig, global_param: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    """``global - leaf`` in the global copy's dtype (an fp32 master's difference is
    fp32), on the leaf's device, in the dtype it is sent in. A pinned host copy goes
    up without blocking: the host writes it only after its next wait; a copy down to
    the host blocks, as the host computes with it at once."""
    difference = global_param.to(leaf.device, non_blocking=leaf.is_cuda) - leaf.to(global_param.dtype)
    return difference.to(config.comm_dtype or global_param.dtype)


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


def issue(config: OuterConfig, pseudo, start_step: int, fragment: int, collective: Collective) -> CollectiveHandle:
    """Average ``pseudo`` in place: in the background with a delay, else at once
    (bounded staging memory; a failure raises here, before anything is applied)."""
    context = SyncContext(config, fragment, start_step)
    if config.delay:
        return collective.mean_(pseudo, async_op=True, context=context)
    collective.mean_(pseudo, context=context)
    return CollectiveHandle()


def start(config: OuterConfig, leaves: Checked, state: OuterState, fragment: int, indices: Sequence[int],
          collective: Collective, residuals: list, flat_globals: dict) -> InFlight:
    """Start ``fragment``'s synchronization (its leaves are ``indices``). With a
    compressor it completes here and its new residuals replace its entries of
    ``residuals``; where those are views of one buffer (a flat fragment, see
    :mod:`puredist.outer.flat`), the buffer is overwritten instead, once the
    synchronization succeeded: no other one starts in the same step (the fragments'
    first synchronizations differ, :func:`~puredist.outer.schedule.sync_number`) and nothing after it communicates before the step is applied.
    A flat fragment's global buffer goes into ``flat_globals[fragment]``, for
    :func:`apply` in the same step (derived once a step, not twice)."""
    with torch.no_grad():
        locals_ = [leaves[i] for i in indices]
        sent = flat = None
        if config.same_place and leaves.layout.plain:
            globals_ = [state.global_params[i] for i in indices]
            # real ranks average any tensor (simulated ones need the replica axis leading)
            flat = flat_base(globals_) if isinstance(collective, DistributedCollective) else None
            if flat is not None:  # the fragment's own buffer, averaged as one tensor; the state carries its views
                flat_globals[fragment] = flat
                pseudo_flat, pseudo = flat_pseudo_gradient(flat, globals_, locals_)
                sent = checked([pseudo_flat])
            else:
                # the differences' strides follow both operands': their layout is kept per layout of the leaves too
                pseudo = checked_like(globals_, torch._foreach_sub(globals_, locals_), why=("foreach_sub", leaves.layout))
        elif shards.on_shards(config, leaves):  # DTensors: their local shards, one multi-tensor kernel
            pseudo = shards.pseudo_gradient([state.global_params[i] for i in indices], locals_)
            context = shards.ShardedContext(SyncContext(config, fragment, state.step), leaves.layout.summary(leaves)[2])
            collective.mean_(pseudo, context=context)
            return InFlight(state.step, fragment, tuple(pseudo), (), CollectiveHandle())
        elif converted.converts(config, leaves, collective):  # one flat buffer in the dtype it is sent in
            globals_ = [state.global_params[i] for i in indices]
            dtype = config.comm_dtype or globals_[0].dtype
            pseudo_flat, pseudo = converted.pseudo_gradient(globals_, locals_, dtype)
            # a new buffer at every call, of the metadata the fragment and the dtype decide: checked once
            sent = checked_like(globals_, [pseudo_flat], why=("converted", dtype))
        else:
            pseudo = tuple(pseudo_gradient(config, state.global_params[i], leaves[i].detach()) for i in indices)
        if not config.delay:
            snapshot = ()
        elif flat is not None:  # the fragment's own snapshot buffer, as its pseudo-gradient's
            snapshot = flat_snapshot(flat, globals_, locals_)
        elif sent is not None:
            snapshot = converted.snapshot(locals_)
        else:
            snapshot = tuple(copies(locals_))
        apply_step = state.step + config.delay
        if config.compressor is None:
            handle = issue(config, pseudo if sent is None else sent, state.step, fragment, collective)
            return InFlight(apply_step, fragment, tuple(pseudo), snapshot, handle)
        context = str(SyncContext(config, fragment, state.step))
        kept = [residuals[i] for i in indices]
        residual_flat = flat_base(kept) if sent is not None else None
        if residual_flat is not None and residual_flat.numel() == pseudo_flat.numel():  # one tensor, averaged in place
            compressed_mean_flat_(pseudo_flat, residual_flat, config.compressor, collective, context=context,
                                  leaves=pseudo, residuals=kept)
            return InFlight(apply_step, fragment, tuple(pseudo), snapshot, CollectiveHandle())
        means, left = compressed_mean(list(pseudo), tuple(kept), config.compressor, collective, context=context)
    for i, residual in zip(indices, left):
        residuals[i] = residual
    return InFlight(apply_step, fragment, tuple(means), snapshot, CollectiveHandle())


def apply(config: OuterConfig, leaves: Checked, global_params: list, outer_state: list, item: InFlight,
          indices: Sequence[int], flat_global: torch.Tensor | None = None) -> None:
    """Apply the completed synchronization ``item`` (its fragment's leaves are
    ``indices``): step ``global_params`` and ``outer_state`` (lists, replaced per
    leaf) and write the new global parameters into ``leaves``, in place.
    ``flat_global``: the fragment's global buffer where :func:`start` found it in
    this step (else derived here)."""
    targets = [global_params[i] for i in indices]
    fast = config.same_place and leaves.layout.plain
    first = is_first_sync(config, item.fragment, item.apply_step - config.delay)
    states = [outer_state[i] for i in indices]
    if shards.on_shards(config, leaves):  # (started on the shards: synchronous, so in this very step)
        stepped = shards.step(config, targets, list(item.pseudo_grads), states, first)
        if stepped is not None:
            for k, i in enumerate(indices):
                outer_state[i] = stepped[k]
        shards.write_back([leaves[i] for i in indices], targets)
        return
    on_device = not fast and converted.on_device(config, leaves)
    if not (fast and _applied_flat(config, targets, states, item.pseudo_grads, first, flat_global)):
        grads = list(item.pseudo_grads) if fast else (
            on_device and converted.outer_grads(item.pseudo_grads, targets) or fetched(item.pseudo_grads, targets))
        with torch.no_grad():
            if first:
                # the fragment's first synchronization only establishes the synchronized
                # point: plain averaging, g - mean(g - l) = mean(l); the outer optimizer
                # starts from there (else all of warm-up would be one outer step)
                torch._foreach_sub_(targets, grads)
            else:
                stepped = config.outer.update_(targets, grads, states)
                for k, i in enumerate(indices):
                    outer_state[i] = stepped[k]
    with torch.no_grad():
        if fast:
            _write_back_fast([leaves[i] for i in indices], targets, item.snapshot)
        elif on_device:
            converted.write_back([leaves[i] for i in indices], targets, item.snapshot)
        else:
            _write_back(leaves, indices, targets, item.snapshot)


def _applied_flat(config: OuterConfig, targets: list, states: list, pseudo: Sequence[torch.Tensor], first: bool,
                  flat: torch.Tensor | None) -> bool:
    """Step a flat fragment as one tensor (see :mod:`puredist.outer.flat`) if its
    global copy (``flat``'s views, where known), outer state and pseudo-gradients
    are views of one buffer each; whether it did."""
    if not config.outer.elementwise:
        return False
    flat = flat if flat is not None else flat_base(targets)
    if flat is None:
        return False
    sent = pseudo[0]._base  # made by start as views of one buffer, or per leaf (a loaded checkpoint)
    if (sent is None or sent.data_ptr() != pseudo[0].data_ptr() or sent.shape != flat.shape
            or sent.dtype != flat.dtype or sent.device != flat.device):
        return False
    state = None if first else flat_state(states)
    if state is None and not first:
        return False
    step_flat(config, flat, sent, state)
    return True


def _write_back_fast(locals_: list[torch.Tensor], targets: list[torch.Tensor], snapshot: tuple) -> None:
    """The new global parameters into the local ones, multi-tensor (same device and dtype)."""
    if snapshot:  # keep the local progress made while the all-reduce ran
        torch._foreach_sub_(locals_, snapshot)
        torch._foreach_add_(locals_, targets)
    else:
        torch._foreach_copy_(locals_, targets)


def _write_back(leaves: Sequence[torch.Tensor], indices: Sequence[int], targets: list[torch.Tensor], snapshot: tuple) -> None:
    """The new global parameters into the local ones, converted per leaf. From a pinned
    host copy without blocking: the host writes it again only after the wait in
    :func:`fetched` of a later synchronization, which orders after this copy."""
    for k, i in enumerate(indices):
        local = leaves[i].detach()
        if snapshot:  # keep the local progress made while the all-reduce ran
            local.sub_(snapshot[k].to(local.device)).add_(
                targets[k].to(local.device, local.dtype, non_blocking=local.is_cuda))
        else:
            local.copy_(targets[k], non_blocking=local.is_cuda)
