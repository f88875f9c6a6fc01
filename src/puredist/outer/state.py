"""What an outer-optimization transform carries from step to step, and how it starts.

:class:`OuterState` (the step, the global copy, the outer optimizer's per-parameter
states, the synchronizations in flight, the error-feedback residuals) and
:class:`InFlight` are plain NamedTuples: a pytree a user can save, map or inspect.
:class:`OuterTransform` is the set of functions :func:`~puredist.outer_optimizer`
returns. :func:`init_state` makes step 0.

This module must not talk to other ranks.
"""


from typing import Any, Callable, NamedTuple

import torch

from puredist._docs import fields_documented
from puredist._dtensors import is_dtensor, local_shard
from puredist._transforms import transforms_active
from puredist.averaging import _float_leaves
from puredist.collectives import CollectiveHandle
from puredist.outer.config import OuterConfig
from puredist.outer.fragments import fragment_leaves
from puredist.outer.storage.flat_layout import flat_init, flat_zeros, flattens
from puredist.tree import PyTree


@fields_documented
class InFlight(NamedTuple):
    """One fragment's synchronization, started and not yet applied.

    Attributes:
        started: the count of inner steps after which it started (the state's step
            then); it is applied after inner step ``started + delay``.
        fragment: the fragment's index.
        pseudo_grads: the fragment's mean pseudo-gradients per leaf: averaged in
            place by the collective (final once ``handle`` is waited on), in the dtype
            they were sent in; with a compressor, the decoded means.
        snapshot: the fragment's local parameters when it started (``()`` when
            ``delay == 0``: nothing runs in between).
        handle: the collective's handle.
    """

    started: int
    fragment: int
    pseudo_grads: tuple[torch.Tensor, ...]
    snapshot: tuple[torch.Tensor, ...]
    handle: CollectiveHandle


@fields_documented
class OuterState(NamedTuple):
    """State of an outer-optimization transform.

    Attributes:
        step: how many times ``update``/``update_`` ran: the inner steps completed
            (``update`` runs once after each), the count the schedule reads
            (:mod:`puredist.outer.timeline`).
        global_params: the global copy, one tensor per parameter leaf.
        outer_state: the outer optimizer's per-parameter states, aligned with the leaves.
        in_flight: synchronizations started and not yet applied, in start order.
        residuals: with a ``compressor``, this rank's error-feedback residual per leaf
            (fp32); else ``()``.
    """

    step: int
    global_params: tuple[torch.Tensor, ...]
    outer_state: tuple
    in_flight: tuple[InFlight, ...]
    residuals: tuple[torch.Tensor, ...] = ()


@fields_documented
class OuterTransform(NamedTuple):
    """``init``, pure ``update``, in-place ``update_``, and the checkpoint pair.

    ``state_dict(state, *, rank)`` completes any collective in flight (every rank must
    call it at the same step) and returns a flat dict; keys of values that differ
    between ranks (the snapshots of in-flight synchronizations) carry ``rank``, the
    others are identical on every rank. ``load_state_dict(state, saved, *, rank)``
    returns the state saved, with ``state`` (any state of this transform on this rank,
    e.g. a fresh ``init``) as the template.

    Attributes:
        init: ``init(params) -> OuterState``: step 0, the global copy, fresh outer state.
        update: ``update(params, state, *, collective) -> (params, state)``: pure (and
            under ``torch.func`` transforms and ``torch.compile``, for synchronous
            synchronizations, compressed or not). Eagerly
            every returned tensor is new; under a transform, what a step leaves
            unchanged is returned as given (as JAX does, and the averagers): change
            those in place and the inputs change too.
        update_: ``update_(params, state, *, collective) -> state``: in place.
        state_dict: ``state_dict(state, *, rank) -> dict``: the checkpoint.
        load_state_dict: ``load_state_dict(state, saved, *, rank) -> OuterState``: checked first.
    """

    init: Callable[[PyTree], OuterState]
    update: Callable[..., tuple[PyTree, OuterState]]
    update_: Callable[..., OuterState]
    state_dict: Callable[..., dict[str, Any]]
    load_state_dict: Callable[..., OuterState]


def pinned_if_host_of_gpu(copy: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    """``copy`` in page-locked memory when it is a host copy of a GPU tensor (copies
    between the two then run without blocking the host)."""
    if copy.device.type == "cpu" and leaf.device.type == "cuda" and not is_dtensor(leaf):
        return copy.pin_memory()
    return copy


def init_state(config: OuterConfig, params: PyTree) -> OuterState:
    """Step 0: a copy of ``params`` as the global copy, fresh outer-optimizer state.

    Under ``torch.func.vmap`` over stacked parameters it makes one state per replica
    (the step, a Python int, unmapped: ``vmap(init, out_dims=vmap_axes(init(params of
    one replica)))``), of the same structure as the state of one replica's ``init``
    and as every state after it.

    Raises:
        ValueError: more fragments than parameter leaves.
    """
    # under a torch.func transform (vmap(init) of stacked parameters) memory is not observable: not checked
    leaves, _ = _float_leaves(params, in_place=not transforms_active())
    global_params: list = [None] * len(leaves)
    outer_state: list = [None] * len(leaves)
    residuals: list = [None] * len(leaves) if config.compressor else []
    for indices in fragment_leaves(config, leaves):
        fragment = [leaves[i] for i in indices]
        if flattens(config, fragment):  # views of one buffer: stepped as one tensor (puredist.outer.storage.flat)
            copy, states = flat_init(config, fragment)
            left = flat_zeros(fragment, torch.float32) if residuals else ()
        else:
            copy = [_global_copy(config, leaf) for leaf in fragment]
            states = list(config.outer.init(copy))
            # rank-local: a DTensor's residual is its local shard's
            left = [torch.zeros_like(local_shard(leaf), dtype=torch.float32) for leaf in fragment] if residuals else ()
        for k, i in enumerate(indices):
            global_params[i], outer_state[i] = copy[k], states[k]
            if residuals:
                residuals[i] = left[k]
    return OuterState(0, tuple(global_params), tuple(outer_state), (), tuple(residuals))


def _global_copy(config: OuterConfig, leaf: torch.Tensor) -> torch.Tensor:
    """A leaf's global copy on its own: on ``global_device``, in ``global_dtype``."""
    return pinned_if_host_of_gpu(
        leaf.detach().to(
            device=config.global_device if config.global_device is not None else leaf.device,
            dtype=config.global_dtype or leaf.dtype, copy=True,
        ),
        leaf,
    )
