"""The checkpoints of :class:`~puredist.classic.ZeroRedundancyOptimizer`: the whole
state gathered on one rank (:func:`gathered_state`), saved in ``torch.optim``'s format
(:func:`packed_param_groups`), and at load each rank's share of it
(:func:`local_share`), every entry checked on every rank before anything changes.

This module must not change an optimizer: the class applies what these functions return.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
import torch.distributed as dist

from puredist._validation import BELOW, as_int, check
from puredist.classic._torch_state import check_loadable
from puredist.collectives import DistributedCollective
from puredist.zero_plan import ZeroPlan

NOT_CONSOLIDATED = (
    "Optimizer state has not been consolidated on this rank. Please call "
    "`consolidate_state_dict(to={rank})` on all ranks beforehand if you meant to save the global state."
)

_NOT_SETTINGS = ("params", "param_names")
"""Param-group keys that list parameters: the local optimizer's hold this rank's only."""


def hyper_parameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in _NOT_SETTINGS}


def gathered_state(collective: DistributedCollective, plan: ZeroPlan, iteration: int, params: Sequence[torch.Tensor],
                   local_state: dict[torch.Tensor, Any], to: int) -> dict[int, Any] | None:
    """Every rank's entries of its local optimizer's state (``local_state``, keyed by
    parameter) gathered on rank ``to`` (a collective: every rank calls it): there the
    whole state by parameter index, in index order, its tensors on the CPU; ``None``
    on the other ranks.

    Raises:
        ValueError: ``to`` is not a rank of the group.
        RankMismatchError: ranks at other steps (or one stepping while another
            consolidates) would gather states of different sizes.
    """
    to = as_int(to)  # (numpy's ints too, as torch takes them)
    check("to", to, BELOW, stop=collective.world_size, where=" (a rank of the group)")
    collective.check_same_on_all_ranks(
        params, context=f"plan {plan.digest()} step {iteration} consolidate to {to}",
        what="ZeroRedundancyOptimizer.consolidate_state_dict",
    )
    local = {
        index: {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in local_state[params[index]].items()}
        for index in plan.owned_by(collective.rank)
        if params[index] in local_state
    }
    group = collective.process_group
    gathered = [None] * collective.world_size if collective.rank == to else None
    dist.gather_object(local, gathered, dst=dist.get_global_rank(group, to), group=group)
    if collective.rank != to:
        return None
    merged = {index: entry for part in gathered for index, entry in part.items()}
    return dict(sorted(merged.items()))


def packed_param_groups(param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``param_groups`` as ``torch.optim`` saves them: each group's settings as
    they are now, its parameters as their indices in ``params`` order."""
    packed_groups, start = [], 0
    for group_dict in param_groups:
        count = len(group_dict["params"])
        settings = {k: v for k, v in group_dict.items() if k != "params"}  # param_names kept
        packed_groups.append({**settings, "params": list(range(start, start + count))})
        start += count
    return packed_groups


def local_share(state_dict: dict[str, Any], param_groups: Sequence[dict[str, Any]], owned: Sequence[int],
                optimizer_class: type) -> tuple[dict[int, Any], list[dict[str, Any]]]:
    """``(state, param_groups)`` that this rank's local optimizer loads from the
    whole-optimizer ``state_dict``: the saved entries of the parameters it ``owned``
    (indices into ``param_groups``' parameters), renumbered as its own and copied (no
    tensor shared with ``state_dict``), and each group's saved settings.

    Raises:
        ValueError: ``state_dict`` cannot be loaded (``puredist.classic._torch_state.check_loadable``:
            its groups, and every saved entry, owned or not, so every rank decides alike).
    """
    check_loadable(state_dict, param_groups, optimizer_class)
    saved_groups = state_dict["param_groups"]
    saved_ids = [pid for saved in saved_groups for pid in saved["params"]]
    group_of = [g for g, group in enumerate(param_groups) for _ in group["params"]]
    local_state, local_groups, next_id = {}, [], 0
    for g, saved in enumerate(saved_groups):
        in_group = [i for i in owned if group_of[i] == g]
        local_ids = list(range(next_id, next_id + len(in_group)))
        next_id += len(in_group)
        for local_id, index in zip(local_ids, in_group):
            if state_dict["state"].get(saved_ids[index]):
                local_state[local_id] = copy.deepcopy(state_dict["state"][saved_ids[index]])
        local_groups.append({**hyper_parameters(saved), "params": local_ids})
    return local_state, local_groups
