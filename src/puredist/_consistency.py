"""Detect, on every rank at once, that ranks are about to reduce different tensors.

torch's ``get_params_to_average`` keeps parameters whose ``.grad`` is set, which is a
rank-local fact: two ranks may then pass lists of different lengths or shapes to one
all-reduce, which hangs or averages unrelated values. Ranks running different
schedules (another period, warm-up, an extra ``update_`` call) would pair one step's
collectives with another's. Before reducing, every rank contributes a 4-number
summary — count, total elements, a digest of the devices, dtypes, shapes and
contiguity (and a DTensor's sharding), and a digest of the caller's *context* (its schedule's configuration and
step) — to one small ``all_gather``; every rank sees every summary, so either all
ranks proceed or all raise the same error, which shows each rank's context.

The check runs over the group about to reduce. Ranks that disagree about *which*
group (a hierarchical schedule where one rank is at a whole-group step and another at
a subgroup step) wait in different checks: their backend's timeout ends it, as a
:class:`~puredist.CollectiveError` that says nothing was changed.

The other checks of the ranks' agreement live here too, each given what it needs by
its caller (this module imports no collective, optimizer or transform): a refusal told
to the peers (:func:`refuse_on_all_ranks`), the same values on every rank
(:func:`check_same_digests`, the initial copy of a DiLoCo step,
:func:`check_copy_replicated`), torchft's replica verdict
(:func:`check_replica_sums`, :func:`check_same_values`), and a loaded optimizer state
being each rank's own (:func:`check_loaded_own`).

This module must not change a tensor: it reads metadata and values and exchanges
summaries only.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from puredist._dtensors import local_shard
from puredist._host_groups import exchange
from puredist._layout import Layout, digest, layout_of
from puredist._transforms import is_transformed
from puredist.errors import CollectiveError, RankMismatchError, nothing_changed


REFUSED = " | refused: "
"""Joins a rank's context and the reason it refuses the operation (see :func:`refusals`)."""


def with_refusal(context: str, reason: str) -> str:
    """``context`` as the rank check sends it when this rank refuses the operation for
    ``reason`` (``""``: it does not)."""
    return f"{context}{REFUSED}{reason}" if reason else context


def refusals(error: RankMismatchError) -> list[str]:
    """``["rank r: reason", ...]`` when the rank check failed only because some ranks
    refused (their contexts carry a reason, :func:`with_refusal`), else ``[]``. Every
    rank sees the same contexts, so every rank can raise the same error naming them,
    though only the refusing ranks found the cause (a rank of a ZeRO step that owns no
    parameter, a rank whose values are finite)."""
    if error.layouts_differ or len({str(c).split(REFUSED)[0] for c in error.contexts}) != 1:
        return []
    return [f"rank {rank}: {c.split(REFUSED)[1]}" for rank, c in zip(error.ranks, error.contexts) if REFUSED in c]


def refuse_on_all_ranks(check_same_on_all_ranks: Callable[..., None], reason: str, *, group_size: int | None = None,
                        context: object = "") -> None:
    """Take part, refusing for ``reason``, in the rank check that this rank's peers in
    the group of ``group_size`` run before their averaging: ``check_same_on_all_ranks``
    (a collective's, as :meth:`~puredist.DistributedCollective.check_same_on_all_ranks`)
    runs with no tensors and ``context`` marked refused (:func:`with_refusal`), so that
    the peers raise :class:`~puredist.RankMismatchError` at once, its message showing
    ``reason``, instead of waiting for this rank until the backend's timeout. What the
    check raises here (the mismatch the peers raise, or its own collective's failure)
    is dropped: the caller then raises its own error."""
    try:
        check_same_on_all_ranks([], context=with_refusal(str(context), reason), what="one averaging all-reduce",
                                group_size=group_size)
    except (RankMismatchError, CollectiveError):
        pass  # (what the peers raise; this rank raises the error it found)


def check_same_on_all_ranks(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, *,
                            layout: Layout | None = None, context: object, what: str) -> None:
    """Raise :class:`RankMismatchError` on every rank of ``group`` unless all pass
    tensors of the same layouts and the same ``context`` (:func:`start_rank_check`,
    finished at once); :class:`~puredist.CollectiveError` (nothing changed) where the
    check's own collective fails. A no-op where ``group`` is ``None`` (the caller checks
    nothing) or holds one rank."""
    if group is not None and dist.get_world_size(group) > 1:
        start_rank_check(tensors, group, layout=layout, context=context, what=what).finish()


def start_rank_check(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    *,
    layout: Layout | None = None,
    context: object = "",
    what: str = "one averaging all-reduce",
) -> "PendingRankCheck":
    """Send this rank's summary (an asynchronous all-gather); the check returned
    raises :class:`RankMismatchError` on every rank, when finished, unless all ranks
    of ``group`` hold tensors of the same count, device types, dtypes, shapes and
    contiguity, in order, and the same ``context`` string. In between, the caller may
    pack its first bucket while the summaries travel; nothing may be sent over
    ``group``'s ranks before :meth:`PendingRankCheck.finish` has returned. On a
    mismatch every rank also gathers the others' contexts (one more small collective,
    on every rank alike) for the message. The summaries travel over ``group``'s host
    side (:func:`~puredist._host_groups.exchange`: its Gloo twin, or its device).

    Args:
        tensors: this rank's tensors.
        group: a group of the ranks about to use them (this rank is a member).
        layout: the tensors' :class:`~puredist._layout.Layout`, if the caller has it
            (its summary is computed once per layout); else looked up.
        context: more that must agree (the schedule's configuration and step, a ZeRO
            plan's digest): a string, or an object whose ``str()`` is one (built only
            here, so callers under ``torch.compile`` need not format it).
        what: the operation, for the message.

    Raises:
        CollectiveError: the summary could not be made or sent (nothing changed;
            the error its cause).
    """
    try:  # (a failure anywhere before the summaries are sent, formatting ``context`` too, changed nothing)
        context = str(context)
        summary = (layout if layout is not None else layout_of(tensors)).summary(tensors)
        over, device = exchange(group)
        local = torch.tensor([*summary, digest(context)], dtype=torch.int64, device=device)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(over))]
        work = dist.all_gather(gathered, local, group=over, async_op=True)
    except Exception as cause:  # noqa: BLE001 - the backend's error, with what it left
        raise _unchanged(tensors, what, cause) from cause
    return PendingRankCheck(work, gathered, over, context, what, tensors)


def _unchanged(tensors: Sequence[torch.Tensor], what: str, cause: Exception) -> CollectiveError:
    """The error of a rank check whose own collective failed: nothing was changed."""
    return nothing_changed([local_shard(t) for t in tensors], what, cause)


class PendingRankCheck:
    """A rank check whose summaries are on their way (:func:`start_rank_check`)."""

    __slots__ = ("_work", "_gathered", "_group", "_context", "_what", "_tensors")

    def __init__(self, work, gathered: list[torch.Tensor], group: dist.ProcessGroup, context: str, what: str,
                 tensors: Sequence[torch.Tensor]) -> None:
        self._work, self._gathered, self._group, self._context, self._what = work, gathered, group, context, what
        self._tensors = tensors

    def finish(self) -> None:
        """Wait for every rank's summary.

        Raises:
            RankMismatchError: on every rank, listing each rank's summary, unless
                they are all the same (every rank then gathers the others' contexts
                for the message: one more small collective, on every rank alike).
            CollectiveError: the backend failed (nothing changed; its error the cause).
        """
        try:
            self._work.wait()
            summaries = [t.tolist() for t in self._gathered]
            differ = any(summary != summaries[0] for summary in summaries)
            contexts: list[object] = [None] * len(summaries)
            if differ:
                dist.all_gather_object(contexts, self._context, group=self._group)
        except Exception as cause:  # noqa: BLE001 - the backend's error, with what it left
            raise _unchanged(self._tensors, self._what, cause) from cause
        if differ:
            raise RankMismatchError.of_summaries(self._what, dist.get_process_group_ranks(self._group), summaries,
                                                 contexts)


def gather_value_digests(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> list[list[int]]:
    """Every rank's :func:`value_digest` of each of ``tensors`` (a DTensor's local
    shard), one row per rank of ``group`` in group order: one small all-gather over
    ``group``'s host side. What :func:`check_same_digests` compares."""
    over, device = exchange(group)
    digests = torch.tensor([value_digest(local_shard(t)) for t in tensors], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(digests) for _ in range(dist.get_world_size(over))]
    dist.all_gather(gathered, digests, group=over)
    return [g.tolist() for g in gathered]


def check_same_digests(rows: Sequence[Sequence[int]], count: int, what: str, *, simulated: bool = False) -> None:
    """Raise :class:`RankMismatchError` unless every row of ``rows`` equals the first:
    the one comparison of every backend's
    :meth:`~puredist.Collective.value_digests` (one row per rank, an int per tensor of
    the ``count``; the same rows on every rank, so every rank raises alike; ``[]``:
    nothing to compare). The message names the tensors that differ, ``what`` names
    them all; ``simulated``: the ranks are replicas in one process."""
    differing = [i for i in range(count) if any(row[i] != rows[0][i] for row in rows)]
    if differing:
        raise RankMismatchError.of_values(differing, count, what, simulated=simulated)


def check_copy_replicated(copies: Sequence[torch.Tensor], collective: Any, *, on_host: bool,
                          explain: Callable[[str], str], context: str) -> None:
    """At a DiLoCo transform's step 0: raise :class:`RankMismatchError` on every rank
    unless the global copy made by ``init`` (``copies``) is the same on every rank,
    by ``collective.check_replicated`` with ``context``.

    Args:
        on_host: the collective reads the copies on the host (any but a
            :class:`~puredist.VmapCollective`, which checks the replicas' copies
            itself): they are read as plain tensors, also under a ``torch.func``
            transform or ``torch.compile``, which only an unmapped copy allows.
        explain: the transform's configuration around a message (``OuterConfig.explain``).

    Raises:
        NotImplementedError: ``on_host``, and a transform maps a copy.
    """
    if on_host and any(is_transformed(t) for t in copies):
        raise NotImplementedError(explain(
            "At step 0 the global copy made by init is checked to be the same on every rank, on the host, "
            "which a torch.func transform hides when it maps the copy: pass the state of init unmapped, "
            "take step 0 outside the transform, or (under vmap) average with a VmapCollective."))
    with torch._C._DisableFuncTorch() if on_host else contextlib.nullcontext():  # (plain tensors, read as eagerly)
        collective.check_replicated(list(copies), what=explain("the initial parameters (the global copy made by init)"),
                                    context=context)


def check_same_values(given: Any, context: str, *, compare: Callable[[Any, str], None]) -> None:
    """Raise, through ``compare``, unless every torchft replica holds the same values in
    ``given`` (checked tensors: their ``reduced`` tensors and ``layout``):
    ``compare(given, agreed)`` is the replicas' rank check, which raises
    :class:`RankMismatchError` on every replica unless ``agreed`` is the same on each
    (:func:`check_replica_sums`); ``agreed`` holds ``given``'s layout summary,
    ``context`` and a :func:`value_digest` of each reduced tensor."""
    digests = " ".join(str(value_digest(t)) for t in given.reduced)
    compare(given, f"{given.layout.summary(given)} {context} values {digests}")


def check_replica_sums(sums: Sequence[int], at: str, *, vote_against: Callable[[Exception], None]) -> int:
    """torchft's replica verdict, from the rank check's rows summed over the quorum,
    ``[checked, s1, q1, s2, q2, contributors, refusing]`` (see
    :mod:`puredist.ft.collective`: the checked replicas agree iff ``checked * q ==
    s**2`` for both digests, equality in Cauchy-Schwarz): the number of contributing
    replicas. The sums are the same on every replica, so all decide alike; before
    raising, each calls ``vote_against(error)`` (it records the error and votes
    against the step).

    Raises:
        RankMismatchError: the checked replicas disagree, or none contributes
            (``at`` names the step).
        ValueError: some replica refused the step.
    """
    members, s1, q1, s2, q2, count, refusing = sums
    error = None
    if count < 1 or members * q1 != s1 * s1 or members * q2 != s2 * s2:
        error = RankMismatchError.of_replicas(at, count)
    elif refusing:
        error = ValueError(f"{at}: {refusing} replica(s) refused the step; nothing was changed.")
    if error is not None:
        vote_against(error)
        raise error
    return count


def check_loaded_own(loaded: tuple[bool, str, int], params: Sequence[torch.Tensor], group: dist.ProcessGroup, *,
                     who: str) -> None:
    """At the first step after a load (every rank of ``group`` calls it): raise
    ``RuntimeError`` on every rank of ``group``, naming ``who``, where some rank loaded
    optimizer state that is not its own or holds parameters other than those saved
    with it: ``loaded`` is ``(foreign, the saved parameters' digest, their count)`` as
    the load found them, compared with the :func:`tensors_digest` of the first
    ``count`` of ``params`` (groups added since the load are not the checkpoint's).
    One small all-reduce over ``group``'s host side (its device where it has none)."""
    foreign, saved, count = loaded
    if _any_rank(foreign or saved != tensors_digest(params[:count]), group):
        raise RuntimeError(_FOREIGN.format(who))


_FOREIGN = (
    "{}: some rank would resume from another rank's parameters or optimizer state (between averagings they differ by "
    "rank, and torch.distributed.checkpoint keeps one copy of each key); nothing was stepped (the state loaded last, "
    "or the parameters, are not those this rank saved them with: load this rank's own checkpoint). Checkpoint per "
    "rank instead: each rank torch.save-s its model's and this optimizer's state_dict() to a file of its own."
)


def _any_rank(flag: bool, group: dist.ProcessGroup) -> bool:
    """Whether ``flag`` holds on some rank of ``group`` (each of its ranks calls it)."""
    over, device = exchange(group)
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=over)
    return bool(value.item())


def tensors_digest(tensors: Sequence[torch.Tensor]) -> str:
    """A digest of the tensors' bytes, in order (hex): what a rank records of its own
    state when it saves, for :func:`check_loaded_own`."""
    digest_ = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        digest_.update(_bytes(tensor))
    return digest_.hexdigest()


def value_digest(tensor: torch.Tensor) -> int:
    """A 64-bit digest of ``tensor``'s bytes, hashed on the host: equal values, equal digests."""
    return int.from_bytes(hashlib.blake2b(_bytes(tensor), digest_size=8).digest(), "little", signed=True)


def _bytes(tensor: torch.Tensor) -> bytes:
    """``tensor``'s values as bytes, read on the host (0-dim too)."""
    return tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes()
