"""Fault-tolerant DiLoCo: an outer-optimization transform whose synchronizations run
over a torchft quorum (:class:`~puredist.ft.ManagerCollective`).

The transform is unchanged; this module adds what a replica group does around its
``update_``:

- it serves the state it passes in (step, global copy, outer state: the transform's
  ``state_dict``) to a peer that heals in that synchronization's quorum;
- where the quorum heals *this* replica (it restarted, or missed a commit), it takes
  the peer's state (``load_state_dict``, checked), writes the global copy into its
  parameters, and runs the same synchronization again from there, contributing
  zeros: it ends equal to its peers, bit for bit;
- where a synchronization fails (a replica died in it, a timeout, a vote against),
  nothing was applied: it returns the state it was given, and the next ``update_``
  with it synchronizes again, over the quorum of then.

This module must not reduce tensors (the collective does) nor start processes.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch

from puredist._bound import options_of
from puredist._validation import INSTANCE, check
from puredist.averaging import _float_leaves
from puredist.errors import CollectiveError, HealFailed, Healed
from puredist.ft.collective import ManagerCollective
from puredist.outer.state import OuterState, OuterTransform
from puredist.outer.timeline import due_fragments
from puredist.tree import PyTree

__all__ = ["FaultTolerantOuter"]


class FaultTolerantOuter:
    """An outer-optimization transform's ``update_`` over a torchft ``Manager`` (see
    the module docstring).

    Args:
        transform: from :func:`puredist.outer_optimizer`, synchronous (``delay=0``),
            without lower levels, synchronizing nothing after the first inner step
            (then every ``update_`` runs at most one reduction: a healing replica
            joins its peers' first);
            with a compressor, the payloads are gathered (see
            :func:`puredist.compression.compressed_mean`) and a healed replica starts
            with zero residuals.
        manager: this replica group's ``torchft.manager.Manager``, as
            :func:`puredist.ft.replica_manager` builds it.
        key: the name its state is registered under with the manager.

    Attributes:
        collective: the :class:`~puredist.ft.ManagerCollective` it synchronizes over.
        failed: synchronizations that failed (nothing applied; each is run again).
        heals: times this replica took a peer's state.
        last_error: the last failure's error (``None``: none yet).
        heal_failure: the :class:`HealFailed` this replica raised (``None``: none).

    Raises:
        TypeError: ``transform`` is not from :func:`puredist.outer_optimizer`.
        ValueError: a transform with a delay, lower levels or a synchronization
            after the first inner step.
    """

    def __init__(self, transform: OuterTransform, manager, *, key: str = "puredist_outer") -> None:
        check("transform", transform, INSTANCE, kind=OuterTransform,
              a="an outer-optimization transform (puredist.outer_optimizer(...))")
        config = options_of(transform.update)
        if config.delay or config.lower_sizes or due_fragments(config, 1):
            raise ValueError(config.explain(
                "Arg ``transform``: a fault-tolerant synchronization runs synchronous and at one level "
                "(delay=0, no lower_levels), none after the first inner step (sync_every >= 2 with one fragment, "
                "warmup_steps other than 1): a delayed one carries per-rank snapshots that a healing peer cannot "
                "hand over, a quorum has no subgroups, and the first update_ both checks the initial copy and would "
                "synchronize, two reductions in one update_, where a replica healing at the second could not replay "
                "the first."
            ))
        self.transform = transform
        self.manager = manager
        self.collective = ManagerCollective(manager, restart_on_heal=True)
        self.failed = 0
        self.heals = 0
        self.last_error: BaseException | None = None
        self.heal_failure: HealFailed | None = None
        self._serving: OuterState | None = None
        self._received: dict[str, Any] | None = None
        self._resume: tuple[OuterState | None, OuterState | None] = (None, None)  # (stale state, healed state)
        manager.register_state_dict_fn(key, self._receive, self._serve)

    def _serve(self) -> dict[str, Any]:
        """What a healing peer receives: the state of the synchronization running."""
        if self._serving is None:
            raise RuntimeError("A peer asked for this replica's state before its first update_.")
        return self.transform.state_dict(self._serving, rank=0)

    def _receive(self, saved: dict[str, Any]) -> None:
        self._received = saved

    def update_(self, params: PyTree, state: OuterState) -> OuterState:
        """``transform.update_(params, state, collective=self.collective)``, tolerant of
        faults: returns the new state; where the synchronization failed, ``state``
        itself (nothing applied, ``failed`` counts it) or, where this replica healed
        in it, the peer's state it healed to; where this replica healed, the state
        its peers reach in this synchronization (and ``params`` hold its global copy,
        updated in place).

        A heal is never lost: where the synchronization run again after a heal raises
        (its peers refused it, or passed other contexts), the healed state is kept,
        and the next ``update_`` given the same ``state`` object as this one (the
        caller's, from before the heal) starts from the healed state instead.

        Raises:
            RankMismatchError: the replicas passed different layouts or contexts.
            ValueError, TypeError: as the transform's ``update_``.
            HealFailed: this replica healed but its peer's state did not load (the
                transform's checked load, or a load function registered with the
                manager, raised), or this one failed so before: the parameters and
                the transform's state were not written; torchft counts the heal as
                done (the manager took the peer's step), so this replica cannot
                rejoin: the manager is shut down (on the group's rank 0, which
                sends the group's heartbeat, that stops it, and the lighthouse no
                longer holds the peers' quorums for this group), and every
                later ``update_`` raises it again (a new error, the same message and
                cause), communicating nothing. Restart the replica group: a new
                manager heals anew. Its peers fail the one synchronization that
                waited for it and go on without it.
        """
        if self.heal_failure is not None:
            raise self.heal_failure.again()
        stale, healed_to = self._resume
        self._resume = (None, None)
        if state is stale:  # the last update_ healed, then raised: its caller still holds the state from before
            state = healed_to
        given = state
        self._serving = state
        while True:
            try:
                return self.transform.update_(params, state, collective=self.collective)
            except Healed:  # nothing applied: run the peers' synchronization from their state
                try:
                    state = self._healed(params, state)
                except Exception as cause:  # noqa: BLE001 - the load's error, kept as the cause
                    self._received = None
                    self.collective.abandon_replay()
                    self._retire(HealFailed(
                        f"This replica healed from a peer at torchft step {self.manager.current_step()}, but the "
                        f"peer's state did not load ({type(cause).__name__}: {cause}); the parameters and this "
                        "transform's state were not written (state registered with the manager under other keys "
                        "may hold the peer's). It cannot rejoin with this manager, which is shut down (its peers' "
                        "quorums no longer wait for it): restart the replica group."
                    ), cause)
            except HealFailed as failure:  # a load function registered with the manager raised in the quorum
                self._retire(failure, failure.__cause__)
            except CollectiveError as error:  # nothing applied
                self.failed += 1
                self.last_error = error
                return state
            except Exception:
                if state is not given:  # healed in this call: the manager is at its peers' step, and so is `state`
                    self._resume = (given, state)
                raise

    def _retire(self, failure: HealFailed, cause: BaseException | None) -> NoReturn:
        """Raise ``failure`` (caused by ``cause``), now and at every later ``update_``,
        with the manager shut down: it cannot rejoin, and while its group heartbeats
        (from its rank 0's manager) the lighthouse would hold its peers' quorums for
        it."""
        self.heal_failure = failure
        self.manager.shutdown(wait=False)
        raise failure from cause

    def _healed(self, params: PyTree, state: OuterState) -> OuterState:
        """The peer's state received in this quorum (checked against ``state``), its
        global copy written into ``params``; served from now on."""
        healed = self.transform.load_state_dict(state, self._received, rank=0)
        # a compressor's residuals are what the peer's own payloads lost: this replica starts without any
        # (zeroed where load_state_dict laid them out, flat or per leaf)
        if healed.residuals:
            torch._foreach_zero_(list(healed.residuals))
        self._received = None
        self.heals += 1
        leaves, _ = _float_leaves(params, in_place=True)
        with torch.no_grad():
            torch._foreach_copy_(list(leaves), list(healed.global_params))
        self._serving = healed
        return healed
