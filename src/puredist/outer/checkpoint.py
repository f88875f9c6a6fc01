"""The checkpoint of an outer-optimization transform: what it holds, and the checks
that a saved one belongs to this transform and rank before anything is built.

A checkpoint is a flat dict of fixed keys (the same for any state of one transform),
which ``torch.save`` and ``torch.distributed.checkpoint`` both store:

- ``step``, ``config`` (the transform's ``OuterConfig.text``),
  ``world_size``;
- ``global.{i}``: the global copy of leaf ``i``;
- ``outer.{i}.{field}`` and ``outer.{i}.{field}.present``: the outer optimizer's state
  of leaf ``i`` (a field that is ``None`` is saved as zeros, marked absent);
- ``in_flight.{f}.apply_step`` (``-1``: none), ``in_flight.{f}.pseudo_grad.{k}`` and,
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

import re
from typing import Any, Mapping

import torch
import torch.distributed as dist

from puredist._dtensors import like, local_shard
from puredist._validation import NON_NEGATIVE_INT, check, check_same_shapes
from puredist.collectives import CollectiveHandle
from puredist.optim.base import declaration
from puredist.outer.config import OuterConfig
from puredist.outer.flat import relaid_states
from puredist.outer.schedule import due_fragments, fragment_leaves
from puredist.outer.state import InFlight, OuterState


def _entry(value: object) -> str:
    """A checkpoint entry, described without its values."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and {value.dtype}"
    return f"{type(value).__name__} {value!r}" if isinstance(value, bool) else type(value).__name__


def _world_size() -> int:
    """The default process group's size, or -1 outside one (simulated ranks)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else -1


def state_dict(config: OuterConfig, state: OuterState, *, rank: int) -> dict[str, Any]:
    """A flat dict of ``state`` for ``torch.save`` or DCP (completes collectives in
    flight: every rank calls it at the same step)."""
    fragments = fragment_leaves(config, state.global_params)
    saved: dict[str, Any] = {"step": state.step, "config": config.text, "world_size": _world_size()}
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
        saved[f"in_flight.{f}.apply_step"] = item.apply_step if item is not None else -1
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
    check_saved(config, state, saved, fragments, rank)
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
        apply_step = int(saved[f"in_flight.{f}.apply_step"])
        if apply_step < 0:
            continue
        in_flight.append(InFlight(
            apply_step,
            f,
            tuple(saved[f"in_flight.{f}.pseudo_grad.{k}"].clone() for k in range(len(indices))),
            tuple(
                like(state.global_params[i], saved[f"in_flight.{f}.snapshot.{k}.rank{rank}"].clone())
                for k, i in enumerate(indices)
            ) if config.delay else (),
            CollectiveHandle(),  # completed before it was saved
        ))
    in_flight.sort(key=lambda item: item.apply_step)
    return OuterState(int(saved["step"]), tuple(global_params), tuple(outer_state), tuple(in_flight), tuple(residuals))

def check_saved(config: OuterConfig, state: OuterState, saved: Mapping[str, Any], fragments, rank: int) -> None:
    """Raise ``ValueError`` unless ``saved`` is a state of this very transform that
    can be loaded on ``rank`` (nothing is built before it passes): first what says
    whose checkpoint it is (configuration, optimizer, world size), then that every
    entry is there (a rank-local one missing: saved by fewer ranks), then the values that must agree (step, residuals' shapes, steps in
    flight), then every entry's kind (the global copy's shapes among them)."""
    check_origin(config, state, saved)
    expected = state_dict(config, state, rank=rank)  # this transform's entries, from the template
    check_entries(expected, saved, kinds=False)
    step = saved["step"]
    check("saved['step']", step, NON_NEGATIVE_INT)
    check_same_shapes(
        "saved", [saved[f"residual.{i}.rank{rank}"].shape for i in range(len(state.residuals))],
        [r.shape for r in state.residuals], what=f"rank {rank}'s residual", other="this rank's shard",
        tail=": it was saved at another sharding. A compressed run resumes at the layout it was saved at.",
    )
    for f in range(len(fragments)):
        apply_step, scheduled = int(saved[f"in_flight.{f}.apply_step"]), _in_flight_at(config, f, step)
        if apply_step != scheduled:
            raise ValueError(
                f"Arg ``saved``: fragment {f}'s synchronization in flight applies at step {apply_step} (-1: none); "
                f"at the saved step {step} the schedule has "
                + ("none in flight." if scheduled < 0 else f"the one started at step {scheduled - config.delay} in "
                   f"flight, applying at step {scheduled}.")
            )
    unexpected = _unexpected_entries(expected, saved, rank)
    if unexpected:
        raise ValueError(
            f"Arg ``saved`` holds entries this transform's checkpoint does not: {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''} (a checkpoint of other parameters: more leaves or fragments)."
        )
    check_entries(expected, saved, kinds=True)


def _in_flight_at(config: OuterConfig, fragment: int, step: int) -> int:
    """The step at which ``fragment``'s synchronization in flight at ``step`` (saved
    after ``step`` steps) applies, by the schedule: one started at a step in
    ``[step - delay, step - 1]``; ``-1`` where none is."""
    started = [s for s in range(max(step - config.delay, 0), step) if fragment in due_fragments(config, s)]
    return started[-1] + config.delay if started else -1


_OTHER_RANK = re.compile(r"\.rank\d+$")
_NAMESPACE = re.compile(r"(global|outer|in_flight|residual)\.\d+(\.|$)")


def _unexpected_entries(expected: Mapping[str, Any], saved: Mapping[str, Any], rank: int) -> list[str]:
    """The keys of ``saved`` in this transform's namespace (``global.<i>``,
    ``outer.<i>.``, ``in_flight.<f>.``, ``residual.<i>.``: a caller may keep entries of
    its own in the same dict) that its checkpoint (``expected``) has no place for: all but other ranks'
    entries of the keys this rank has (snapshots, residuals) and outer-state fields
    marked absent (a checkpoint from before states dropped unused fields)."""
    def allowed(key: str) -> bool:
        if not _NAMESPACE.match(key):
            return True
        if _OTHER_RANK.sub(f".rank{rank}", key) in expected:
            return True
        parts = key.split(".")
        present = key if key.endswith(".present") else f"{key}.present"
        return parts[0] == "outer" and f"global.{parts[1]}" in expected and saved.get(present) is False

    return [key for key in saved if key not in expected and not allowed(key)]

def check_origin(config: OuterConfig, state: OuterState, saved: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` where ``saved`` comes from another transform, another
    outer optimizer, or (with error-feedback residuals) another world size."""
    if saved.get("config") != config.text:
        raise ValueError(
            f"Arg ``saved`` was saved by {saved.get('config', 'something else')!r}; this transform is "
            f"{config.text!r}: the schedules and payloads differ, so it cannot continue that run."
        )
    fields = set(state.outer_state[0]._fields) if state.outer_state else set()
    saved_fields = {  # (a checkpoint from before states dropped unused fields marks them absent)
        key.split(".")[2] for key in saved if key.startswith("outer.0.") and key.endswith(".present") and saved[key]
    }
    if saved_fields - fields:
        raise ValueError(
            f"Arg ``saved`` holds outer-optimizer state with fields {sorted(saved_fields)}; this transform's "
            f"outer optimizer keeps {sorted(fields)}: it is a checkpoint of another optimizer."
        )
    declared = declaration(type(state.outer_state[0])) if state.outer_state else None
    for i, leaf_state in enumerate(state.outer_state):
        for count in declared.counts if declared else ():
            if getattr(leaf_state, count) is not None and not saved.get(f"outer.{i}.{count}.present", False):
                raise ValueError(
                    f"Arg ``saved`` holds no step count for parameter {i}'s outer state (``{count}``): it was saved by "
                    "an outer optimizer that keeps none (without a schedule or dampening), which this one needs."
                )
    saved_world, world = saved.get("world_size", -1), _world_size()
    if state.residuals and saved_world >= 0 and world >= 0 and saved_world != world:
        raise ValueError(
            f"Arg ``saved`` was saved at world size {saved_world}, this run has {world}: each rank's error-feedback "
            "residuals are its own (what its payloads have not sent yet), so a compressed run resumes at the "
            "world size it was saved at."
        )


_RANK_LOCAL_MISSING = (  # (a missing key's pattern, why it is missing), the first that matches a missing key
    (re.compile(r"residual\.\d+\.rank(?P<rank>\d+)$"),
     "holds no error-feedback residuals of rank {rank}: it was saved at a smaller world size. Each rank's residuals "
     "are its own; a compressed run resumes at the world size it was saved at."),
    (re.compile(r"in_flight\.(?P<fragment>\d+)\.snapshot\.\d+\.rank(?P<rank>\d+)$"),
     "holds no snapshot of rank {rank} for fragment {fragment}'s synchronization in flight: it was saved at a smaller "
     "world size. A checkpoint loads at another world size only when no delayed synchronization is in flight (save "
     "at a step where none is, e.g. a multiple of sync_every that applies no delay)."),
)
"""Why an entry that differs between ranks is missing: the checkpoint was saved by
fewer ranks."""


def _missing(expected: Mapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
    """The keys of ``expected`` (this transform's checkpoint of the template) that
    ``saved`` lacks, but those that may be absent: ``world_size`` (older
    checkpoints), a field this optimizer's state does not have either (with its
    presence flag), and other ranks' snapshots where none is in flight."""
    def may_be_absent(key: str, template: Any) -> bool:
        field_absent = key.endswith(".present") and not template or (
            key.startswith("outer.") and not expected.get(f"{key}.present", True)
        )
        idle_snapshot = ".snapshot." in key and saved.get(f"in_flight.{key.split('.')[1]}.apply_step") == -1
        return key == "world_size" or field_absent or idle_snapshot

    return [key for key, template in expected.items() if key not in saved and not may_be_absent(key, template)]


def _why_missing(missing: list[str]) -> str:
    """What the message says of the ``missing`` keys: why a rank-local one is missing
    (:data:`_RANK_LOCAL_MISSING`, in its order), else the first key."""
    for pattern, why in _RANK_LOCAL_MISSING:
        found = next(filter(None, map(pattern.match, missing)), None)
        if found:
            return why.format(**found.groupdict())
    return f"lacks ``{missing[0]}``, which this transform's checkpoint holds."


def check_entries(expected: Mapping[str, Any], saved: Mapping[str, Any], *, kinds: bool) -> None:
    """Every entry of ``expected`` (this transform's checkpoint of the template) is in
    ``saved`` but those that may be absent (see :func:`_missing`); ``kinds``: and of
    the same kind: a tensor of the same shape, and dtype but for a snapshot, which is
    in the parameter's; the same Python type; each outer-state field present where
    this optimizer's state has it."""
    missing = _missing(expected, saved)
    if missing:
        raise ValueError(f"Arg ``saved`` {_why_missing(missing)}")
    for key, template in expected.items() if kinds else ():
        value = saved.get(key, template)  # (absent: one that may be)
        if isinstance(template, torch.Tensor):
            same = isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(template.shape) and (
                value.dtype == template.dtype or ".snapshot." in key
            )
        else:
            same = type(value) is type(template) and (not key.endswith(".present") or value == template)
        if not same:
            raise ValueError(
                f"Arg ``saved``: ``{key}`` is {_entry(value)}, where this transform's checkpoint holds "
                f"{_entry(template)}: it is not a state of this transform for these parameters."
            )
