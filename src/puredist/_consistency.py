"""Detect, on every rank at once, that ranks are about to reduce different tensors.

torch's ``get_params_to_average`` keeps parameters whose ``.grad`` is set, which is a
rank-local fact: two ranks may then pass lists of different lengths or shapes to one
all-reduce, which hangs or averages unrelated values. Before reducing, every rank
contributes a 3-number summary of its list (count, total elements, digest of the
devices, dtypes, shapes and contiguity) to one small ``all_gather``; every rank sees every
summary, so either all ranks proceed or all raise the same error.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch
import torch.distributed as dist


class RankMismatchError(RuntimeError):
    """Ranks of one process group passed different tensor lists to one collective."""


def _signature(tensors: Sequence[torch.Tensor], context: str) -> torch.Tensor:
    # everything the bucket plan depends on: a difference would desynchronize the collectives
    text = context + "|" + ";".join(
        f"{t.device.type},{t.dtype},{tuple(t.shape)},{t.is_contiguous()}" for t in tensors
    )
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)
    return torch.tensor([len(tensors), sum(t.numel() for t in tensors), digest], dtype=torch.int64)


def _describe(rank: int, summary: list[int]) -> str:
    count, numel, digest = summary
    return f"rank {rank}: {count} tensors, {numel} elements, layout digest {digest & 0xFFFFFFFF:08x}"


def check_same_tensors_on_all_ranks(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    device: torch.device,
    *,
    context: str = "",
    what: str = "one averaging all-reduce",
) -> None:
    """Raise :class:`RankMismatchError` on every rank unless all ranks of ``group``
    hold tensors of the same count, device types, dtypes, shapes and contiguity, in order, and
    the same ``context`` string.

    Args:
        tensors: this rank's tensors.
        group: the process group about to use them (this rank is a member).
        device: where the backend wants the summary tensor (CPU for Gloo).
        context: more that must agree (e.g. a ZeRO plan's digest); part of the digest.
        what: the operation, for the message.

    Raises:
        RankMismatchError: on every rank, listing each rank's summary.
    """
    local = _signature(tensors, context).to(device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    summaries = [t.tolist() for t in gathered]
    if any(summary != summaries[0] for summary in summaries):
        ranks = dist.get_process_group_ranks(group)
        lines = "\n  ".join(_describe(rank, s) for rank, s in zip(ranks, summaries))
        raise RankMismatchError(
            f"Ranks passed different tensors (or plans) to {what} (a parameter without "
            ".grad on some ranks only is the usual cause); nothing was changed. "
            f"Per rank:\n  {lines}"
        )
