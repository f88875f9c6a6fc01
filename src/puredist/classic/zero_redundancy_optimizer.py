"""Drop-in for ``torch.distributed.optim.ZeroRedundancyOptimizer``.

As in torch, each rank runs a real local optimizer, ``zero.optim`` (an instance of
``optimizer_class``), over the parameters it owns, and the owners broadcast the new
values. What is puredist's: the ownership plan (:func:`~puredist.zero_plan.plan_zero`,
largest first, fixed at construction: no lazy initialization, so the first ``step()``
already updates and ``load_state_dict()`` works before it), the staged broadcasts
(a receiver's parameter holds its old value or the owner's, never a partial one), the
rank checks (:class:`~puredist.RankMismatchError` instead of a hang), and, with
``overlap_with_ddp``, a step that runs inside DDP's backward on Gloo too
(:mod:`puredist.classic.ddp_zero_hook`).

Differences on purpose: parameters of several dtypes are accepted (torch refuses
them); parameters on several devices are refused (one device per optimizer);
``parameters_as_bucket_view`` is accepted and has no effect (parameters are updated
and broadcast in their own storage, never re-bound); ``load_state_dict`` checks every
entry on every rank before changing anything and never modifies its argument.
"""

from __future__ import annotations

import copy
import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from puredist._validation import check
from puredist.classic._zero_arguments import (  # noqa: F401 (OVERLAP_OPTIMIZERS: importable from here, as it was)
    BUILT,
    ONE_GROUP,
    OVERLAP_OPTIMIZERS,
    check_dense_on_one_device,
    listed_params,
    local_optimizer,
)
from puredist.classic._zero_state_dict import (
    NOT_CONSOLIDATED,
    gathered_state,
    hyper_parameters,
    local_share,
    packed_param_groups,
)
from puredist.collectives import CollectiveHandle, DistributedCollective
from puredist.zero_plan import ZeroPlan, plan_zero
from puredist.zero_step import broadcast_from_owners_, wait_for_owners

__all__ = ["ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)


def _sync_param_groups(source: Sequence[dict[str, Any]], target: Sequence[dict[str, Any]]) -> None:
    """Copy every setting (all but the parameter lists) from each group of
    ``source`` to ``target``'s."""
    for source_group, target_group in zip(source, target, strict=True):
        target_group.update(hyper_parameters(source_group))


@contextmanager
def _gradients(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> Iterator[None]:
    """Give ``params`` the ``.grad`` ``grads`` for the duration; restore the old ones."""
    saved = [p.grad for p in params]
    try:
        for p, g in zip(params, grads):
            p.grad = g
        yield
    finally:
        for p, g in zip(params, saved):
            p.grad = g


class _ZeroJoinHook(JoinHook):
    """A joined rank shadows the others' steps: it steps its own shard with the
    gradients it holds and takes part in the broadcasts."""

    def __init__(self, zero: "ZeroRedundancyOptimizer") -> None:
        self.zero = zero

    def main_hook(self) -> None:
        self.zero._synchronized_step()  # no notify: this rank has joined


class ZeroRedundancyOptimizer(torch.optim.Optimizer, Joinable):
    """Shards an optimizer's state across the ranks of ``process_group`` (ZeRO-1).

    Args:
        params: parameters or param-group dicts (one group only with
            ``overlap_with_ddp``).
        optimizer_class: what builds the local optimizer from param groups and the
            keyword arguments: a ``torch.optim.Optimizer`` subclass (custom ones
            included) or e.g. ``functools.partial`` of one; with
            ``overlap_with_ddp`` one of ``OVERLAP_OPTIMIZERS``.
        process_group: the group to shard over (``None``: WORLD).
        parameters_as_bucket_view: accepted for compatibility; no effect.
        overlap_with_ddp: the step runs inside DDP's backward through
            :func:`~puredist.classic.hook_with_zero_step` (or its interleaved
            variant); :meth:`step` then does nothing.
        **defaults: the local optimizer's arguments (``lr=...``), passed to
            ``optimizer_class`` as they are.

    Attributes:
        optim: this rank's local optimizer, an ``optimizer_class`` over the
            parameters this rank owns (one param group per group of this optimizer,
            possibly empty); its ``state`` is this rank's shard of the state.
        plan: the :class:`~puredist.zero_plan.ZeroPlan` (who owns which parameter,
            in the order of ``param_groups``).
        process_group, rank, world_size, global_rank, initialized: as torch's
            (``rank`` within ``process_group``, ``global_rank`` in the default group).

    Raises:
        TypeError: ``params`` is a tensor or not iterable, or holds something
            other than tensors or dicts; ``optimizer_class`` does not build an
            optimizer; a keyword argument ``optimizer_class`` does not take.
        ValueError: ``params`` empty or sparse, or a param group without
            ``"params"``; parameters on several devices; ``optimizer_class`` not
            supported with ``overlap_with_ddp`` (or torch's functional form of an
            optimizer without it); several param groups with ``overlap_with_ddp``;
            bad hyper-parameters (as ``optimizer_class`` raises them).
        RankMismatchError: ranks hold different parameter layouts (every rank).
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer],
        process_group: Any | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        **defaults: Any,
    ):
        params = listed_params(params)
        optimizer_class, defaults = local_optimizer(optimizer_class, overlap_with_ddp, defaults)
        self._optimizer_class = optimizer_class
        self._overlap_with_ddp = overlap_with_ddp
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._collective = DistributedCollective(process_group)
        self.process_group = self._collective.process_group
        self.optim: torch.optim.Optimizer | None = None
        self._plan: ZeroPlan | None = None
        self._iteration = 0
        self._consolidated: dict[int, Any] | None = None  # the whole state, by index (on ``to``)
        self._consolidation_error: Exception | None = None
        self._pristine = True  # no step taken and no state loaded: the plan may still change
        self.initialized = False  # (torch's flag: set once built)
        super().__init__(params, defaults)
        Joinable.__init__(self)
        check("param_groups", len(self.param_groups), ONE_GROUP, overlap=overlap_with_ddp)
        check_dense_on_one_device(self._all_params, "params")
        self._adopt_plan(plan_zero([p.numel() for p in self._all_params], self._collective.world_size))
        self.initialized = True

    # -- ownership ----------------------------------------------------------------

    @property
    def _all_params(self) -> list[torch.Tensor]:
        """Every parameter, in group order (torch's name: its own tests read it)."""
        return [p for group in self.param_groups for p in group["params"]]

    def _group_of(self) -> list[int]:
        return [g for g, group in enumerate(self.param_groups) for _ in group["params"]]

    @property
    def rank(self) -> int:
        """This process's rank in ``process_group``."""
        return self._collective.rank

    @property
    def world_size(self) -> int:
        """The size of ``process_group``."""
        return self._collective.world_size

    @property
    def global_rank(self) -> int:
        """This process's rank in the default group."""
        return dist.get_global_rank(self.process_group, self.rank)

    @property
    def plan(self) -> ZeroPlan:
        """Who owns (steps, and keeps the state of) which parameter."""
        return self._plan

    def _owned(self, plan: ZeroPlan, group: int) -> list[torch.Tensor]:
        params, group_of = self._all_params, self._group_of()
        return [params[i] for i in plan.owned_by(self.rank) if group_of[i] == group]

    def _adopt_plan(self, plan: ZeroPlan) -> None:
        """Shard by ``plan`` from now on, with a fresh local optimizer; only before
        any step or load."""
        if not self._pristine:
            raise RuntimeError(
                "The ZeRO plan can only change before the first step and before load_state_dict(); "
                "register the ZeRO hook right after building the optimizer and DDP."
            )
        local_groups = [
            {**hyper_parameters(group), "params": self._owned(plan, g)} for g, group in enumerate(self.param_groups)
        ]
        optim = self._optimizer_class(local_groups, **self.defaults)
        check("optim", optim, BUILT, name=getattr(self._optimizer_class, "__name__", repr(self._optimizer_class)))
        self._collective.check_same_on_all_ranks(
            self._all_params, context=plan.digest(), what="ZeroRedundancyOptimizer's plan"
        )
        self._plan, self.optim = plan, optim
        _sync_param_groups(optim.param_groups, self.param_groups)

    # -- stepping -----------------------------------------------------------------

    def _local_step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Step ``optim`` with this optimizer's current settings (so LR schedulers
        work) and copy back whatever settings its step changed."""
        self._pristine = False
        _sync_param_groups(self.param_groups, self.optim.param_groups)
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure=closure, **kwargs)
        _sync_param_groups(self.optim.param_groups, self.param_groups)
        return loss

    def _step_(self, grads: Sequence[torch.Tensor | None], indices: Iterable[int]) -> CollectiveHandle:
        """Step the owned parameters among ``indices`` with ``grads`` (aligned with
        all parameters) and start the owners' broadcasts of all of ``indices``. The
        overlap's one param group holds only those parameters for the step, so that
        a bucket's step costs its own parameters, not all this rank owns (every
        optimizer the overlap takes steps each parameter alone)."""
        self._pristine = False  # on every rank, also one owning none of these (the plan is fixed from now)
        params, owners, indices = self._all_params, self._plan.owners, list(indices)
        rank = self.rank
        mine = [i for i in sorted(indices) if owners[i] == rank]  # (no generator: no Python call per parameter)
        if not mine:
            return broadcast_from_owners_(params, indices, self._plan, self._collective)
        group = self.optim.param_groups[0]
        everything, group["params"] = group["params"], [params[i] for i in mine]
        try:
            with _gradients(group["params"], [grads[i] for i in mine]):
                self._local_step()
        finally:
            group["params"] = everything
        return broadcast_from_owners_(params, indices, self._plan, self._collective)

    def _end_iteration(self) -> None:
        self._iteration += 1

    # -- torch.optim.Optimizer API ----------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; its parameters are planned around the current loads
        (existing ownership and state stay), and the local optimizer gains the
        group with the ones this rank owns."""
        if self.optim is not None and self._overlap_with_ddp:  # (torch's type)
            raise RuntimeError("ZeroRedundancyOptimizer with `overlap_with_ddp=True` only supports a single parameter group")
        super().add_param_group(param_group)
        if self.optim is None:
            return  # still in __init__: the plan comes once every group is in
        try:  # as the parameters given when built (before any rank steps a parameter it cannot broadcast)
            check_dense_on_one_device(self._all_params, "param_group")
        except ValueError:
            self.param_groups.pop()
            raise
        plan, sizes = self._plan, [p.numel() for p in self._all_params]
        old = len(plan.owners)
        extension = plan_zero(sizes[old:], plan.world_size, start_loads=plan.loads(sizes[:old]))
        self._plan = ZeroPlan(plan.world_size, plan.owners + extension.owners)
        group = self.param_groups[-1]
        self.optim.add_param_group({**hyper_parameters(group), "params": self._owned(self._plan, len(self.param_groups) - 1)})
        _sync_param_groups(self.optim.param_groups[-1:], self.param_groups[-1:])

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Step the owned parameters (``optim.step(closure, **kwargs)``) and
        broadcast every parameter from its owner.

        Returns:
            The local optimizer's return value (the closure's loss), or ``None``.
            With ``overlap_with_ddp`` nothing happens (the step runs in DDP's
            backward), as in torch.

        Raises:
            RankMismatchError: ranks differ in parameters or in iteration (every rank).
        """
        if self._overlap_with_ddp:
            logger.warning("`step()` should not be included in the training loop when `overlap_with_ddp=True`")
            return None
        Join.notify_join_context(self)
        return self._synchronized_step(closure, **kwargs)

    def _synchronized_step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """:meth:`step` after the Join notification (what a joined rank shadows)."""
        params = self._all_params
        self._collective.check_same_on_all_ranks(
            params, context=f"plan {self._plan.digest()} step {self._iteration}", what="ZeroRedundancyOptimizer.step"
        )
        loss = self._local_step(closure, **kwargs)
        everything = range(len(params))
        handle = broadcast_from_owners_(params, everything, self._plan, self._collective)
        wait_for_owners(handle, params, everything, self._plan, self.rank, "ZeroRedundancyOptimizer.step")
        self._end_iteration()
        return loss

    # -- Join -------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook with which a rank out of inputs shadows the others' steps
        (inside ``torch.distributed.algorithms.join.Join``); its gradients must be
        set, as in torch. Takes no keyword arguments.

        Raises:
            ValueError: with ``overlap_with_ddp`` (DDP's join hook then runs the
                communication hook outside any backward pass).
        """
        if self._overlap_with_ddp:
            raise ValueError(
                "Join is not supported with `overlap_with_ddp=True`: DDP's join hook runs the ZeRO hook "
                "outside a backward pass. Use the non-overlapped ZeroRedundancyOptimizer for uneven inputs."
            )
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """The parameters' device."""
        return self._all_params[0].device

    @property
    def join_process_group(self) -> Any:
        """The group the state is sharded over."""
        return self.process_group

    # -- checkpoints ------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on rank ``to`` (a collective: every rank
        calls it); afterwards :meth:`state_dict` works on ``to``. If it fails (a peer
        is gone), the previous consolidation is dropped too: :meth:`state_dict` then
        says that this one failed instead of returning a stale state."""
        self._consolidated, self._consolidation_error = None, None
        try:
            self._consolidated = gathered_state(
                self._collective, self._plan, self._iteration, self._all_params, self.optim.state, to
            )
        except Exception as error:
            self._consolidation_error = error
            raise

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state in ``torch.optim`` format (loadable into the
        non-sharded ``optimizer_class``): the state as consolidated, the param groups'
        settings as they are now (as torch's), through the hooks of
        ``register_state_dict_pre_hook``/``register_state_dict_post_hook``.

        Raises:
            RuntimeError: :meth:`consolidate_state_dict` was not called (on all
                ranks, with ``to`` this rank), or its last call failed.
        """
        if self._consolidation_error is not None:
            raise RuntimeError(
                f"The last consolidate_state_dict() failed ({type(self._consolidation_error).__name__}: "
                f"{self._consolidation_error}); there is no current state to return. Call it again on every rank."
            ) from self._consolidation_error
        if self._consolidated is None:
            raise RuntimeError(NOT_CONSOLIDATED.format(rank=self.rank))
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():  # torch.optim's hooks, as torch's class runs them
            pre_hook(self)
        # (a hook may change the dict it is given: not the consolidation)
        state_dict = {"state": dict(self._consolidated), "param_groups": packed_param_groups(self.param_groups)}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            returned = post_hook(self, state_dict)
            state_dict = state_dict if returned is None else returned
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole-optimizer state dict (from :meth:`state_dict`, or from the
        non-sharded ``optimizer_class``); each rank's ``optim`` loads a copy of its
        own share (``optim.load_state_dict``: state follows each parameter's device
        and dtype), through the hooks of ``register_load_state_dict_pre_hook``/
        ``register_load_state_dict_post_hook``. Never shares a tensor with
        ``state_dict`` (torch's does, so two optimizers loaded from one dict update
        the same state).

        Raises:
            ValueError: the groups differ in number or size from this optimizer's; a
                saved parameter state of one of torch's optimizers has fields of
                another (e.g. SGD's ``momentum_buffer`` for Adam) or another shape
                than its parameter. Every entry is checked on every rank (so all
                ranks raise alike) before anything changes: a failed load leaves
                the optimizer as it was.
        """
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():  # torch.optim's hooks, as torch's class
            returned = pre_hook(self, state_dict)
            state_dict = state_dict if returned is None else returned
        local_state, local_groups = local_share(
            state_dict, self.param_groups, self._plan.owned_by(self.rank), self._optimizer_class
        )
        self.optim.load_state_dict({"state": local_state, "param_groups": copy.deepcopy(local_groups)})
        _sync_param_groups(copy.deepcopy(state_dict["param_groups"]), self.param_groups)
        self._pristine = False
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
