"""The mean over the replica groups of a torchft ``Manager``'s quorum, as a
:class:`~puredist.Collective`.

Each reduction (:meth:`ManagerCollective.mean_`, :meth:`ManagerCollective.check_replicated`,
:meth:`ManagerCollective.all_gather_rows` for compressed payloads) is one torchft
step: a new quorum (``start_quorum``: membership may change between reductions, a
replica that is behind heals from a peer), a rank check, the
all-reduce, and the replica groups' vote (``should_commit``). The tensors are written
only once the vote commits, so a replica that dies, a timeout or a vote against leave
every tensor as it was and raise :class:`~puredist.CollectiveError` (nothing
changed): the failure contract of :class:`~puredist.DistributedCollective`.

The mean is over the replicas that *contribute*: a replica that has just healed
(its tensors are stale) takes part in the all-reduce with zeros and is left out of
the divisor. How many contribute travels in the rank check, a small float64
all-reduce of ``[1, h1, h1**2, h2, h2**2, w]`` (``h1``, ``h2`` two 20-bit digests of
the layouts and the context, from every replica; ``w`` 1 for a contributor, 0 for a
healing one): the ``n`` replicas agree iff ``n * sum(h**2) == sum(h)**2`` for both
digests (equality in Cauchy-Schwarz), which every replica computes from the same sums, so all raise
:class:`~puredist.RankMismatchError` together, before the data travels.

This module must not decide what to do after a failure or a heal (that is the
caller's: :class:`puredist.ft.FaultTolerantOuter` for DiLoCo), nor create managers
(:mod:`puredist.ft.setup`).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator, Sequence

import torch
from torch.distributed import ReduceOp

from puredist._consistency import REFUSED, check_replica_sums, check_same_values
from puredist._inputs import checked, checked_for_reduction
from puredist._validation import Rule, check
from puredist.collectives.base import divides_first, group_size_rule
from puredist.errors import CollectiveError, HealFailed, Healed, RankMismatchError, nothing_changed
from puredist.staging import CollectiveHandle

__all__ = ["HealFailed", "Healed", "ManagerCollective"]

_DIGEST_BITS = 20
"""Each digest's width: ``c * h**2`` stays exact in float64 for up to 2**13 replicas."""


_WHOLE_QUORUM = group_size_rule(
    "be None: a torchft quorum averages over all its replicas; its size changes between reductions.")


_SYNCHRONOUS = Rule(  # (torchft keeps these attributes private: read, never written)
    lambda v, b: not (getattr(v, "_use_async_quorum", False) or getattr(v, "_init_sync", False)), ValueError,
    "Arg ``{arg}``: build it with use_async_quorum=False and init_sync=False (puredist.ft.replica_manager does): a "
    "replica must heal before its tensors are read, and a heal is known by the step it changes; got {value!r}.")

_PAYLOAD = Rule(lambda v, b: isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(t, torch.Tensor)
                                                                                for t in v),
                ValueError, "Arg ``{arg}`` must be a non-empty list of tensors (the payload), got {value!r}.")


def _digests(text: str) -> tuple[int, int]:
    """Two 20-bit digests of ``text``."""
    value = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    mask = (1 << _DIGEST_BITS) - 1
    return value & mask, (value >> _DIGEST_BITS) & mask


_MEMBER, _REPLAYING, _HEALED = "member", "replaying", "healed"
"""A replica's role in one reduction: it contributes (``_MEMBER``); it healed in this
quorum and replays its peers' reduction from their state, with zeros but checked
(``_REPLAYING``, after :class:`Healed`); it healed and its schedule is stale, so it
sends zeros unchecked and raises :class:`Healed` once the others are done
(``_HEALED``: a collective without ``restart_on_heal``)."""


def _healed(what: str) -> Healed:
    return Healed(
        f"{what}: this replica healed from a peer in this quorum (the manager's load_state_dict functions have "
        "run) and took part with zeros; its tensors were not written. Continue from the peers' state."
    )


def _raise_if_healed(role: str, what: str) -> None:
    if role == _HEALED:
        raise _healed(what)


@contextlib.contextmanager
def _heal_reported(role: str, what: str) -> Iterator[None]:
    """Where this replica healed in the quorum, a failure of the rest of the step (the
    rank check, the vote) still leaves it healed: raise :class:`Healed`, the failure as
    its cause, so that the caller goes on from the peers' state."""
    try:
        yield
    except (RankMismatchError, CollectiveError, ValueError) as error:
        if role == _HEALED:
            raise _healed(what) from error
        raise


class ManagerCollective:
    """Mean over the replica groups in a torchft ``Manager``'s quorum (see the module
    docstring).

    Args:
        manager: a ``torchft.manager.Manager`` built with ``use_async_quorum=False``
            (a replica heals inside ``start_quorum``, before its tensors are read) and
            ``init_sync=False`` (the initial parameters are checked, not copied: see
            :func:`puredist.ft.replica_manager`). Every process of a replica group
            passes the same tensors; the mean is over the groups.
        restart_on_heal: raise :class:`Healed` as soon as a quorum heals this
            replica, for the caller to replay the reduction from its peers' state
            (:class:`~puredist.ft.FaultTolerantOuter` does); without, the replica
            takes part with zeros and raises :class:`Healed` afterwards.

    Unlike :class:`~puredist.DistributedCollective`, it stages the whole call at
    once (memory: the tensors' size, one buffer per device and dtype) and always
    averages over the whole quorum (``group_sizes`` is ``(world_size,)``).
    """

    def __init__(self, manager, *, restart_on_heal: bool = False) -> None:
        check("manager", manager, _SYNCHRONOUS)
        self.manager = manager
        self.restart_on_heal = restart_on_heal
        self._open_role: str | None = None  # a heal left its quorum open: the next reduction's role in it
        self._world_size = 0
        self._heal_failure: HealFailed | None = None  # a heal whose state did not load: raised again at every call

    def abandon_replay(self) -> None:
        """After :class:`Healed`, where the replay will not run: leave the quorum the
        heal left open, so that no later reduction joins its peers' stale one."""
        self._open_role = None

    @property
    def world_size(self) -> int:
        """The replicas that contributed to the last committed reduction (0 before the first)."""
        return self._world_size

    @property
    def group_sizes(self) -> tuple[int, ...]:
        return (self._world_size,)

    @property
    def is_member(self) -> bool:
        return True

    def mean_(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        group_size: int | None = None,
        async_op: bool = False,
        context: str = "",
    ) -> CollectiveHandle | None:
        """Replace each tensor, in place, by its mean over the contributing replicas.

        Args:
            tensors: as :meth:`puredist.DistributedCollective.mean_`'s.
            group_size: ``None`` (the whole quorum; its size is known only once it
                forms).
            async_op: accepted for the protocol; the reduction completes before
                this returns, and the handle returned is complete.
            context: more that must be equal on every replica (schedule and step).

        Returns:
            ``None``, or a completed handle when ``async_op``.

        Raises:
            TypeError, ValueError: a tensor that cannot be averaged, a ``group_size``
                — before anything is communicated.
            Healed: the quorum healed this replica (see :class:`Healed`).
            HealFailed: it healed this replica, but a registered load function
                raised (or one did at an earlier reduction): nothing is changed.
            RankMismatchError: on every replica, when they pass different layouts or
                contexts; nothing is changed.
            CollectiveError: the quorum, the all-reduce or the vote failed; nothing is
                changed.
        """
        given = checked(tensors)
        check("group_size", group_size, _WHOLE_QUORUM, sizes=())
        what = "Averaging over a torchft quorum"
        self._reduce(given, given.reduced, what, f"{given.layout.summary(given)} {context}", write_back=True)
        return CollectiveHandle() if async_op else None

    def mean(
        self, tensors: Sequence[torch.Tensor], *, group_size: int | None = None, context: str = ""
    ) -> list[torch.Tensor]:
        """New tensors holding the means (see :meth:`mean_`); ``tensors`` are only
        read. Not recorded by autograd: a fault-tolerant synchronization runs
        eagerly."""
        checked_for_reduction(tensors, in_place=False)
        with torch.no_grad():
            copies = [t.detach().clone() for t in tensors]
        self.mean_(copies, group_size=group_size, context=context)
        return copies

    def check_replicated(self, tensors: Sequence[torch.Tensor], *, what: str, context: str = "") -> None:
        """Raise :class:`~puredist.RankMismatchError` on every replica unless every
        contributing replica holds the same values (a digest of each tensor's bytes,
        with ``context``, through the rank check's all-reduce).

        Raises:
            Healed, HealFailed, CollectiveError: as :meth:`mean_`.
        """
        check_same_values(checked(tensors), context,
                          compare=lambda given, agreed: self._reduce(given, [], what, agreed, write_back=False))

    def all_gather_rows(
        self, tensors: Sequence[torch.Tensor], *, context: str, refused: bool = False
    ) -> list[list[torch.Tensor]]:
        """One torchft step that gathers ``tensors`` (any dtypes, e.g. compressed
        payloads) from every contributing replica: their rows, in quorum order (this
        replica's among them unless it is healing). What
        :func:`puredist.compression.compressed_mean` runs over a quorum.

        ``refused``: this replica refuses the step (its values are not finite): it
        takes part in the rank check, which counts the refusals, and every replica
        raises ``ValueError`` and votes against, so that the step is not committed,
        even where a replica that refused is alone.

        Raises:
            Healed, HealFailed: as :meth:`mean_`.
            ValueError: on every replica, when some replica refused; nothing sent.
            RankMismatchError: on every replica, when they pass different shapes,
                dtypes or contexts.
            CollectiveError: the quorum, a gather or the vote failed.
        """
        from torch.distributed.distributed_c10d import AllgatherOptions
        from torchft.process_group import ManagedProcessGroup

        check("tensors", tensors, _PAYLOAD)
        tensors = [t.contiguous() for t in tensors]
        what = "A compressed averaging over a torchft quorum"
        role = self._start_quorum(tensors, what)
        device = tensors[0].device
        agreed = f"{[(tuple(t.shape), t.dtype) for t in tensors]} {context.split(REFUSED)[0]}"
        with _heal_reported(role, what):
            contributors = self._contributors(tensors, agreed, role, device, what, refused=refused)
            group = ManagedProcessGroup(self.manager)
            flag = torch.tensor([1.0 if role == _MEMBER else 0.0], device=device)
            gathered = []
            try:
                for tensor in (flag, *tensors):
                    outputs = [torch.empty_like(tensor) for _ in range(group.size())]
                    group.allgather([outputs], [tensor], AllgatherOptions()).wait()
                    gathered.append(outputs)
            except Exception as cause:  # noqa: BLE001 - recorded for the vote, which then refuses
                self.manager.report_error(cause)
            self._commit(tensors, what, "the gather")
        self._world_size = contributors
        _raise_if_healed(role, what)
        flags, *columns = gathered
        contributes = torch.cat(flags).tolist()  # (one host read)
        return [[column[r] for column in columns] for r, flag in enumerate(contributes) if flag == 1.0]

    def _reduce(self, given, reduced: list[torch.Tensor], what: str, agreed: str, *, write_back: bool) -> None:
        """One torchft step: quorum, rank check on ``agreed``, all-reduce of
        ``reduced``, vote; write the means back only if it commits."""
        role = self._start_quorum(given, what)
        device = given.reduced[0].device if given.reduced else torch.device("cpu")  # (the check's, too)
        with _heal_reported(role, what):
            contributors = self._contributors(given, agreed, role, device, what)
            groups: dict[tuple, list[int]] = {}
            for i, t in enumerate(reduced):
                groups.setdefault((t.device, t.dtype), []).append(i)
            buffers = []
            for indices in groups.values():
                parts = [reduced[i].detach().reshape(-1) for i in indices]  # (a model's parameters require grad)
                buffer = torch.zeros(sum(p.numel() for p in parts), dtype=parts[0].dtype, device=parts[0].device)
                if role == _MEMBER:
                    torch.cat(parts, out=buffer)
                    if divides_first(buffer.dtype):
                        buffer.div_(contributors)
                buffers.append(buffer)
            self._all_reduce(buffers)
            self._commit(given, what, "the data all-reduce")
        self._world_size = contributors
        _raise_if_healed(role, what)
        if not write_back:
            return
        for buffer, indices in zip(buffers, groups.values()):
            if not divides_first(buffer.dtype):
                buffer.div_(contributors)
            targets = [reduced[i] for i in indices]
            views = buffer.split([t.numel() for t in targets])
            with torch.no_grad():  # into the parameters' own storage, as DistributedCollective writes
                torch._foreach_copy_(targets, [v.view(t.shape) for v, t in zip(views, targets)])

    def _start_quorum(self, given, what: str) -> str:
        """Start this reduction's quorum (unless a heal left one open: the replay of
        its reduction); return this replica's role in it. Where the quorum heals it:
        with ``restart_on_heal`` raise :class:`Healed` at once, else take part as
        :data:`_HEALED`."""
        if self._heal_failure is not None:
            raise self._heal_failure.again()
        if self._open_role is not None:
            role, self._open_role = self._open_role, None
            return role
        before = self.manager.current_step()
        try:
            self.manager.start_quorum()
        except Exception as cause:  # noqa: BLE001 - the quorum's error (a timeout), or a heal's load
            if self.manager.current_step() != before:  # torchft healed this replica, then a load function raised
                self._heal_failure = HealFailed(
                    f"{what}: the quorum healed this replica from a peer (torchft step {before} -> "
                    f"{self.manager.current_step()}), but a load_state_dict function registered with the manager "
                    f"raised ({type(cause).__name__}: {cause}); the tensors passed were not written, state registered "
                    "before that function's may hold the peer's. This replica cannot rejoin with this manager: stop "
                    "it (manager.shutdown(), else the lighthouse holds its peers' quorums for it) and restart the "
                    "replica group."
                )
                raise self._heal_failure from cause
            # torchft's next start_quorum would re-raise this failed quorum's error for good: forget it
            self.manager._quorum_future = None
            raise nothing_changed(given, what, cause, stage="torchft's quorum") from cause
        if self.manager.current_step() == before:
            return _MEMBER
        # healed: the manager took a peer's step and state; with restart_on_heal the replay joins this quorum
        self._open_role = _REPLAYING if self.restart_on_heal else None
        if self.restart_on_heal:
            raise Healed(f"{what}: the quorum healed this replica from a peer at step {self.manager.current_step()}")
        return _HEALED

    def _contributors(self, given, agreed: str, role: str, device: torch.device, what: str, *,
                      refused: bool = False) -> int:
        """How many replicas contribute, once the rank check has passed: its rows
        exchanged, :func:`~puredist._consistency.check_replica_sums` (the verdict)
        refuses unless all that are checked (every role but :data:`_HEALED`, whose
        schedule is stale) agree on ``agreed`` and on their history: torchft's count of
        committed batches (a peer's, taken with its step in a heal). torchft's vote is
        per replica group, so some replicas may commit a step that others fail; where
        those redo it in a quorum of their own, both reach the same step with different
        tensors, and only this count tells them apart at their next common quorum.
        ``refused``: this replica refuses the step; where any does, every replica
        raises ``ValueError`` (after the vote against it)."""
        return check_replica_sums(self._summed_rows(given, agreed, role, device, what, refused),
                                  f"{what} at torchft step {self.manager.current_step()}",
                                  vote_against=self._vote_against)

    def _summed_rows(self, given, agreed: str, role: str, device: torch.device, what: str, refused: bool) -> list[int]:
        """The rank check's exchange: this replica's row ``[checked, h1, h1**2, h2,
        h2**2, contributes, refused]`` (the module docstring's; ``checked`` 0, and the
        digests with it, for a :data:`_HEALED` replica), summed over the quorum by one
        float64 all-reduce, read back as ints. Where torchft recorded a failure (a group
        setup or a heal's fetch before it, the all-reduce itself), every replica votes
        against the step and :meth:`_commit` raises."""
        h1, h2 = _digests(f"{agreed} | committed batches {self.manager.batches_committed()}")
        checked = 0.0 if role == _HEALED else 1.0
        row = torch.tensor([checked, checked * h1, checked * h1 * h1, checked * h2, checked * h2 * h2,
                            1.0 if role == _MEMBER else 0.0, float(refused)], dtype=torch.float64, device=device)
        if self.manager.errored() is not None:  # torchft records, not raises, a failed group setup or heal fetch
            self._commit(given, what, "torchft's quorum")  # votes against, and raises
        self._all_reduce([row])
        if self.manager.errored() is not None:
            self._commit(given, what, "the rank check")  # votes against, and raises
        return [int(v) for v in row.tolist()]

    def _all_reduce(self, buffers: list[torch.Tensor]) -> None:
        """Sum ``buffers`` over the quorum (a replica outside it sends zeros: torchft's
        own rule); torchft records a failure instead of raising it, for the vote."""
        try:
            works = [self.manager.allreduce(buffer, reduce_op=ReduceOp.SUM) for buffer in buffers]
            for work in works:
                work.wait()
        except Exception as cause:  # noqa: BLE001 - recorded for the vote, which then refuses
            self.manager.report_error(cause)

    def _vote_against(self, error: Exception) -> None:
        """Record ``error``, then vote (against the step: torchft refuses a step with an error recorded)."""
        self.manager.report_error(error)
        self._vote()

    def _vote(self) -> bool:
        try:
            return self.manager.should_commit()
        except Exception as cause:  # noqa: BLE001 - torchft's max_retries
            self.manager.report_error(cause)
            return False

    def _commit(self, given, what: str, stage: str) -> None:
        """Raise :class:`~puredist.CollectiveError` (nothing changed) unless the replica
        groups commit this step: failed in ``stage`` where this replica had recorded
        an error (which votes against), else in the vote (refused, or failed itself)."""
        recorded = self.manager.errored()
        if self._vote():
            return
        if recorded is None:
            stage = "the vote"
        error = self.manager.errored()
        cause = error.original_exception if error is not None else RuntimeError(
            "the replica groups voted not to commit (fewer replicas than min_replica_size, or an error elsewhere)"
        )
        raise nothing_changed(given, what, cause, stage=stage) from cause
