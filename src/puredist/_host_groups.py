"""Where a group's rank check runs: its own CPU backend, or a Gloo twin of its ranks.

The rank check (:mod:`puredist._consistency`) exchanges host tensors, so it never
waits for a GPU's queue to drain. A group whose backend serves CPU tensors (Gloo, MPI,
torch's default ``"cpu:gloo,cuda:nccl"``) runs it itself. For a device-only group
(NCCL) puredist creates a Gloo group of the same ranks, its *twin*, collectively: every
rank of the default group takes part, with the same rank lists in the same order. That
happens for the whole world (``DistributedCollective()``), for the subgroups
``with_subgroups`` makes of it and for the groups of a mesh ``from_mesh`` covers.
(torch's ``new_group(use_local_synchronization=True)`` would let a group's members
create one alone, but it names the group after how many groups each rank knows: ranks
that know different numbers would meet under different names and wait forever.) Any
other device-only group has no twin: its check gathers the summaries on the device and
reads them back, one host wait per check; to avoid that, initialize torch.distributed
with ``"cpu:gloo,cuda:nccl"`` (torch's default) so that every group has a CPU side.
"""

from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from puredist._group_memo import GroupMemo

_TWINS = GroupMemo()
"""sorted ranks -> this rank's twin (``None`` where this rank is not among the ranks)."""


def backends_by_device(group: dist.ProcessGroup) -> dict[str, str]:
    """``{device type: backend name}`` of ``group``: ``"cpu:gloo,cuda:nccl"`` maps each
    device to its own; a single name (``"nccl"``) stands for every device."""
    backend = dist.get_backend(group)
    if ":" in backend:
        return dict(part.split(":") for part in backend.split(","))
    return {"cpu": backend, "cuda": backend}


def averages_natively(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether the backend that reduces ``device``'s tensors in ``group`` has a native
    ``ReduceOp.AVG`` (NCCL)."""
    return backends_by_device(group).get(device.type) == "nccl"


def _serves_the_host(group: dist.ProcessGroup) -> bool:
    return backends_by_device(group).get("cpu") in ("gloo", "mpi")


def host_group(group: dist.ProcessGroup) -> "dist.ProcessGroup | None":
    """The group to run ``group``'s rank check over with CPU tensors: ``group`` itself,
    its twin, or ``None`` (no twin: the check gathers on the device)."""
    if _serves_the_host(group):
        return group
    return _TWINS.get(tuple(sorted(dist.get_process_group_ranks(group))))


def exchange(group: dist.ProcessGroup) -> tuple[dist.ProcessGroup, torch.device]:
    """The group and device ``group``'s rank check gathers over: its host group with
    CPU tensors, or (no twin) the group itself on its device."""
    host = host_group(group)
    if host is not None:
        return host, torch.device("cpu")
    return group, torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def make_twins(rank_lists: Sequence[Sequence[int]], like: dist.ProcessGroup) -> None:
    """Give the device-only groups of ``rank_lists`` (disjoint) Gloo twins, once per
    world, with the timeout of ``like`` (one of them). Collective: every rank of the
    default group calls it with the same lists in the same order (which lists already
    have twins is then the same on every rank)."""
    if _serves_the_host(like):
        return
    keys = [tuple(sorted(ranks)) for ranks in rank_lists]  # as torch lists a group's ranks
    fresh = [key for key in keys if key not in _TWINS]
    if not fresh:
        return
    mine, _ = dist.new_subgroups_by_enumeration([list(ranks) for ranks in fresh], timeout=_timeout(like), backend="gloo")
    rank = dist.get_rank()
    for ranks in fresh:
        _TWINS[ranks] = mine if rank in ranks else None


def _timeout(group: dist.ProcessGroup) -> "timedelta | None":
    """``group``'s own timeout, for its twin (else Gloo's default, 30 minutes, would
    hold a stalled check that long)."""
    try:  # no public accessor: the device backend's options
        return group._get_backend(torch.device("cuda")).options._timeout
    except Exception:  # noqa: BLE001 - another torch's layout: Gloo's default then
        return None
