"""The checks an outer step runs on its inputs before anything is communicated: the
parameters are those the state was made for, the collective can average the lower
levels, and (at step 0) the initial global copy is the same on every rank.

This module must not change a tensor.
"""

from __future__ import annotations

from typing import Sequence

import torch

from puredist._inputs import is_transformed
from puredist.collectives import Collective
from puredist.outer.config import OuterConfig
from puredist.outer.state import OuterState
from puredist.replicas import VmapCollective


def _describe_leaf(leaves: Sequence[torch.Tensor], i: int) -> str:
    return f"shape {tuple(leaves[i].shape)}, {leaves[i].dtype}" if i < len(leaves) else "none"


def check_state(config: OuterConfig, state: object) -> None:
    """Raise ``TypeError`` unless ``state`` is an :class:`OuterState` (another
    transform's state, e.g. an averager's or an optimizer's, is named)."""
    if not isinstance(state, OuterState):
        raise TypeError(
            f"Arg ``state`` is a {type(state).__name__}, not an OuterState: it was made by another transform "
            f"(pass the state that init of {config} made, or the one its last update returned)."
        )


def check_params(config: OuterConfig, leaves: Sequence[torch.Tensor], state: OuterState) -> None:
    """Raise ``ValueError`` unless ``leaves`` are the parameters ``state`` was made
    for: as many, of the same shapes (and dtypes, where the global copy keeps the
    parameters' own). Leaves are paired by position, so another tree (a frozen
    embedding left out) would pair unrelated tensors."""
    globals_ = state.global_params
    same_dtype = config.global_dtype is None
    # (comprehensions, not operator.attrgetter: torch.compile traces this check and cannot call one)
    same = len(leaves) == len(globals_) and [t.shape for t in leaves] == [t.shape for t in globals_]
    if same and same_dtype:
        same = [t.dtype for t in leaves] == [t.dtype for t in globals_]
    compressor = config.compressor
    if same and len(state.residuals) != (len(globals_) if compressor is not None else 0):  # one per parameter, or none
        raise ValueError(
            f"Arg ``state`` holds {len(state.residuals)} error-feedback residuals for {len(globals_)} parameters: "
            f"it was made by init of a transform {'without' if compressor else 'with'} a compressor; this one has "
            f"{compressor.name if compressor else 'none'}. Init a state with this transform."
        )
    if same:
        return
    differing = next(
        (i for i, (leaf, g) in enumerate(zip(leaves, globals_))
         if leaf.shape != g.shape or (same_dtype and leaf.dtype != g.dtype)),
        min(len(leaves), len(globals_)),
    )
    raise ValueError(
        f"Arg ``params`` has {len(leaves)} leaves; the state was made by init for {len(globals_)}, and leaf "
        f"{differing} differs (params: "
        f"{_describe_leaf(leaves, differing)}, state: {_describe_leaf(globals_, differing)}). Pass the "
        f"parameters init was given (the same tree), or init a state for these.{_vmap_hint(leaves, globals_, differing)}"
    )


def _vmap_hint(leaves: Sequence[torch.Tensor], globals_: Sequence[torch.Tensor], i: int) -> str:
    """Where one side has exactly one more leading dimension, what ``vmap``'s dims
    likely got wrong (a stacked tree passed unmapped), else ``""``."""
    if i >= min(len(leaves), len(globals_)):
        return ""
    param, copy = leaves[i].shape, globals_[i].shape
    if copy[1:] == param and len(copy) == len(param) + 1:
        return (" Under torch.func.vmap: a state stacked per replica passed unmapped? Map it with "
                "in_dims=puredist.tree.vmap_axes(state) (and return it with out_dims=the same).")
    if param[1:] == copy and len(param) == len(copy) + 1:
        return " Under torch.func.vmap: stacked parameters passed unmapped? Map them (in_dims=0)."
    return ""


def check_collective(config: OuterConfig, collective: Collective) -> None:
    """Raise ``ValueError`` where ``collective`` cannot average within the group sizes
    of ``config.lower_levels``."""
    missing = [g for g in config.lower_sizes if g not in collective.group_sizes]
    if collective.is_member and missing:
        raise ValueError(
            f"The collective cannot average within groups of sizes {missing} from arg "
            f"``lower_levels``; it supports {collective.group_sizes}."
        )


def check_initial_copy(config: OuterConfig, state: OuterState, collective: Collective) -> None:
    """At step 0: raise :class:`~puredist.RankMismatchError` on every rank unless the
    global copy made by ``init`` is the same on every rank (the initial parameters
    must be replicated, as DDP's broadcast makes them)."""
    collective.check_replicated(
        list(state.global_params),
        what=config.explain("the initial parameters (the global copy made by init)"),
        context=initial_check_context(config),
    )


def initial_check_context(config: OuterConfig) -> str:
    """The rank-check context of :func:`check_initial_copy`."""
    return f"{config} initial check at step 0"


def check_initial_copy_traced(config: OuterConfig, state: OuterState, collective: Collective) -> None:
    """:func:`check_initial_copy` under a ``torch.func`` transform or ``torch.compile``.
    A :class:`~puredist.VmapCollective` checks the replicas' copies itself (mapped or
    not: a copy shared by every replica is replicated by construction; see its
    ``check_replicated`` for what it skips while compiling); another collective reads
    the copy on the host, as eagerly, which only an unmapped copy allows.

    Raises:
        NotImplementedError: a transform maps the global copy, with another collective.
    """
    if isinstance(collective, VmapCollective):
        check_initial_copy(config, state, collective)
        return
    if any(is_transformed(t) for t in state.global_params):
        raise NotImplementedError(
            config.explain(
                "At step 0 the global copy made by init is checked to be the same on every rank, on the host, "
                "which a torch.func transform hides when it maps the copy: pass the state of init unmapped, "
                "take step 0 outside the transform, or (under vmap) average with a VmapCollective."
            )
        )
    with torch._C._DisableFuncTorch():  # plain tensors, read on the host as eagerly
        check_initial_copy(config, state, collective)
