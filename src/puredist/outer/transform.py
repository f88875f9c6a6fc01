"""The public entry: :func:`outer_optimizer` checks its options into an
:class:`~puredist.outer.config.OuterConfig` and returns the transform's functions
bound to it.

This module must not hold logic of its own: it binds the other modules' functions.
"""

from __future__ import annotations

from typing import Mapping

import torch

from puredist._bound import bound
from puredist.compression import Compressor
from puredist.optim import Optimizer
from puredist.outer import checkpoint, update
from puredist.outer.config import OuterConfig
from puredist.outer.state import OuterTransform, init_state


def outer_optimizer(
    outer: Optimizer,
    *,
    sync_every: int,
    warmup_steps: int = 0,
    delay: int = 0,
    fragments: int = 1,
    comm_dtype: torch.dtype | None = None,
    global_device: torch.device | str | None = None,
    global_dtype: torch.dtype | None = None,
    lower_levels: Mapping[int, int] | None = None,
    compressor: Compressor | None = None,
) -> OuterTransform:
    """Build the outer-optimization transform (see the module docstring).

    Args:
        outer: the outer optimizer, e.g. ``puredist.sgd(0.7, momentum=0.9, nesterov=True)``.
        sync_every: inner steps between two synchronizations of a fragment (``H``).
        warmup_steps: steps before fragment 0's first synchronization.
        delay: steps between starting and applying a synchronization, ``< sync_every``.
        fragments: how many staggered fragments, ``<= sync_every``.
        comm_dtype: dtype of the all-reduced pseudo-gradient (``None``: the global
            copy's).
        global_device: device of the global copy and outer state (``None``: the
            parameter's).
        global_dtype: dtype of the global copy and outer state (``None``: the
            parameter's); e.g. an fp32 master copy for bf16 parameters.
        lower_levels: ``{period: group_size}`` plain averaging below the outer step.
        compressor: average the pseudo-gradients with this compressor and error
            feedback (exclusive with ``comm_dtype``).

    Raises:
        ValueError, TypeError: bad options (named, with their value); at ``init``, more
            fragments than parameter leaves; at update, a lower-level group size the
            collective cannot average within.
    """
    config = OuterConfig(
        outer, sync_every, warmup_steps, delay, fragments, comm_dtype, global_device, global_dtype,
        lower_levels or {}, compressor,
    )
    return OuterTransform(
        init=bound(init_state, config),
        update=bound(update.update, config),
        update_=bound(update.update_, config),
        state_dict=bound(checkpoint.state_dict, config),
        load_state_dict=bound(checkpoint.load_state_dict, config),
    )
