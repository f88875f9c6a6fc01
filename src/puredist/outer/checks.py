"""The checks of an outer transform's state: those an outer step runs on its inputs
before anything is communicated (the parameters are those the state was made for,
the collective can average the lower levels, and, at step 0, the initial global copy
is the same on every rank), and those a checkpoint passes before anything is loaded
from it (:func:`check_saved`: it is a state of this very transform, loadable on this
rank). What a saved checkpoint must hold is one table, :data:`SAVED`: each row a key
pattern, how an entry agrees with this transform's checkpoint of the template (its
in-flight entries as the schedule has them at the saved step) and the message where
it does not; one loop reads it. What a checkpoint holds is
:mod:`puredist.outer.checkpoint`'s.

This module must not change a tensor.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist

from puredist._consistency import check_copy_replicated
from puredist._inputs import check_params_fit
from puredist._validation import NON_NEGATIVE_INT, check_entries
from puredist.collectives import Collective
from puredist.collectives.base import check_group_sizes
from puredist.optim.base import declaration
from puredist.outer.config import OuterConfig
from puredist.outer.state import OuterState
from puredist.outer.timeline import started_in_flight
from puredist.collectives.vmap import VmapCollective


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
    check_params_fit(leaves, state.global_params, state.residuals, same_dtype=config.global_dtype is None,
                     compressor=getattr(config.compressor, "name", None))


def check_collective(config: OuterConfig, collective: Collective) -> None:
    """Raise ``ValueError`` where ``collective`` cannot average within the group sizes
    of ``config.lower_levels``."""
    check_group_sizes(collective, config.lower_sizes, arg="lower_levels")


def check_initial_copy(config: OuterConfig, state: OuterState, collective: Collective) -> None:
    """At step 0: raise :class:`~puredist.RankMismatchError` on every rank unless the
    global copy made by ``init`` is the same on every rank (the initial parameters
    must be replicated, as DDP's broadcast makes them). A
    :class:`~puredist.VmapCollective` checks the replicas' copies itself (mapped or
    not: a copy shared by every replica is replicated by construction; see its
    ``check_replicated`` for what it skips while compiling); another collective reads
    the copy on the host, also under a ``torch.func`` transform or ``torch.compile``,
    which only an unmapped copy allows.

    Raises:
        NotImplementedError: a transform maps the global copy, with another collective.
    """
    check_copy_replicated(state.global_params, collective, on_host=not isinstance(collective, VmapCollective),
                          explain=config.explain, context=initial_check_context(config))


def initial_check_context(config: OuterConfig) -> str:
    """The rank-check context of :func:`check_initial_copy`."""
    return f"{config} initial check at step 0"


def world_size() -> int:
    """The default process group's size, or -1 outside one (simulated ranks)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else -1


class _Absent:
    """An entry one side lacks."""

    def __repr__(self) -> str:
        return "nothing"


ABSENT = _Absent()


class _Load(NamedTuple):
    """What the rows of :data:`SAVED` read besides the two entries: this transform's
    checkpoint as the schedule has it at the saved step (:func:`_load`), the keys
    ``saved`` lacks or holds beyond it, and what the messages name."""

    expected: Mapping[str, Any]
    missing: frozenset
    extra: frozenset
    residuals: bool
    step: object
    delay: int
    counts: tuple
    fields: list
    saved_fields: list


class Expect(NamedTuple):
    """How the entries whose keys match ``keys`` (a regular expression, matched
    whole) must agree with this transform's checkpoint: ``agrees(value, expected,
    match, load)`` (``ABSENT`` for a side that lacks the key), else
    ``ValueError("Arg ``saved``: " + why)``, ``why`` formatted with the match's
    groups, ``key``, ``value``, ``expected``, their descriptions ``found`` and
    ``holds``, their shapes and ``load``'s fields."""

    keys: str
    agrees: Callable[..., bool]
    why: str


def _is_tensor_of_shape(value: object, expected: object) -> bool:
    """Of ``expected``'s shape where both are tensors (``expected`` is ``ABSENT`` for
    another rank's residual, which a merged checkpoint of several ranks holds)."""
    return not (isinstance(value, torch.Tensor) and isinstance(expected, torch.Tensor)) or value.shape == expected.shape


def _same_kind(key: str, value: object, expected: object) -> bool:
    """A tensor of the same shape, and dtype but for a snapshot (in the parameter's);
    the same Python type; a presence flag of the same value."""
    if value is ABSENT or expected is ABSENT:
        return True  # (the rows for missing and extra entries)
    if isinstance(expected, torch.Tensor):
        return isinstance(value, torch.Tensor) and value.shape == expected.shape and (
            value.dtype == expected.dtype or ".snapshot." in key)
    return type(value) is type(expected) and (not key.endswith(".present") or value == expected)


_ANY = r".*"
SAVED = (  # in this order: which version wrote it, whose checkpoint it is, entries missing (saved by fewer ranks),
    # values, entries beyond, kinds
    Expect("format", lambda v, e, m, c: v is not ABSENT,
           "it was saved by puredist 0.1.0 (it has no ``format`` entry), whose timeline counted one step before the "
           "first inner step was complete (its warmup_steps=W ran as this version's W + 1, with one fragment and no "
           "lower_levels) and whose checkpoint records its synchronizations in flight by another count: this version "
           "does not load it. Finish that run with puredist 0.1.0, or start this version's state from its global copy "
           "(write its ``global.<i>`` entries into the parameters, then init)."),
    Expect("format", lambda v, e, m, c: v == e,
           "it is a checkpoint of format {value!r}; this version of puredist reads format {expected!r}."),
    Expect("config", lambda v, e, m, c: v == e,
           "it was saved by {value!r}; this transform is {expected!r}: the schedules and payloads differ, so it "
           "cannot continue that run."),
    Expect(r"outer\.(\d+)\.\w+\.present",
           lambda v, e, m, c: e is not ABSENT or v is not True or f"global.{m[1]}" not in c.expected,
           "it holds outer-optimizer state with fields {saved_fields}; this transform's outer optimizer keeps "
           "{fields}: it is a checkpoint of another optimizer."),
    Expect(r"outer\.(\d+)\.(\w+)\.present",
           lambda v, e, m, c: v is True or e is not True or m[2] not in c.counts,
           "it holds no step count for parameter {0}'s outer state (``{1}``): it was saved by an outer optimizer that "
           "keeps none (without a schedule or dampening), which this one needs."),
    Expect("world_size",
           lambda v, e, m, c: not (c.residuals and type(v) is int and v >= 0 and e >= 0 and v != e),
           "it was saved at world size {value}, this run has {expected}: each rank's error-feedback residuals are its "
           "own (what its payloads have not sent yet), so a compressed run resumes at the world size it was saved at."),
    Expect(r"residual\.\d+\.rank(\d+)", lambda v, e, m, c: m.string not in c.missing,
           "it holds no error-feedback residuals of rank {0}: it was saved at a smaller world size. Each rank's "
           "residuals are its own; a compressed run resumes at the world size it was saved at."),
    Expect(r"in_flight\.(\d+)\.snapshot\.\d+\.rank(\d+)", lambda v, e, m, c: m.string not in c.missing,
           "it holds no snapshot of rank {1} for fragment {0}'s synchronization in flight: it was saved at a smaller "
           "world size. A checkpoint loads at another world size only when no delayed synchronization is in flight "
           "(save at a step where none is, e.g. a multiple of sync_every that applies no delay)."),
    Expect(_ANY, lambda v, e, m, c: m.string not in c.missing,
           "it lacks ``{key}``, which this transform's checkpoint holds."),
    Expect("step", lambda v, e, m, c: NON_NEGATIVE_INT.holds(v, {}),
           "``step`` must be a non-negative int, got {value!r}."),
    Expect(r"residual\.(\d+)\.rank(\d+)", lambda v, e, m, c: _is_tensor_of_shape(v, e),
           "rank {1}'s residual {0} has shape {shape}, this rank's shard {expected_shape}: it was saved at "
           "another sharding. A compressed run resumes at the layout it was saved at."),
    Expect(r"in_flight\.(\d+)\.started", lambda v, e, m, c: type(v) is not int or v == e,
           "fragment {0}'s synchronization in flight started after inner step {value} (-1: none); after the saved "
           "step {step} the schedule has {scheduled}."),
    Expect(_ANY, lambda v, e, m, c: m.string not in c.extra,
           "it holds entries this transform's checkpoint does not: [{key!r}] (a checkpoint of other parameters: more "
           "leaves or fragments)."),
    Expect(_ANY, lambda v, e, m, c: _same_kind(m.string, v, e),
           "it holds ``{key}`` as {found}, where this transform's checkpoint holds {holds}: it is not a state of this "
           "transform for these parameters."),
)
"""What a saved checkpoint must hold, as rows read by :func:`check_saved`, the first
that fails raising."""


def check_saved(config: OuterConfig, state: OuterState, saved: Mapping[str, Any], expected: Mapping[str, Any],
                rank: int) -> None:
    """Raise ``ValueError`` unless ``saved`` is a state of this very transform that
    can be loaded on ``rank`` (nothing is built before it passes): the first row of
    :data:`SAVED` that an entry of ``saved`` or of ``expected`` (this transform's
    checkpoint of the template ``state``, :func:`puredist.outer.checkpoint.state_dict`)
    breaks, its rows in their order (the table loop
    :func:`~puredist._validation.check_entries`)."""
    check_entries("saved", SAVED, saved, _load(config, state, saved, expected, rank), _why, absent=ABSENT)


_STARTED = re.compile(r"in_flight\.(\d+)\.started")
_FLAG_OF_LEAF_0 = re.compile(r"outer\.0\.\w+\.present")


def _load(config: OuterConfig, state: OuterState, saved: Mapping[str, Any], expected: Mapping[str, Any],
          rank: int) -> _Load:
    """What :data:`SAVED`'s rows compare ``saved`` with: ``expected`` with each
    fragment's synchronization in flight the schedule has at the saved step (where
    that step is one: else its row refuses it first), and the entries missing or
    beyond it."""
    step = saved.get("step")
    if NON_NEGATIVE_INT.holds(step, {}):
        expected = {key: started_in_flight(config, int(match[1]), step) if (match := _STARTED.fullmatch(key)) else value
                    for key, value in expected.items()}
    declared = declaration(type(state.outer_state[0])) if state.outer_state else None
    return _Load(
        expected, frozenset(_missing(expected, saved)), frozenset(_unexpected_entries(expected, saved, rank)),
        bool(state.residuals), step, config.delay, declared.counts if declared else (),
        sorted(state.outer_state[0]._fields) if state.outer_state else [],
        sorted(key.split(".")[2] for key in saved if _FLAG_OF_LEAF_0.fullmatch(key) and saved[key] is True),
    )


def _why(row: Expect, match: Any, value: object, load: _Load) -> str:
    """``row``'s message for the entry ``match`` (a ``re.Match`` of its key) names
    (``value``: its saved value)."""
    expected = load.expected.get(match.string, ABSENT)
    return row.why.format(
        *match.groups(), key=match.string, value=value, expected=expected, found=_entry(value), holds=_entry(expected),
        shape=_shape(value), expected_shape=_shape(expected), fields=load.fields, saved_fields=load.saved_fields,
        step=load.step, scheduled=f"the one started after inner step {expected} in flight, applied after inner step "
        f"{expected + load.delay}" if isinstance(expected, int) and expected >= 0 else "none in flight",
    )


def _shape(value: object) -> tuple | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _entry(value: object) -> str:
    """A checkpoint entry, described without its values."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and {value.dtype}"
    if value is ABSENT:
        return "nothing"
    return f"{type(value).__name__} {value!r}" if isinstance(value, bool) else type(value).__name__


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


def _missing(expected: Mapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
    """The keys of ``expected`` (this transform's checkpoint of the template) that
    ``saved`` lacks, but those that may be absent: ``world_size`` (older
    checkpoints), a field this optimizer's state does not have either (with its
    presence flag), and other ranks' snapshots where none is in flight."""
    def may_be_absent(key: str, template: Any) -> bool:
        field_absent = key.endswith(".present") and not template or (
            key.startswith("outer.") and not expected.get(f"{key}.present", True)
        )
        idle_snapshot = ".snapshot." in key and saved.get(f"in_flight.{key.split('.')[1]}.started") == -1
        return key == "world_size" or field_absent or idle_snapshot

    return [key for key, template in expected.items() if key not in saved and not may_be_absent(key, template)]
