"""The checkpoint of an outer-optimization transform: what it holds, saved and
loaded (the checks that a saved one belongs to this transform and rank, run before
anything is built, are :func:`puredist.outer.checks.check_saved`).

A checkpoint is a flat dict of fixed keys (the same for any state of one transform),
which ``torch.save`` and ``torch.distributed.checkpoint`` both store:

- ``format`` (:data:`FORMAT`: which puredist's checkpoints it reads as), ``step``,
  ``config`` (the transform's ``OuterConfig.text``), ``world_size``;
- ``global.{i}``: the global copy of leaf ``i``;
- ``outer.{i}.{field}`` and ``outer.{i}.{field}.present``: the outer optimizer's state
  of leaf ``i`` (a field that is ``None`` is saved as zeros, marked absent);
- ``in_flight.{f}.started`` (``-1``: none), ``in_flight.{f}.pseudo_grad.{k}`` and,
  with a delay, ``in_flight.{f}.snapshot.{k}.rank{r}``: fragment ``f``'s
  synchronization in flight, completed before it is saved;
- ``residual.{i}.rank{r}``: with a compressor, rank ``r``'s error-feedback residuals.

Keys ending in ``rank{r}`` differ between ranks; the others are the same on every rank.
The entries are the state's own tensors, not copies (as torch's ``state_dict``): save
or copy them before the next ``update_``, which changes them in place.

This module must not communicate, except that ``state_dict`` waits for the
synchronizations in flight (their results are what it saves).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from puredist._dtensors import like, local_shard
from puredist.collectives import CollectiveHandle
from puredist.outer.checks import check_saved, world_size
from puredist.outer.config import OuterConfig
from puredist.outer.fragments import fragment_leaves
from puredist.outer.state import InFlight, OuterState
from puredist.outer.storage.flat_layout import relaid_states

FORMAT = 2
"""The checkpoint's format: 2 since puredist 0.2.0, whose steps count completed inner
steps (DiLoCo's Algorithm 1: the first synchronization after inner step ``H``); a
checkpoint of puredist 0.1.0 (no ``format`` entry) followed another schedule and is
refused (:data:`puredist.outer.checks.SAVED`)."""


def state_dict(config: OuterConfig, state: OuterState, *, rank: int) -> dict[str, Any]:
    """A flat dict of ``state`` for ``torch.save`` or DCP (completes collectives in
    flight: every rank calls it at the same step)."""
    fragments = fragment_leaves(config, state.global_params)
    saved: dict[str, Any] = {"format": FORMAT, "step": state.step, "config": config.text, "world_size": world_size()}
    for i, (global_param, leaf_state) in enumerate(zip(state.global_params, state.outer_state)):
        saved[f"global.{i}"] = global_param
        for field, value in leaf_state._asdict().items():
            saved[f"outer.{i}.{field}.present"] = value is not None
            saved[f"outer.{i}.{field}"] = value if value is not None else torch.zeros_like(global_param)
    by_fragment = {item.fragment: item for item in state.in_flight}
    for f, indices in enumerate(fragments):
        item = by_fragment.get(f)
        if item is not None:
            item.handle.wait()
        saved[f"in_flight.{f}.started"] = item.started if item is not None else -1
        for k, i in enumerate(indices):
            shaped = state.global_params[i].to(dtype=config.comm_dtype or state.global_params[i].dtype)
            saved[f"in_flight.{f}.pseudo_grad.{k}"] = item.pseudo_grads[k] if item else torch.zeros_like(shaped)
            if config.delay:  # rank-local: a DTensor's snapshot is saved as this rank's shard, a plain tensor
                snapshot = item.snapshot[k] if item else torch.zeros_like(state.global_params[i])
                saved[f"in_flight.{f}.snapshot.{k}.rank{rank}"] = local_shard(snapshot)
    for i, residual in enumerate(state.residuals):  # differ between ranks
        saved[f"residual.{i}.rank{rank}"] = residual
    return saved


def load_state_dict(config: OuterConfig, state: OuterState, saved: Mapping[str, Any], *, rank: int) -> OuterState:
    """The state ``saved`` holds, validated against this transform and ``state``
    (a template, e.g. ``init``)."""
    fragments = fragment_leaves(config, state.global_params)
    # the template's own checkpoint, its synchronizations in flight left out (not waited: the schedule says which
    # the saved step has, and a failed one would raise)
    check_saved(config, state, saved, state_dict(config, state._replace(in_flight=()), rank=rank), rank)
    global_params = tuple(
        saved[f"global.{i}"].to(device=g.device, dtype=g.dtype, copy=True).pin_memory() if g.is_pinned()
        else saved[f"global.{i}"].to(device=g.device, dtype=g.dtype, copy=True)
        for i, g in enumerate(state.global_params)
    )

    def restored(i: int, field: str, template: torch.Tensor | None) -> torch.Tensor | None:
        if not saved.get(f"outer.{i}.{field}.present", False):  # (a field added since: absent, None)
            return None
        device = template.device if template is not None else global_params[i].device
        return saved[f"outer.{i}.{field}"].to(device=device, copy=True)


    outer_state = [
        type(leaf_state)(**{field: restored(i, field, value) for field, value in leaf_state._asdict().items()})
        for i, leaf_state in enumerate(state.outer_state)
    ]
    global_params = list(global_params)
    residuals = [
        saved[f"residual.{i}.rank{rank}"].to(device=r.device, dtype=torch.float32, copy=True)
        for i, r in enumerate(state.residuals)
    ]
    relaid_states(fragments, state.global_params, state.outer_state, global_params, outer_state,
                  state.residuals, residuals)
    in_flight = []
    for f, indices in enumerate(fragments):
        started = int(saved[f"in_flight.{f}.started"])
        if started < 0:
            continue
        in_flight.append(InFlight(
            started,
            f,
            tuple(saved[f"in_flight.{f}.pseudo_grad.{k}"].clone() for k in range(len(indices))),
            tuple(
                like(state.global_params[i], saved[f"in_flight.{f}.snapshot.{k}.rank{rank}"].clone())
                for k, i in enumerate(indices)
            ) if config.delay else (),
            CollectiveHandle(),  # completed before it was saved
        ))
    in_flight.sort(key=lambda item: item.started)
    return OuterState(int(saved["step"]), tuple(global_params), tuple(outer_state), tuple(in_flight), tuple(residuals))
