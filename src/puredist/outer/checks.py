"""The checks of an outer transform's state: those an outer step runs on its inputs
before anything is communicated (the parameters are those the state was made for,
the collective can average the lower levels, and, at step 0, the initial global copy
is the same on every rank), and those a checkpoint passes before anything is loaded
from it (:func:`check_saved`: it is a state of this very transform, loadable on this
rank; what it holds is :mod:`puredist.outer.checkpoint`'s).

This module must not change a tensor.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from puredist._inputs import is_transformed
from puredist._validation import NON_NEGATIVE_INT, check, check_same_shapes
from puredist.collectives import Collective
from puredist.collectives.base import check_group_sizes
from puredist.optim.base import declaration
from puredist.outer.config import OuterConfig
from puredist.outer.schedule import due_fragments
from puredist.outer.state import OuterState
from puredist.collectives.vmap import VmapCollective


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
    check_group_sizes(collective, config.lower_sizes, arg="lower_levels")


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


def _entry(value: object) -> str:
    """A checkpoint entry, described without its values."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and {value.dtype}"
    return f"{type(value).__name__} {value!r}" if isinstance(value, bool) else type(value).__name__


def world_size() -> int:
    """The default process group's size, or -1 outside one (simulated ranks)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else -1


def check_saved(config: OuterConfig, state: OuterState, saved: Mapping[str, Any], expected: Mapping[str, Any],
                fragments, rank: int) -> None:
    """Raise ``ValueError`` unless ``saved`` is a state of this very transform that
    can be loaded on ``rank`` (nothing is built before it passes): first what says
    whose checkpoint it is (configuration, optimizer, world size), then that every
    entry is there (a rank-local one missing: saved by fewer ranks), then the values
    that must agree (step, residuals' shapes, steps in flight), then every entry's kind
    (the global copy's shapes among them). ``expected``: this transform's checkpoint
    of the template ``state`` (:func:`puredist.outer.checkpoint.state_dict`)."""
    check_origin(config, state, saved)
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
    saved_world, world = saved.get("world_size", -1), world_size()
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
