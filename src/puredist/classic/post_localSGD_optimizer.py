"""Drop-in for ``torch.distributed.optim.PostLocalSGDOptimizer``.

Differences on purpose:

- ``step(closure=None)`` accepts and returns the closure's loss like every
  ``torch.optim`` optimizer (torch's takes no closure, so
  ``torch.distributed.checkpoint`` fails on it).
- The averager's step survives ``torch.distributed.checkpoint``: besides torch's
  top-level ``"step"`` entry (which ``get_optimizer_state_dict`` drops), it is
  saved in every param group of the state dict, which DCP keeps.
- The zero-learning-rate, zero-gradient step that DCP runs (from
  ``_init_optim_state``) to initialize an empty optimizer state does not advance or
  trigger the averager.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Callable

import torch

from puredist.classic.averagers import ModelAverager

__all__ = ["PostLocalSGDOptimizer"]

AVERAGER_STEP_KEY = "puredist_averager_step"
"""The param-group entry that carries the averager's step through checkpoints."""


_DCP_INITIALIZER = ("_init_optim_state", os.path.join("distributed", "checkpoint", "state_dict.py"))


def _called_by_checkpoint_initialization() -> bool:
    """Whether ``step`` was called by ``torch.distributed.checkpoint`` to fill an empty
    optimizer state (it steps with lr 0 and zero grads). Decided by the call site,
    which is the same on every rank, never by rank-local values (that could make
    ranks disagree about averaging, and hang)."""
    frame = sys._getframe(2)  # 0: this function, 1: step, 2: step's caller
    return frame.f_code.co_name == _DCP_INITIALIZER[0] and frame.f_code.co_filename.endswith(_DCP_INITIALIZER[1])


def _saved_averager_step(state_dict: dict[str, Any]) -> int | None:
    if "step" in state_dict:
        return int(state_dict["step"])
    for group in state_dict.get("param_groups", ()):
        if AVERAGER_STEP_KEY in group:
            return int(group[AVERAGER_STEP_KEY])
    return None


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    """Wraps a local optimizer and runs post-local SGD: the local step at every
    step, then the averager (which averages after its warm-up, periodically).

    Args:
        optim: the local optimizer.
        averager: a model averager (puredist's or torch's).
    """

    def __init__(self, optim: torch.optim.Optimizer, averager: ModelAverager):
        self.optim = optim
        self.param_groups = self.optim.param_groups
        self.averager = averager

    @property
    def state(self):  # type: ignore[override]
        return self.optim.state

    def __repr__(self):
        return self.optim.__repr__()

    def state_dict(self) -> dict[str, Any]:
        """The local optimizer's state dict, plus the averager's step (top-level
        ``"step"`` as torch, and in every param group)."""
        state_dict = self.optim.state_dict()
        state_dict["step"] = self.averager.step
        for group in state_dict["param_groups"]:
            group[AVERAGER_STEP_KEY] = self.averager.step
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the local optimizer's state and restore the averager's step.

        Warns (and sets the step to 0), as torch does, when no step is saved.
        """
        step = _saved_averager_step(state_dict)
        inner = dict(state_dict)
        inner["param_groups"] = [
            {k: v for k, v in group.items() if k != AVERAGER_STEP_KEY}
            for group in state_dict["param_groups"]
        ]
        self.optim.load_state_dict(inner)
        if step is None:
            warnings.warn(
                "Loaded state dict does not contain a step counter for an averager. "
                "Setting step counter to 0.",
                stacklevel=2,
            )
            step = 0
        self.averager.step = step

    def step(self, closure: Callable[[], Any] | None = None):  # type: ignore[override]
        """One local optimizer step (with ``closure`` if given), then the averager.

        Returns:
            The closure's loss, or ``None``.
        """
        loss = self.optim.step() if closure is None else self.optim.step(closure)
        if not _called_by_checkpoint_initialization():
            self.averager.average_parameters(params=self.param_groups)
        return loss

    def zero_grad(self, set_to_none: bool = True):  # type: ignore[override]
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group):
        self.optim.add_param_group(param_group)
