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
- Rank-local state is never dropped silently. Between averagings each rank's
  parameters and optimizer state (momentum) are its own, while
  ``torch.distributed.checkpoint`` on disk keeps one copy of each key (rank 0's).
  ``state_dict()`` therefore records, under a key of its own rank, a digest of this
  rank's parameters and optimizer state; ``load_state_dict()`` compares it (on every
  rank, with one small all-reduce) and raises on every rank when some rank would
  resume from another rank's values. Checkpoint such a run per rank (each rank
  ``torch.save``-s its model and optimizer state dicts to its own file), which
  resumes bit for bit.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from puredist._host_groups import exchange
from puredist.classic.averagers import ModelAverager

__all__ = ["PostLocalSGDOptimizer"]

AVERAGER_STEP_KEY = "puredist_averager_step"
"""The param-group entry that carries the averager's step through checkpoints."""

LOCAL_DIGEST_KEY = "puredist_local_state_digest"
"""Prefix of the param-group entry (``<prefix>.rank<r>``) holding a digest of rank
``r``'s own parameters and optimizer state when it saved."""


_DCP_INITIALIZER = ("_init_optim_state", os.path.join("distributed", "checkpoint", "state_dict.py"))


def _called_by_checkpoint_initialization() -> bool:
    """Whether ``step`` was called by ``torch.distributed.checkpoint`` to fill an empty
    optimizer state (it steps with lr 0 and zero grads). Decided by the call site,
    which is the same on every rank, never by rank-local values (that could make
    ranks disagree about averaging, and hang)."""
    frame = sys._getframe(2)  # 0: this function, 1: step, 2: step's caller
    return frame.f_code.co_name == _DCP_INITIALIZER[0] and frame.f_code.co_filename.endswith(_DCP_INITIALIZER[1])


def _local_digest(params: list[torch.Tensor], state_dict: dict[str, Any]) -> str:
    """A digest of the parameters' values and of the optimizer state, in parameter
    order (the ids in ``param_groups``: ints from ``state_dict()``, names through DCP)."""
    digest = hashlib.blake2b(digest_size=16)
    ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    state = state_dict["state"]
    tensors = list(params) + [
        value for pid in ids for _, value in sorted(state.get(pid, {}).items()) if isinstance(value, torch.Tensor)
    ]
    for tensor in tensors:
        digest.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _rank() -> int | None:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


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
        rank = _rank()
        digest = _local_digest(self._params(), state_dict) if rank is not None else None
        for group in state_dict["param_groups"]:
            group[AVERAGER_STEP_KEY] = self.averager.step
            if digest is not None:
                group[f"{LOCAL_DIGEST_KEY}.rank{rank}"] = digest
        return state_dict

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _check_own_state(self, state_dict: dict[str, Any]) -> None:
        """Raise on every rank if some rank is about to load state that is not its
        own (see the module docstring); a checkpoint without digests passes."""
        rank = _rank()
        digests = {k: v for group in state_dict["param_groups"] for k, v in group.items() if k.startswith(LOCAL_DIGEST_KEY)}
        if rank is None or not digests:
            return
        # a rank holding another rank's file has digests but not its own: it takes part too, and refuses (its
        # momentum is its own even where the parameters are equal, as right after an averaging)
        own = digests.get(f"{LOCAL_DIGEST_KEY}.rank{rank}")
        group, device = exchange(dist.group.WORLD)  # the host side, or the device of a device-only group (NCCL)
        foreign = torch.tensor([float(own is None or own != _local_digest(self._params(), state_dict))], device=device)
        dist.all_reduce(foreign, op=dist.ReduceOp.MAX, group=group)
        if foreign.item():
            raise RuntimeError(
                "PostLocalSGDOptimizer.load_state_dict: some rank would resume from another rank's parameters or "
                "optimizer state (between averagings they differ by rank, and torch.distributed.checkpoint keeps "
                "one copy of each key); nothing was loaded. Checkpoint per rank instead: each rank torch.save-s "
                "its model's and this optimizer's state_dict() to a file of its own."
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the local optimizer's state and restore the averager's step.

        Warns (and sets the step to 0), as torch does, when no step is saved.

        Raises:
            RuntimeError: on every rank, when some rank's saved digest does not match
                the parameters and state it would resume from (its own state was
                dropped, e.g. by ``torch.distributed.checkpoint`` on disk).
        """
        self._check_own_state(state_dict)
        step = _saved_averager_step(state_dict)
        inner = dict(state_dict)
        inner["param_groups"] = [
            {k: v for k, v in group.items() if k != AVERAGER_STEP_KEY and not k.startswith(LOCAL_DIGEST_KEY)}
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
