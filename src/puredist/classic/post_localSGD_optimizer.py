"""Drop-in for ``torch.distributed.optim.PostLocalSGDOptimizer``.

Differences on purpose:

- ``step(closure=None)`` accepts and returns the closure's loss like every
  ``torch.optim`` optimizer (torch's takes no closure, so
  ``torch.distributed.checkpoint`` fails on it).
- The averager's step survives ``torch.distributed.checkpoint``: besides torch's
  top-level ``"step"`` entry (which ``get_optimizer_state_dict`` drops), it is
  saved in every param group of the state dict, which DCP keeps.
- The zero-learning-rate, zero-gradient step that DCP runs to initialize an empty
  optimizer state does not advance or trigger the averager.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from puredist.classic.averagers import ModelAverager

__all__ = ["PostLocalSGDOptimizer"]

AVERAGER_STEP_KEY = "puredist_averager_step"
"""The param-group entry that carries the averager's step through checkpoints."""


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

    def _is_checkpoint_initialization_step(self) -> bool:
        # torch.distributed.checkpoint fills an empty optimizer state by stepping with
        # every lr set to 0 and every grad set to zeros; that step learns nothing and
        # must leave the averager alone. The lr test is host-only; grads are read only
        # when every lr is 0.
        if any(group.get("lr", 1) != 0 for group in self.param_groups):
            return False
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        return all(not bool(g.any()) for g in grads)

    def step(self, closure: Callable[[], Any] | None = None):  # type: ignore[override]
        """One local optimizer step (with ``closure`` if given), then the averager.

        Returns:
            The closure's loss, or ``None``.
        """
        initializing = self._is_checkpoint_initialization_step()
        loss = self.optim.step() if closure is None else self.optim.step(closure)
        if not initializing:
            self.averager.average_parameters(params=self.param_groups)
        return loss

    def zero_grad(self, set_to_none: bool = True):  # type: ignore[override]
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group):
        self.optim.add_param_group(param_group)
