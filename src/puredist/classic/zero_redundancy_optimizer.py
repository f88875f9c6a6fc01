"""Drop-in for ``torch.distributed.optim.ZeroRedundancyOptimizer``.

The optimizer state is sharded by a :class:`~puredist.sharding.ZeroPlan` computed
at construction (no lazy initialization: the first ``step()`` already updates, and
``load_state_dict()`` works before it), and every step is the pure core's
:func:`~puredist.zero.zero` ``update_subset_``. Supported local optimizers: the
``torch.optim`` classes with a functional twin in :mod:`puredist.optim` (SGD, Adam,
AdamW); the math is torch's own kernels.

Differences on purpose: parameters on several devices are refused (one device per
optimizer); ``parameters_as_bucket_view`` is accepted and has no effect (parameters
are updated and broadcast in their own storage, never re-bound); ``state_dict()``
after ``consolidate_state_dict()`` is the plain ``torch.optim`` format of the whole
optimizer, loadable into the non-sharded ``optimizer_class``.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from puredist.collectives import CollectiveHandle, DistributedCollective
from puredist.optim import OPTIMIZERS, Optimizer
from puredist.sharding import ZeroPlan, plan_zero
from puredist.zero import ZeroState, zero

__all__ = ["ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)

_NOT_CONSOLIDATED = (
    "Optimizer state has not been consolidated on this rank. Please call "
    "`consolidate_state_dict(to)` on all ranks beforehand if you meant to save the global state."
)


_IMPLEMENTATION_ONLY = ("fused", "capturable", "differentiable")
"""torch.optim keywords accepted only when off: puredist runs torch's foreach or
single-tensor kernels, never the fused, capturable or differentiable ones."""


def _supported_names() -> str:
    return ", ".join(f"torch.optim.{cls.__name__}" for cls in OPTIMIZERS)


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """Shards an optimizer's state across the ranks of ``process_group`` (ZeRO-1).

    Args:
        params: parameters or param-group dicts (several groups unless
            ``overlap_with_ddp``).
        optimizer_class: ``torch.optim.SGD``, ``torch.optim.Adam`` or
            ``torch.optim.AdamW``.
        process_group: the group to shard over (``None``: WORLD).
        parameters_as_bucket_view: accepted for compatibility; no effect.
        overlap_with_ddp: the step runs inside DDP's backward through
            :func:`~puredist.classic.hook_with_zero_step` (or its interleaved
            variant); :meth:`step` then does nothing.
        **defaults: the local optimizer's hyper-parameters (``lr=...``).

    Raises:
        ValueError: unsupported ``optimizer_class`` (the message names the
            supported ones), several param groups with ``overlap_with_ddp``,
            parameters on several devices, bad hyper-parameters.
        TypeError: a keyword argument ``optimizer_class`` does not take.
        ValueError: ``fused``, ``capturable`` or ``differentiable`` switched on.
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
        if optimizer_class not in OPTIMIZERS:
            raise ValueError(
                f"Arg ``optimizer_class`` {getattr(optimizer_class, '__name__', optimizer_class)!r} is not "
                f"supported by puredist's ZeroRedundancyOptimizer; supported: {_supported_names()}."
            )
        self._factory = OPTIMIZERS[optimizer_class]
        self._factory_args = tuple(inspect.signature(self._factory).parameters)
        unknown = set(defaults) - set(self._factory_args) - set(_IMPLEMENTATION_ONLY)
        if unknown:
            raise TypeError(f"{optimizer_class.__name__} got unexpected keyword arguments {sorted(unknown)}.")
        unsupported = sorted(k for k in _IMPLEMENTATION_ONLY if defaults.pop(k, None))
        if unsupported:
            raise ValueError(
                f"puredist's ZeroRedundancyOptimizer does not support {unsupported} "
                f"(only their default, off); got {optimizer_class.__name__} with them on."
            )
        full_defaults = {
            name: parameter.default for name, parameter in inspect.signature(self._factory).parameters.items()
        }
        full_defaults.update(defaults)
        self._factory(**{k: full_defaults[k] for k in self._factory_args})  # validates
        self._optimizer_class = optimizer_class
        self._overlap_with_ddp = overlap_with_ddp
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._collective = DistributedCollective(process_group)
        self.process_group = self._collective.process_group
        self._zero_state: ZeroState | None = None
        self._consolidated: dict[str, Any] | None = None
        self._pristine = True  # no step taken and no state loaded: the plan may still change
        super().__init__(params, full_defaults)
        if overlap_with_ddp and len(self.param_groups) > 1:
            raise ValueError("ZeroRedundancyOptimizer with `overlap_with_ddp=True` only supports a single parameter group")
        devices = {p.device for p in self._params()}
        if len(devices) > 1:
            raise ValueError(f"Arg ``params`` must live on one device, got parameters on {sorted(map(str, devices))}.")
        sizes = [p.numel() for p in self._params()]
        self._adopt_plan(plan_zero(sizes, self._collective.world_size))

    # -- the pure core's view of this optimizer ---------------------------------

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _group_of(self) -> list[int]:
        return [g for g, group in enumerate(self.param_groups) for _ in group["params"]]

    def _optimizer_for(self, group: dict[str, Any]) -> Optimizer:
        return self._factory(**{k: group[k] for k in self._factory_args})

    def _fresh_states(self, indices: Iterable[int]) -> tuple:
        params, group_of = self._params(), self._group_of()
        return tuple(self._optimizer_for(self.param_groups[group_of[i]]).init([params[i]])[0] for i in indices)

    def _adopt_plan(self, plan: ZeroPlan) -> None:
        """Shard by ``plan`` from now on; only before any step or load."""
        if not self._pristine:
            raise RuntimeError(
                "The ZeRO plan can only change before the first step and before load_state_dict(); "
                "register the ZeRO hook right after building the optimizer and DDP."
            )
        self._collective.check_same_on_all_ranks(
            self._params(), context=plan.digest(), what="ZeroRedundancyOptimizer's plan"
        )
        self._zero_state = ZeroState(step=0, plan=plan, owned=self._fresh_states(plan.owned_by(self._rank)))

    @property
    def _rank(self) -> int:
        return self._collective.rank

    def _step_(self, grads: list[torch.Tensor | None], indices: Iterable[int]) -> CollectiveHandle:
        """Step the owned parameters among ``indices`` and start the owners'
        broadcasts of all of them; group by group, each with its current
        hyper-parameters (so LR schedulers work)."""
        self._pristine = False
        params, group_of, indices = self._params(), self._group_of(), list(indices)
        state, handles = self._zero_state, []
        for g, group in enumerate(self.param_groups):
            in_group = [i for i in indices if group_of[i] == g]
            if in_group:
                state, handle = zero(self._optimizer_for(group)).update_subset_(
                    params, grads, state, indices=in_group, collective=self._collective
                )
                handles.append(handle)
        self._zero_state = state
        return CollectiveHandle.merged(handles)

    def _end_iteration(self) -> None:
        self._zero_state = self._zero_state._replace(step=self._zero_state.step + 1)

    @property
    def zero_state(self) -> ZeroState:
        """This rank's pure-core state: plan and the owned parameters' states."""
        return self._zero_state

    # -- torch.optim.Optimizer API ----------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; its parameters are planned around the current loads
        (existing ownership and state stay)."""
        if self._zero_state is not None and self._overlap_with_ddp:
            raise ValueError("ZeroRedundancyOptimizer with `overlap_with_ddp=True` only supports a single parameter group")
        super().add_param_group(param_group)
        if self._zero_state is None:
            return  # still in __init__: the plan comes once every group is in
        plan = self._zero_state.plan
        sizes = [p.numel() for p in self._params()]
        old = len(plan.owners)
        extension = plan_zero(sizes[old:], plan.world_size, start_loads=plan.loads(sizes[:old]))
        new_plan = ZeroPlan(plan.world_size, plan.owners + extension.owners)
        mine = [old + i for i, owner in enumerate(extension.owners) if owner == self._rank]
        self._zero_state = self._zero_state._replace(plan=new_plan, owned=self._zero_state.owned + self._fresh_states(mine))

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Step the owned parameters with their ``.grad`` and broadcast the results.

        Returns:
            The closure's loss, or ``None``. With ``overlap_with_ddp`` nothing happens
            (the step runs in DDP's backward), as in torch.

        Raises:
            RankMismatchError: ranks differ in parameters or in which have a ``.grad``.
        """
        if self._overlap_with_ddp:
            logger.warning("`step()` should not be included in the training loop when `overlap_with_ddp=True`")
            return None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params()
        grads = [p.grad for p in params]
        has_grad = "".join("1" if g is not None else "0" for g in grads)
        self._collective.check_same_on_all_ranks(
            params,
            context=f"plan {self._zero_state.plan.digest()} step {self._zero_state.step} grads {has_grad}",
            what="ZeroRedundancyOptimizer.step",
        )
        self._step_(grads, range(len(params))).wait()
        self._end_iteration()
        return loss

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on rank ``to`` (a collective: every rank
        calls it); afterwards :meth:`state_dict` works on ``to``."""
        plan = self._zero_state.plan
        local = {
            index: {k: v.detach().cpu() for k, v in state._asdict().items() if v is not None}
            for index, state in zip(plan.owned_by(self._rank), self._zero_state.owned)
        }
        group = self.process_group
        gathered = [None] * self._collective.world_size if self._rank == to else None
        dist.gather_object(local, gathered, dst=dist.get_global_rank(group, to), group=group)
        if self._rank != to:
            self._consolidated = None
            return
        merged = {index: entry for part in gathered for index, entry in part.items()}
        packed_groups, start = [], 0
        for group_dict in self.param_groups:
            count = len(group_dict["params"])
            packed = {k: v for k, v in group_dict.items() if k != "params"}
            packed["params"] = list(range(start, start + count))
            packed_groups.append(packed)
            start += count
        self._consolidated = {"state": dict(sorted(merged.items())), "param_groups": packed_groups}

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state in ``torch.optim`` format, as consolidated.

        Raises:
            RuntimeError: :meth:`consolidate_state_dict` was not called (on all
                ranks, with ``to`` this rank) since the last step.
        """
        if self._consolidated is None:
            raise RuntimeError(_NOT_CONSOLIDATED)
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole-optimizer state dict (from :meth:`state_dict`, or from the
        non-sharded ``optimizer_class``); each rank keeps its own share.

        Raises:
            ValueError: the groups differ in number or size from this optimizer's; a
                saved parameter state has fields of another optimizer (e.g. SGD's
                ``momentum_buffer`` for Adam) or another shape than its parameter.
                Every entry is checked on every rank (so all ranks raise alike)
                before anything changes: a failed load leaves the optimizer as it was.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of optimizer's group")
        saved_ids = [pid for saved in saved_groups for pid in saved["params"]]
        params, plan = self._params(), self._zero_state.plan
        for index in range(len(params)):  # every entry, owned or not: every rank decides alike
            (fresh,) = self._fresh_states([index])
            _check_saved_entry(state_dict["state"].get(saved_ids[index], {}), fresh, params[index], index, self._optimizer_class)
        mine = plan.owned_by(self._rank)
        fresh_states = self._fresh_states(mine)
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        owned = []
        for index, fresh in zip(mine, fresh_states):
            entry = state_dict["state"].get(saved_ids[index], {})
            param = params[index]
            owned.append(type(fresh)(**{
                field: _cast_like(entry[field], param, field) if field in entry else default
                for field, default in fresh._asdict().items()
            }))
        self._zero_state = self._zero_state._replace(owned=tuple(owned))
        self._pristine = False


def _check_saved_entry(entry: dict[str, Any], fresh, param: torch.Tensor, index: int, optimizer_class: type) -> None:
    """Raise ``ValueError`` unless ``entry`` is a state of ``optimizer_class`` for ``param``."""
    fields = fresh._asdict()
    unknown = sorted(set(entry) - set(fields))
    if unknown:
        raise ValueError(
            f"Arg ``state_dict``: the state of parameter {index} has {unknown}, which "
            f"{optimizer_class.__name__} does not keep ({sorted(fields)}): a checkpoint of another optimizer?"
        )
    for field, value in entry.items():
        if field != "step" and isinstance(value, torch.Tensor) and value.shape != param.shape:
            raise ValueError(
                f"Arg ``state_dict``: ``{field}`` of parameter {index} has shape {tuple(value.shape)}, "
                f"the parameter {tuple(param.shape)}."
            )


def _cast_like(value: torch.Tensor, param: torch.Tensor, field: str) -> torch.Tensor:
    """As ``torch.optim.Optimizer.load_state_dict``: state follows the parameter's
    device and (except Adam's ``step`` counter) dtype."""
    if field == "step":
        return value.detach().clone().to(dtype=torch.float32, device="cpu")
    return value.detach().to(dtype=param.dtype, device=param.device, copy=True)
