"""``DistributedCollective.mean`` as a differentiable function: the adjoint of a mean
over a group is the mean of the gradients over the same group.

This module must not be used under ``torch.func.vmap`` (each process is one rank):
its ``vmap`` rule raises and names :class:`~puredist.VmapCollective`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from puredist._inputs import checked_like

if TYPE_CHECKING:
    from puredist.collectives import DistributedCollective


class AllReduceMean(torch.autograd.Function):
    """``DistributedCollective.mean`` as a differentiable function: forward averages
    copies of the inputs, backward averages the incoming gradients over the same
    group (every rank runs the backward, as every rank ran the forward)."""

    @staticmethod
    def forward(collective: "DistributedCollective", group_size: int | None, context: str, *tensors: torch.Tensor):
        copies = [t.detach().clone() for t in tensors]
        collective.mean_(checked_like(tensors, copies, why="clone"), group_size=group_size, context=context)
        return tuple(copies)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.collective, ctx.group_size, ctx.context = inputs[:3]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        # the function again (under torch.func its forward sees plain tensors): and
        # so differentiable twice
        means = AllReduceMean.apply(ctx.collective, ctx.group_size, f"backward of {ctx.context}", *grads)
        return (None, None, None, *means)

    @staticmethod
    def vmap(info, in_dims, *args):
        raise ValueError(
            "A DistributedCollective cannot average inside torch.func.vmap (each process is one rank); "
            "for simulated ranks mapped by vmap use puredist.VmapCollective(num_replicas)."
        )
