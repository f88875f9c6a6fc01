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
  ``state_dict()`` therefore records, under a key of its own rank, digests of this
  rank's parameters and of its optimizer state. ``load_state_dict()`` compares the
  optimizer state's, on this rank alone (a load is local, as torch's); the first
  ``step()`` after it compares the parameters' (the model may be loaded after the
  optimizer, as with any ``torch.optim`` optimizer), and with one small all-reduce
  over the averager's group every rank raises, before stepping, when some rank
  resumed from another rank's parameters or state. A checkpoint that one rank saved
  and every rank loads (torch's own tests do so) passes where the optimizer keeps no
  state (SGD without momentum) and the parameters are the saver's. Checkpoint other
  runs per rank (each rank ``torch.save``-s its model and optimizer state dicts to its
  own file), which resumes bit for bit.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from puredist._consistency import check_loaded_own, tensors_digest
from puredist.classic._torch_state import check_loadable
from puredist.classic.averagers import ModelAverager

__all__ = ["PostLocalSGDOptimizer"]

AVERAGER_STEP_KEY = "puredist_averager_step"
"""The param-group entry that carries the averager's step through checkpoints."""

LOCAL_DIGEST_KEY = "puredist_local_state_digest"
"""Prefix of the param-group entry (``<prefix>.rank<r>``) holding digests of rank
``r``'s own parameters and optimizer state when it saved: ``"<parameters>:<state>"``
(an entry without ``:``, from an older puredist, is not checked)."""

_DCP_INITIALIZER = ("_init_optim_state", os.path.join("distributed", "checkpoint", "state_dict.py"))

_CALLERS_SEARCHED = 6
"""How far up from ``step`` the checkpoint's initializer is looked for: the wrappers
between them (an LR scheduler's, a profiler's) are a frame each."""


def _called_by_checkpoint_initialization() -> bool:
    """Whether ``step`` was called by ``torch.distributed.checkpoint`` to fill an empty
    optimizer state (it steps with lr 0 and zero grads), directly or through wrappers
    of ``step``. Decided by the call site, which is the same on every rank, never by
    rank-local values (that could make ranks disagree about averaging, and hang)."""
    frame = sys._getframe(2)  # 0: this function, 1: step, 2: step's caller
    for _ in range(_CALLERS_SEARCHED):
        if frame is None:
            return False
        if frame.f_code.co_name == _DCP_INITIALIZER[0] and frame.f_code.co_filename.endswith(_DCP_INITIALIZER[1]):
            return True
        frame = frame.f_back
    return False


def _state_tensors(state_dict: dict[str, Any]) -> list[torch.Tensor]:
    """The optimizer state's tensors, in parameter order (the ids in ``param_groups``:
    ints from ``state_dict()``, names through DCP)."""
    ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    state = state_dict["state"]
    return [value for pid in ids for _, value in sorted(state.get(pid, {}).items()) if isinstance(value, torch.Tensor)]


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
        self.averager = averager
        # set by load_state_dict, checked at the next step: (foreign, the saved parameters' digest, their count)
        self._loaded: tuple[bool, str, int] | None = None

    @property
    def state(self):  # type: ignore[override]
        return self.optim.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The local optimizer's param groups: its list of now. (torch's wrapper keeps
        the list it was built with, which the local optimizer's ``load_state_dict``
        replaces: after a resume an lr scheduler's changes no longer reached the local
        optimizer, and a group added then was stepped but never averaged.)"""
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optim.param_groups = groups

    def __repr__(self):
        return self.optim.__repr__()

    def state_dict(self) -> dict[str, Any]:
        """The local optimizer's state dict, plus the averager's step (top-level
        ``"step"`` as torch, and in every param group)."""
        state_dict = self.optim.state_dict()
        state_dict["step"] = self.averager.step
        rank = _rank()
        digest = (f"{tensors_digest(self._params())}:{tensors_digest(_state_tensors(state_dict))}"
                  if rank is not None else None)
        for group in state_dict["param_groups"]:
            group[AVERAGER_STEP_KEY] = self.averager.step
            if digest is not None:
                group[f"{LOCAL_DIGEST_KEY}.rank{rank}"] = digest
        return state_dict

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _verdict(self, state_dict: dict[str, Any]) -> tuple[bool, str, int] | None:
        """Whether this rank is about to load optimizer state that is not its own (see
        the module docstring), and the saved parameters' digest and count for the
        first step to compare (with the first that many parameters: groups added after
        the load are not the checkpoint's); ``None``: no digests, or an older format,
        on every rank alike: nothing to check. Local: no collective."""
        rank = _rank()
        digests = {k: v for group in state_dict["param_groups"] for k, v in group.items() if k.startswith(LOCAL_DIGEST_KEY)}
        if rank is None or not digests or not all(":" in v for v in digests.values()):
            return None
        tensors = _state_tensors(state_dict)
        own = digests.get(f"{LOCAL_DIGEST_KEY}.rank{rank}")
        if own is None and len(digests) == 1 and not tensors:
            # one rank saved, every rank loads: nothing rank-local in a state without tensors; the
            # parameters must be the saver's
            own = next(iter(digests.values()))
        # a rank holding another rank's file otherwise refuses (its momentum is its own even where the
        # parameters are equal, as right after an averaging)
        params_digest, _, state_digest = (own or "").partition(":")
        count = sum(len(group["params"]) for group in state_dict["param_groups"])  # (groups added since: not saved)
        return own is None or state_digest != tensors_digest(tensors), params_digest, count

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the local optimizer's state and restore the averager's step.

        Warns (and sets the step to 0), as torch does, when no step is saved.

        A load is local. Where ``state_dict`` carries digests (see the module
        docstring), the next :meth:`step` checks, on every rank of the averager's
        group, that each rank loaded its own state and holds the parameters saved
        with it.

        Raises:
            ValueError: the local optimizer cannot load ``state_dict``: groups of
                other sizes (torch's messages), or, for one of torch's optimizers, a
                saved parameter state with a field it does not keep, lacking one it
                keeps (its step would raise ``KeyError`` mid-step, the peers waiting
                in the averaging), or shaped unlike the parameter. Nothing changed.
        """
        verdict = self._verdict(state_dict)
        step = _saved_averager_step(state_dict)
        inner = dict(state_dict)
        inner["param_groups"] = [
            {k: v for k, v in group.items() if k != AVERAGER_STEP_KEY and not k.startswith(LOCAL_DIGEST_KEY)}
            for group in state_dict["param_groups"]
        ]
        check_loadable(inner, self.optim.param_groups, type(self.optim))
        self.optim.load_state_dict(inner)
        if step is None:
            warnings.warn(
                "Loaded state dict does not contain a step counter for an averager. "
                "Setting step counter to 0.",
                stacklevel=2,
            )
            step = 0
        self.averager.step = step
        self._loaded = verdict

    def step(self, closure: Callable[[], Any] | None = None):  # type: ignore[override]
        """One local optimizer step (with ``closure`` if given), then the averager.

        Returns:
            The closure's loss, or ``None``.

        Raises:
            RuntimeError: on every rank, at the first step after :meth:`load_state_dict`,
                when some rank loaded optimizer state that is not its own (its own was
                dropped, e.g. by ``torch.distributed.checkpoint`` on disk) or holds
                parameters other than those saved with it (see the module docstring);
                nothing is stepped. Every rank of the averager's group must load before
                that step.
        """
        initializing = _called_by_checkpoint_initialization()
        if self._loaded is not None and not initializing:  # (a refusal keeps refusing, at every step, until a load)
            group = getattr(self.averager, "process_group", None) or dist.group.WORLD
            check_loaded_own(self._loaded, self._params(), group, who="PostLocalSGDOptimizer.step")
            self._loaded = None
        loss = self.optim.step() if closure is None else self.optim.step(closure)
        if not initializing:
            self.averager.average_parameters(params=self.param_groups)
        return loss

    def zero_grad(self, set_to_none: bool = True):  # type: ignore[override]
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group):
        self.optim.add_param_group(param_group)
