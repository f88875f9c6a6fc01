"""The errors puredist raises for a collective that did not complete, and their messages.

- :class:`CollectiveError`: a collective failed part-way (a peer died, a timeout, the
  backend); no tensor holds a partial result, and the message says which elements hold
  the result and which their old values (:func:`nothing_changed` where none changed).
- :class:`RankMismatchError`: the ranks of one group passed different tensors, or run
  different schedules; raised on every rank, before anything is sent
  (:meth:`~puredist.RankMismatchError.of_summaries`), or hold different values where they must
  hold the same (:meth:`~puredist.RankMismatchError.of_values`).
- :class:`Healed`, :class:`HealFailed`: a torchft quorum healed this replica
  (:mod:`puredist.ft`); they are plain exceptions, so this module imports no torchft.

Each is re-exported where it is public: :mod:`puredist` (``CollectiveError``,
``RankMismatchError``), :mod:`puredist.collectives` (``CollectiveError``),
:mod:`puredist.ft` (``Healed``, ``HealFailed``).

This module must not import the rest of puredist (every module may raise these) nor
torchft (an optional extra).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["CollectiveError", "HealFailed", "Healed", "RankMismatchError", "nothing_changed"]


class CollectiveError(RuntimeError):
    """A collective failed part-way; no tensor holds a partial result.

    Attributes:
        completed_elements: for each tensor passed (in order), how many of its leading
            elements (in flat, row-major order; complex tensors counted in real
            components) hold the result; the others hold their values from before the
            call. All zeros: nothing changed.
        failed_bucket: the index of the bucket whose collective failed (``None``: the
            rank check before any bucket failed).
        buckets: how many buckets the call had.
        state: set by :func:`~puredist.outer_optimizer`'s ``update_`` when its
            lower-level averaging fails after the outer step was applied: the state
            to continue from.
    """

    def __init__(self, what: str, completed_elements: Sequence[int], totals: Sequence[int], failed_bucket: int | None,
                 buckets: int, cause: BaseException, *, stage: str = "the rank check",
                 advice: str = "The process group may be broken; retrying on a working group is safe."):
        self.completed_elements = tuple(completed_elements)
        self.failed_bucket = failed_bucket
        self.buckets = buckets
        self.state = None
        where = f"in {stage}" if failed_bucket is None else f"in bucket {failed_bucket + 1} of {buckets}"
        super().__init__(
            f"{what} failed {where} ({type(cause).__name__}: "
            f"{str(cause).strip().splitlines()[0] if str(cause).strip() else ''}). No tensor holds a partial "
            f"result: {_progress(self.completed_elements, totals)}. {advice}"
        )


def _ranges(positions: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for position in positions:
        if runs and runs[-1][1] == position - 1:
            runs[-1][1] = position
        else:
            runs.append([position, position])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _progress(completed: Sequence[int], totals: Sequence[int]) -> str:
    done = [i for i, (c, n) in enumerate(zip(completed, totals)) if c == n and n > 0]
    untouched = [i for i, c in enumerate(completed) if c == 0 and totals[i] > 0]
    parts = []
    if done:
        parts.append(f"tensors [{_ranges(done)}] hold the result")
    if untouched:
        parts.append(f"tensors [{_ranges(untouched)}] their values from before the call")
    parts += [
        f"tensor {i} the result in elements [0, {c}) and its old values after"
        for i, (c, n) in enumerate(zip(completed, totals)) if 0 < c < n
    ]
    return "; ".join(parts) if parts else "there was nothing to change"


def nothing_changed(tensors: Sequence[torch.Tensor], what: str, cause: BaseException, *,
                    stage: str = "the rank check") -> CollectiveError:
    """The error for a collective that failed with nothing written: before any bucket
    (the rank check), or at another ``stage`` that writes only once it has succeeded
    (a torchft step's quorum, all-reduce or vote)."""
    return CollectiveError(what, [0] * len(tensors), [t.numel() for t in tensors], None, 0, cause, stage=stage)


class RankMismatchError(RuntimeError):
    """Ranks of one process group passed different tensor lists to one collective.

    Attributes:
        ranks: the group's ranks (global), in group order (empty where not gathered).
        contexts: each rank's context, in the same order.
        layouts_differ: whether the tensors differ (else only the contexts do).
    """

    def __init__(self, message: str, *, ranks=(), contexts=(), layouts_differ: bool = False) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.contexts = tuple(contexts)
        self.layouts_differ = layouts_differ

    @classmethod
    def of_summaries(cls, what: str, ranks: Sequence[int], summaries: Sequence[Sequence[int]],
                     contexts: Sequence[object]) -> "RankMismatchError":
        """The error of a rank check at ``what`` whose summaries differ: rank
        ``ranks[i]`` sent ``summaries[i]`` (tensor count, elements, layout digest,
        context digest) and its context ``contexts[i]``."""
        layouts_differ = any(s[:3] != summaries[0][:3] for s in summaries)
        cause = (
            "ranks passed different tensors (a parameter without .grad on some ranks only is the usual cause)"
            if layouts_differ
            else "ranks are at different steps or run different schedules (configuration, step or the collective's "
            "options, such as its bucket cap, differ)"
        )
        lines = "\n  ".join(
            f"rank {rank}: {count} tensors, {numel} elements, layout digest {layout & 0xFFFFFFFF:08x}, context {c!r}"
            for rank, (count, numel, layout, _), c in zip(ranks, summaries, contexts)
        )
        return cls(
            f"Mismatch at {what}: {cause}; nothing was changed. Per rank:\n  {lines}",
            ranks=ranks, contexts=[str(c) for c in contexts], layouts_differ=layouts_differ,
        )

    @classmethod
    def of_values(cls, differing: Sequence[int], count: int, what: str, *, simulated: bool = False
                  ) -> "RankMismatchError":
        """The error of a check that ``count`` tensors hold the same values on every
        rank (every replica, ``simulated``) at ``what``: those at ``differing`` do not."""
        if simulated:
            return cls(f"Tensors {differing} (of {count}) differ between replicas; they must start equal on every "
                       f"replica. Checked: {what}.")
        return cls(
            f"Tensors {differing} (of {count}) differ between ranks; they must start equal on every rank (broadcast "
            f"them from one rank, as DDP does at construction). Checked: {what}."
        )

    @classmethod
    def of_replicas(cls, at: str, contributors: int) -> "RankMismatchError":
        """The error of torchft's rank check at ``at``, whose summed rows (no
        per-replica summaries: one all-reduce) tell only that the replicas disagree,
        or, with no ``contributors``, that every one is healing."""
        reason = ("no replica contributes (every one is healing)" if contributors < 1 else
                  "the replicas passed different tensor layouts or contexts, or committed different histories "
                  "(a step that some replicas committed and others redid in a quorum without them)")
        return cls(f"{at}: {reason}; nothing was changed.", layouts_differ=contributors >= 1)


class Healed(Exception):
    """The quorum a :class:`~puredist.ft.ManagerCollective` started healed this replica (the manager
    has called the registered ``load_state_dict`` functions). Built with
    ``restart_on_heal=True``, it raises at once: nothing was reduced, and the quorum
    stays open for the caller's next reduction, which this replica joins with zeros
    (it must be the reduction its peers are running, from their state). Without, it
    takes part with zeros and raises once the vote is done, also where the step failed
    (the failure as its ``__cause__``: the heal stands all the same): its tensors were not
    written, and its peers' reduction completes where it was the same reduction
    (the same tensors' layout; with a different one, from its stale schedule, the
    all-reduce fails at the backend's timeout on every replica)."""


class HealFailed(RuntimeError):
    """A quorum healed this replica from a peer (torchft took the peer's step and
    history), but the peer's state did not load: a ``load_state_dict`` function
    registered with the manager raised (its error is the ``__cause__``), or, in
    :class:`~puredist.ft.FaultTolerantOuter`, the transform's checked load. The replica
    is at its peers' step with its own, stale state, so it cannot rejoin with this
    manager: every later reduction of its collective raises this again, communicating
    nothing (a stale member would otherwise be averaged in, or make every replica
    fail the rank check). Stop the manager (``manager.shutdown()``) or exit: while it
    heartbeats, the lighthouse holds its peers' quorums for it. Restart the replica
    group."""

    def again(self) -> "HealFailed":
        """A new error with this one's message and cause, to raise at a later call
        (re-raising this one would grow its traceback at every call)."""
        renewed = HealFailed(str(self))
        renewed.__cause__ = self.__cause__
        return renewed
