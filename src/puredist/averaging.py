"""Model averaging as pure functions over explicit state (optax style).

The one-shot functions :func:`average` (pure) and :func:`average_` (in place) take
the mean of a parameter pytree over a group of ranks. The averagers
:func:`periodic_averager` (post-local SGD) and :func:`hierarchical_averager`
(hierarchical SGD) add a schedule: each returns an :class:`Averager` whose

- ``init(params) -> AveragerState`` starts the step counter at 0;
- ``update(params, state, *, collective) -> (params, state)`` is pure: when the
  schedule says so it returns *new* tensors holding the mean, never writing into
  ``params``; otherwise it returns ``params`` itself. ``state`` is never mutated;
- ``update_(params, state, *, collective) -> state`` writes the mean into the
  tensors' own storage (for real training: bounded memory, storage unchanged).

Static configuration lives in the closure; the state holds only the Python-int step,
so it checkpoints as ``state._asdict()`` and is decided on the host, identically on
every rank. ``params`` is any pytree of floating-point tensors (a dict from
``named_parameters()``, a list, nested containers); ``None`` leaves are skipped.
"""

from typing import Callable, Mapping, NamedTuple

import torch

from puredist._inputs import checked, checked_for_reduction
from puredist.tree import PyTree, tree_flatten, tree_unflatten
from puredist._validation import (
    LEVELS,
    ONE_OF,
    check,
    check_hierarchy_group_sizes,
    check_hierarchy_periods,
    warn_if_max_period_is_one,
    warn_if_period_is_one,
)
from puredist.collectives import Collective, CollectiveHandle, check_is_collective, refusing
from puredist.collectives.base import check_group_sizes
from puredist.averaging_schedules import hierarchical_schedule, periodic_schedule
from puredist._docs import fields_documented

__all__ = [
    "Averager", "AveragerState", "average", "average_", "averaged_tensors", "periodic_averager",
    "periodic_averager_warning_at", "hierarchical_averager", "hierarchical_averager_warning_at",
]


@fields_documented
class AveragerState(NamedTuple):
    """State of a scheduled averager.

    Attributes:
        step: how many times ``update``/``update_`` ran; the schedule is evaluated at
            this value before it is incremented.
    """

    step: int


@fields_documented
class Averager(NamedTuple):
    """A scheduled averager (see the module docstring).

    Attributes:
        init: ``init(params=None) -> AveragerState``: the state at step 0.
        update: ``update(params, state, *, collective) -> (params, state)``: pure; when
            the schedule says so, new tensors holding the mean (differentiable).
        update_: ``update_(params, state, *, collective) -> state``: averages
            ``params``' own storage when the schedule says so.
    """

    init: Callable[[PyTree], AveragerState]
    update: Callable[..., tuple[PyTree, AveragerState]]
    update_: Callable[..., AveragerState]


def _float_leaves(params: PyTree, *, in_place: bool) -> tuple[list[torch.Tensor], object]:
    """The leaves of ``params`` and its spec, checked to be averageable (every step,
    averaging or not, so bad input is found at once; in place, once per layout: the
    leaves come as a :class:`~puredist._layout.Checked` list, which a collective
    takes without checking again)."""
    leaves, spec = tree_flatten(params)
    if in_place:
        return checked(leaves, arg="params", noun="leaf"), spec
    checked_for_reduction(leaves, arg="params", noun="leaf", in_place=False)
    return leaves, spec


def average_(
    params: PyTree,
    *,
    collective: Collective,
    group_size: int | None = None,
    async_op: bool = False,
) -> CollectiveHandle | None:
    """Replace every tensor of ``params``, in place, by its mean over the group.

    For rank ``r`` in group ``G`` of ``group_size`` ranks:
    ``p_r <- (1/|G|) * sum_{s in G} p_s``, computed in ``p``'s own dtype.

    Args:
        params: pytree of floating-point tensors, the same layout on every rank.
        collective: the backend (:class:`~puredist.collectives.DistributedCollective`
            or :class:`~puredist.collectives.SimulatedCollective`).
        group_size: ``None`` for the whole group, else a size in
            ``collective.group_sizes``.
        async_op: return a handle to ``wait()`` on instead of blocking.

    Returns:
        ``None``, or an :class:`~puredist.collectives.CollectiveHandle`.

    Raises:
        TypeError: a leaf is not a floating-point or complex tensor (nothing is touched).
        ValueError: a sparse or meta leaf, leaves sharing memory, or a ``group_size``
            the collective does not support (nothing is touched).
        RankMismatchError: ranks passed different layouts (on every rank).
        CollectiveError: an all-reduce failed; every element holds its old value or
            its mean, as the error details.
    """
    check_is_collective(collective)
    with refusing(collective, group_size=group_size):
        leaves, _ = _float_leaves(params, in_place=True)
    return collective.mean_(leaves, group_size=group_size, async_op=async_op)


def average(params: PyTree, *, collective: Collective, group_size: int | None = None) -> PyTree:
    """The pure form of :func:`average_`: return a new pytree holding the mean.

    ``params`` is not modified; the result's tensors are new. Differentiable, with
    every backend: the gradient of a mean over a group is the mean of the incoming
    gradients over the same group (on real ranks an all-reduce in the backward).
    Under ``torch.func.vmap`` over simulated ranks, pass a
    :class:`~puredist.VmapCollective`.
    """
    check_is_collective(collective)
    with refusing(collective, group_size=group_size):
        leaves, spec = _float_leaves(params, in_place=False)
    return tree_unflatten(spec, collective.mean(leaves, group_size=group_size))


def averaged_tensors(module: torch.nn.Module, *, buffers: bool = False, integer_buffers: str = "skip") -> dict[str, torch.Tensor]:
    """The tensors of ``module`` to hand to an averager, by name.

    Args:
        module: the model.
        buffers: also include floating-point buffers (e.g. BatchNorm running
            statistics); off by default, as torch's averagers average parameters only.
        integer_buffers: what to do with integer buffers (e.g. BatchNorm's
            ``num_batches_tracked``) when ``buffers``: ``"skip"`` leaves them out (each
            rank keeps its own), ``"error"`` raises. They are never averaged as floats.

    Returns:
        ``{name: tensor}``: the module's own tensors (averaging them in place updates
        the module), parameters first, in ``named_parameters()``/``named_buffers()`` order.

    Raises:
        ValueError: unknown ``integer_buffers``; with ``"error"``, an integer buffer.
    """
    check("integer_buffers", integer_buffers, ONE_OF, choices=("skip", "error"))
    tensors = dict(module.named_parameters())
    if buffers:
        for name, buffer in module.named_buffers():
            if buffer.is_floating_point():
                tensors[name] = buffer
            elif integer_buffers == "error":
                raise ValueError(
                    f"Buffer {name!r} has dtype {buffer.dtype}: averaging it as a float is refused; "
                    "pass integer_buffers='skip' to leave it alone."
                )
    return tensors


_Decision = tuple[bool, "int | None"]


class _ScheduleStep(NamedTuple):
    """The rank-check context of one averaging: ``str()`` formats it, only when a
    backend checks it (a Python int step may be symbolic under ``torch.compile``)."""

    schedule: str
    step: int

    def __str__(self) -> str:
        return f"{self.schedule} step {self.step}"


def _scheduled_averager(
    decide: Callable[[int], _Decision], check_collective: Callable[[Collective], None], schedule: str
) -> Averager:
    """Build an :class:`Averager` from ``decide(step) -> (due, group_size)``;
    ``schedule`` describes its configuration for the rank check (with the step, it
    must be equal on every rank at every averaging)."""

    def init(params: PyTree = None) -> AveragerState:
        """A fresh state (step 0); ``params`` is accepted for optax's signature."""
        del params  # the state holds no tensors
        return AveragerState(step=0)

    def leaves_of(params: PyTree, state: AveragerState, collective: Collective, *, in_place: bool):
        check_is_collective(collective)
        due, group_size = decide(state.step)
        context = _ScheduleStep(schedule, state.step)
        if due:
            with refusing(collective, group_size=group_size, context=context):  # the peers raise at once
                leaves, spec = _float_leaves(params, in_place=in_place)
        else:  # bad input is found at every step; no peer waits for this rank's collective then
            leaves, spec = _float_leaves(params, in_place=in_place)
        check_collective(collective)
        return leaves, spec, due, group_size, context

    def update(params: PyTree, state: AveragerState, *, collective: Collective):
        """Pure: ``(params or new tensors holding their mean, state at step + 1)``; differentiable."""
        leaves, spec, due, group_size, context = leaves_of(params, state, collective, in_place=False)
        if due:
            params = tree_unflatten(spec, collective.mean(leaves, group_size=group_size, context=context))
        return params, AveragerState(step=state.step + 1)

    def update_(params: PyTree, state: AveragerState, *, collective: Collective) -> AveragerState:
        """In place: average ``params``' own storage when due; return the state at step + 1."""
        leaves, _, due, group_size, context = leaves_of(params, state, collective, in_place=True)
        if due:
            collective.mean_(leaves, group_size=group_size, context=context)
        return AveragerState(step=state.step + 1)

    return Averager(init, update, update_)


def periodic_averager(period: int, warmup_steps: int = 0) -> Averager:
    """Post-local SGD: average over the whole group every ``period`` steps after
    ``warmup_steps``, by torch's ``PeriodicModelAverager`` rule (step ``k`` averages
    iff ``k >= warmup_steps and (k - warmup_steps) % period == 0``).

    Raises:
        ValueError: ``period < 1`` or ``warmup_steps < 0``.
        TypeError: either is not an int.

    Warns:
        UserWarning: ``period == 1`` (DDP alone communicates less), as torch does.
    """
    return periodic_averager_warning_at(period, warmup_steps, stacklevel=3)


def periodic_averager_warning_at(period: int, warmup_steps: int, *, stacklevel: int | None) -> Averager:
    """:func:`periodic_averager`, its warning attributed to the frame ``stacklevel``
    above this one (2: the caller's line; a drop-in class passes its own caller's;
    ``None``: no warning)."""
    averages = periodic_schedule(period, warmup_steps)
    warn_if_period_is_one(period, stacklevel=stacklevel)
    return _scheduled_averager(
        lambda step: (averages(step), None),
        lambda collective: None,
        f"periodic_averager(period={period}, warmup_steps={warmup_steps})",
    )


def hierarchical_averager(period_group_sizes: Mapping[int, int], warmup_steps: int = 0) -> Averager:
    """Hierarchical SGD by torch's ``HierarchicalModelAverager`` rule: at step
    ``k >= warmup_steps`` the largest period dividing ``k`` wins, and the ranks
    average within blocks of that period's group size.

    Args:
        period_group_sizes: ``{period: group_size}``, periods strictly increasing;
            the last group size must be the collective's whole size, and every size
            must divide it (checked at each update against the collective given).
        warmup_steps: steps before the first averaging.

    Raises:
        TypeError: ``period_group_sizes`` not a mapping, or a period not an int.
        ValueError: empty or unordered periods, non-positive period, negative warmup;
            at update, a group size the collective cannot average within.

    Warns:
        UserWarning: the largest period is 1, as torch does.
    """
    return hierarchical_averager_warning_at(period_group_sizes, warmup_steps, stacklevel=3)


def hierarchical_averager_warning_at(
    period_group_sizes: Mapping[int, int], warmup_steps: int, *, stacklevel: int | None
) -> Averager:
    """:func:`hierarchical_averager`, its warning attributed as
    :func:`periodic_averager_warning_at`'s (the warning comes before the warm-up's
    check, as torch's)."""
    check("period_group_sizes", period_group_sizes, LEVELS)
    periods = tuple(period_group_sizes)
    check_hierarchy_periods(periods, arg="period_group_sizes")
    group_sizes = tuple(period_group_sizes.values())
    warn_if_max_period_is_one(periods, stacklevel=stacklevel)
    level = hierarchical_schedule(periods, warmup_steps)

    def decide(step: int) -> _Decision:
        index = level(step)
        return (index is not None, None if index is None else group_sizes[index])

    def check_collective(collective: Collective) -> None:
        """Raise ``ValueError`` where ``collective`` (this rank a member) cannot average
        within the hierarchy's group sizes."""
        if collective.is_member:  # (a rank outside the collective averages nothing)
            check_hierarchy_group_sizes(group_sizes, collective.world_size, arg="period_group_sizes",
                                        whole="the collective")
        check_group_sizes(collective, group_sizes, arg="period_group_sizes")

    return _scheduled_averager(
        decide, check_collective, f"hierarchical_averager({dict(period_group_sizes)}, warmup_steps={warmup_steps})"
    )
