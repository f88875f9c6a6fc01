"""Flat fragments' layout: a fragment's global copy and outer state made, at ``init``
(and again at a load), as views of one buffer each, so that a synchronization can
step the fragment as one tensor (:class:`~puredist.outer.storage.flat.Flat`).

With the global copy in the parameters' own place (``OuterConfig.same_place``), an
elementwise outer optimizer (:attr:`~puredist.Optimizer.elementwise`) and a fragment
of one device and dtype whose leaves are small (host-bound: see
:data:`_FLAT_MAX_LEAF_BYTES`), :func:`flat_init` lays the fragment's global copy end
to end in one buffer and gives each leaf a view of it (the state keeps its per-leaf
form: checkpoints, ``update`` and the other storages see the same tensors), and the
outer state likewise when every field of it is declared shaped like the parameters
(SGD's momentum; not a per-parameter step count). An outer optimizer that is not
elementwise (its state type's declaration says so: a per-tensor norm, as LARS or
LAMB) keeps the per-leaf layout, its norms per tensor. With a compressor, the
error-feedback residuals are one buffer too (:func:`flat_zeros`).

Whether a list of views still tiles its buffer is decided from the tensors'
metadata, once per layout (:func:`flat_base`): a state rebuilt per leaf (by the pure
``update``'s copies) is stepped per leaf; ``load_state_dict`` lays a loaded state out
as its template (:func:`relaid_states`).

This module must not communicate.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from puredist._dtensors import is_dtensor
from puredist._layout import layout_of, views_like
from puredist._seq import any_none
from puredist._transforms import is_transformed
from puredist.optim.base import declaration
from puredist.outer.config import OuterConfig


_FLAT_MAX_LEAF_BYTES = 1 << 16
"""A fragment is laid out flat while its leaves average at most 64 KiB: there a
kernel per leaf costs more than the flat path's one more pass over the bytes (and
its temporaries stay small enough for the allocator to reuse; on a CPU, one of more
than 32 MiB is new memory, faulted in, at every call)."""


def flattens(config: OuterConfig, leaves: Sequence[torch.Tensor]) -> bool:
    """Whether a fragment of these parameter leaves gets flat buffers."""
    first = leaves[0]
    return (
        config.same_place and config.outer.elementwise
        and sum(t.numel() for t in leaves) * first.element_size() <= _FLAT_MAX_LEAF_BYTES * len(leaves)
        and all(type(t) in (torch.Tensor, torch.nn.Parameter) and not is_dtensor(t) and not is_transformed(t)
                for t in leaves)  # (under vmap(init), a batched tensor has no memory to view)
        and all(t.dtype == first.dtype and t.device == first.device and not t.is_complex() for t in leaves)
    )


def flat_init(config: OuterConfig, leaves: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[NamedTuple]]:
    """``(global copy, outer states)`` of one fragment's ``leaves``: views of one
    buffer each where the outer state's fields are all declared shaped like the
    parameter (:func:`~puredist.optim.param_state`; else the states are made per
    leaf)."""
    first = leaves[0]
    flat = torch.empty(sum(t.numel() for t in leaves), dtype=first.dtype, device=first.device)
    copy = views_like(flat, leaves)
    with torch.no_grad():
        torch._foreach_copy_(copy, [t.detach() for t in leaves])
    (flat_state,) = config.outer.init([flat])
    declared = declaration(type(flat_state))
    if declared is None or len(declared.shaped) != len(flat_state):
        return copy, list(config.outer.init(copy))  # e.g. a step count per parameter
    columns = [views_like(field, leaves) for field in flat_state]
    return copy, [type(flat_state)(*(column[k] for column in columns)) for k in range(len(leaves))]


def flat_base(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one-dimensional buffer ``tensors`` are views of, end to end and in order,
    covering all of it; ``None`` when they are not (or not all tensors)."""
    if not tensors or any_none(tensors):
        return None
    base = tensors[0]._base
    if base is None or base.dim() != 1 or not base.is_contiguous():
        return None
    layout = layout_of(tensors)
    if not layout.plain or not layout.derived("tiles", lambda: _tile_bytes(tensors)):
        return None
    if base.data_ptr() != tensors[0].data_ptr() or base.numel() * base.element_size() != layout.memo["tiles"]:
        return None
    return base


def _tile_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """The bytes ``tensors`` span when each is contiguous and starts where the one
    before ends (one dtype and device); ``0`` (not ``None``: remembered) when not."""
    first = tensors[0]
    address = first.data_ptr()
    for t in tensors:
        if t.dtype != first.dtype or t.device != first.device or not t.is_contiguous() or t.data_ptr() != address:
            return 0
        address += t.numel() * t.element_size()
    return address - first.data_ptr()


def flat_zeros(leaves: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zeros shaped like ``leaves``, in ``dtype``: views of one buffer, end to end
    (a flat fragment's error-feedback residuals)."""
    return views_like(torch.zeros(sum(t.numel() for t in leaves), dtype=dtype, device=leaves[0].device), leaves)


def flat_state(states: Sequence[NamedTuple]) -> NamedTuple | None:
    """The per-leaf ``states`` as one state of their buffers (each field's views
    tiling one buffer), or ``None`` when they are not (a field that is ``None``, such
    as a momentum buffer not made yet, takes the per-leaf path)."""
    fields = []
    for column in zip(*states):
        base = flat_base(column)  # None for a column holding None
        if base is None:
            return None
        fields.append(base)
    return type(states[0])(*fields)


def relaid(template: Sequence[torch.Tensor], loaded: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``loaded`` (one tensor per leaf, e.g. from a checkpoint) laid out as
    ``template`` is: in a new buffer of its own, viewed per leaf, where the
    template's tensors are views of one buffer (see :func:`flat_base`); else as they are."""
    base = None if any_none(template) or any_none(loaded) else flat_base(template)
    if base is None:
        return list(loaded)
    views = views_like(torch.empty_like(base), template)
    with torch.no_grad():
        torch._foreach_copy_(views, list(loaded))
    return views


def relaid_states(fragments: Sequence[Sequence[int]], template_globals: Sequence[torch.Tensor],
                  template_states: Sequence[NamedTuple], globals_: list, states: list,
                  template_residuals: Sequence[torch.Tensor] = (), residuals: list | None = None) -> None:
    """Lay out each fragment's loaded global copy ``globals_``, outer ``states`` and
    error-feedback ``residuals`` (lists, replaced per leaf) as the template's: flat
    where it is flat, so that a resumed run steps its fragments as one tensor again."""
    for indices in fragments:
        _relaid_in(indices, template_globals, globals_)
        if template_residuals:
            _relaid_in(indices, template_residuals, residuals)
        for field in (template_states[indices[0]]._fields if template_states else ()):
            column = relaid([getattr(template_states[i], field) for i in indices],
                            [getattr(states[i], field) for i in indices])
            for i, tensor in zip(indices, column):
                states[i] = states[i]._replace(**{field: tensor})


def _relaid_in(indices: Sequence[int], template: Sequence[torch.Tensor], loaded: list) -> None:
    """``loaded``'s entries at ``indices`` (one fragment) relaid as ``template``'s, in place."""
    for i, tensor in zip(indices, relaid([template[i] for i in indices], [loaded[i] for i in indices])):
        loaded[i] = tensor
