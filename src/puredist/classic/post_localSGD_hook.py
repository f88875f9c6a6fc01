"""Drop-in for ``torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook``.

Same behaviour as torch's hook; :class:`PostLocalSGDState` gains
``state_dict()``/``load_state_dict()`` so that its iteration counter (which decides
between global and local gradient all-reduce) survives a restart.

This module must not average parameters: it reduces DDP's gradient buckets only (the
parameters are the averager's).
"""


# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.
import logging
from typing import Any

import torch
import torch.distributed as dist

from puredist._validation import INTRA_MACHINE_GROUP, check

__all__ = ["PostLocalSGDState", "post_localSGD_hook"]

logger = logging.getLogger(__name__)


class PostLocalSGDState:
    """State of ``post_localSGD_hook``: all-reduce gradients over
    ``process_group`` until iteration ``start_localSGD_iter``, then over
    ``subgroup`` (``None``: the intra-machine groups of ``torch.cuda.device_count()``
    ranks, created on first use, as torch does, which needs CUDA).

    Args:
        process_group: the global group (``None``: WORLD).
        subgroup: the local group after the switch; on CPU (Gloo), one made on every
            rank, e.g. ``dist.new_subgroups(group_size=ranks_per_machine)[0]``.
        start_localSGD_iter: the iteration at which local SGD starts.
        post_local_gradient_allreduce: whether gradients are still all-reduced
            within ``subgroup`` after the switch.
    """

    __slots__ = [
        "process_group",
        "subgroup",
        "start_localSGD_iter",
        "post_local_gradient_allreduce",
        "iter",
    ]

    def __init__(self, process_group, subgroup, start_localSGD_iter, post_local_gradient_allreduce=True):
        logger.info("Local SGD will be started after %s iterations", start_localSGD_iter)
        self.process_group = process_group
        self.subgroup = subgroup
        self.start_localSGD_iter = start_localSGD_iter
        self.post_local_gradient_allreduce = post_local_gradient_allreduce
        self.iter = 0

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Count an iteration when the last bucket of the backward is seen."""
        if bucket.is_last():
            self.iter += 1
        if self.iter == self.start_localSGD_iter:
            logger.info("Start to apply local SGD after %s iterations.", self.iter)

    def state_dict(self) -> dict[str, Any]:
        """``{"iter": int}``: the counter that decides global vs local all-reduce."""
        return {"iter": self.iter}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the counter saved by :meth:`state_dict`."""
        self.iter = int(state_dict["iter"])


def _allreduce_mean_future(group: dist.ProcessGroup, tensor: torch.Tensor) -> torch.futures.Future:
    # divide first, as torch's hook does: a sum of fp16 gradients could overflow
    tensor.div_(dist.get_world_size(group))
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def post_localSGD_hook(state: PostLocalSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook for post-local SGD.

    Before ``state.start_localSGD_iter`` iterations it averages the gradient bucket
    over the global group (as plain DDP); afterwards over ``state.subgroup``, or not
    at all when ``post_local_gradient_allreduce`` is false. Combine it with a
    periodic averager after the optimizer step.

    Returns:
        A future resolving to the (averaged) bucket buffer.
    """
    global_group = state.process_group if state.process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    if state.iter < state.start_localSGD_iter:
        state.maybe_increase_iter(bucket)
        return _allreduce_mean_future(global_group, buffer)
    if not state.post_local_gradient_allreduce:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buffer)
        return fut
    if state.subgroup is None:
        check("subgroup", state.subgroup, INTRA_MACHINE_GROUP, cuda=torch.cuda.is_available())
        state.subgroup, _ = dist.new_subgroups()
    return _allreduce_mean_future(state.subgroup, buffer)
