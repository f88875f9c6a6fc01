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
  optimizer state's (on every rank, with one small all-reduce) and raises on every
  rank when some rank would resume from another rank's state; the first ``step()``
  after it compares the parameters' (the model may be loaded after the optimizer, as
  with any ``torch.optim`` optimizer) and raises on every rank, before stepping,
  when some rank resumed from another rank's parameters. Checkpoint such a run per
  rank (each rank ``torch.save``-s its model and optimizer state dicts to its own
  file), which resumes bit for bit.
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
"""Prefix of the param-group entry (``<prefix>.rank<r>``) holding digests of rank
``r``'s own parameters and optimizer state when it saved: ``"<parameters>:<state>"``
(an entry without ``:``, from an older puredist, is not checked)."""

_FOREIGN = (
    "some rank would resume from another rank's parameters or optimizer state (between averagings they differ "
    "by rank, and torch.distributed.checkpoint keeps one copy of each key); {}. Checkpoint per rank instead: each "
    "rank torch.save-s its model's and this optimizer's state_dict() to a file of its own."
)


_DCP_INITIALIZER = ("_init_optim_state", os.path.join("distributed", "checkpoint", "state_dict.py"))


def _called_by_checkpoint_initialization() -> bool:
    """Whether ``step`` was called by ``torch.distributed.checkpoint`` to fill an empty
    optimizer state (it steps with lr 0 and zero grads). Decided by the call site,
    which is the same on every rank, never by rank-local values (that could make
    ranks disagree about averaging, and hang)."""
    frame = sys._getframe(2)  # 0: this function, 1: step, 2: step's caller
    return frame.f_code.co_name == _DCP_INITIALIZER[0] and frame.f_code.co_filename.endswith(_DCP_INITIALIZER[1])


def _digest(tensors: list[torch.Tensor]) -> str:
    """A digest of the tensors' bytes, in order."""
    digest = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        digest.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _state_digest(state_dict: dict[str, Any]) -> str:
    """A digest of the optimizer state's tensors, in parameter order (the ids in
    ``param_groups``: ints from ``state_dict()``, names through DCP)."""
    ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    state = state_dict["state"]
    return _digest([value for pid in ids for _, value in sorted(state.get(pid, {}).items())
                    if isinstance(value, torch.Tensor)])


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on some rank (every rank calls it: one small all-reduce
    over the host side of the default group, or its device where it has none)."""
    group, device = exchange(dist.group.WORLD)
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


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
        self._params_to_check: str | None = None  # set by load_state_dict, compared at the next step

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
        digest = f"{_digest(self._params())}:{_state_digest(state_dict)}" if rank is not None else None
        for group in state_dict["param_groups"]:
            group[AVERAGER_STEP_KEY] = self.averager.step
            if digest is not None:
                group[f"{LOCAL_DIGEST_KEY}.rank{rank}"] = digest
        return state_dict

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _check_own_state(self, state_dict: dict[str, Any]) -> str | None:
        """Raise on every rank if some rank is about to load optimizer state that is
        not its own (see the module docstring); return its saved parameters' digest,
        for the first step to compare (``None``: no digests, or an older format, on
        every rank alike: nothing to check)."""
        rank = _rank()
        digests = {k: v for group in state_dict["param_groups"] for k, v in group.items() if k.startswith(LOCAL_DIGEST_KEY)}
        if rank is None or not digests or not all(":" in v for v in digests.values()):
            return None
        # a rank holding another rank's file has digests but not its own: it takes part too, and refuses (its
        # momentum is its own even where the parameters are equal, as right after an averaging)
        own = digests.get(f"{LOCAL_DIGEST_KEY}.rank{rank}")
        params_digest, _, state_digest = (own or "").partition(":")
        if _any_rank(own is None or state_digest != _state_digest(state_dict)):
            raise RuntimeError("PostLocalSGDOptimizer.load_state_dict: " + _FOREIGN.format("nothing was loaded"))
        return params_digest

    def _check_own_params(self) -> None:
        """At the first step after a load: raise on every rank, before stepping, if
        some rank's parameters are not those it saved with the state it loaded."""
        saved, self._params_to_check = self._params_to_check, None
        if _any_rank(saved != _digest(self._params())):
            raise RuntimeError("PostLocalSGDOptimizer.step: " + _FOREIGN.format(
                "nothing was stepped (the parameters differ from those this optimizer's state was saved with)"))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the local optimizer's state and restore the averager's step.

        Warns (and sets the step to 0), as torch does, when no step is saved.

        Raises:
            RuntimeError: on every rank, when some rank's saved digest does not match
                the optimizer state it would resume from (its own state was dropped,
                e.g. by ``torch.distributed.checkpoint`` on disk); nothing loaded. The
                parameters are compared at the next :meth:`step`.
        """
        params_digest = self._check_own_state(state_dict)
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
        self._params_to_check = params_digest

    def step(self, closure: Callable[[], Any] | None = None):  # type: ignore[override]
        """One local optimizer step (with ``closure`` if given), then the averager.

        Returns:
            The closure's loss, or ``None``.

        Raises:
            RuntimeError: on every rank, at the first step after :meth:`load_state_dict`,
                when some rank's parameters are not those it saved with the state it
                loaded (see the module docstring); nothing is stepped.
        """
        initializing = _called_by_checkpoint_initialization()
        if self._params_to_check is not None and not initializing:
            self._check_own_params()
        loss = self.optim.step() if closure is None else self.optim.step(closure)
        if not initializing:
            self.averager.average_parameters(params=self.param_groups)
        return loss

    def zero_grad(self, set_to_none: bool = True):  # type: ignore[override]
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group):
        self.optim.add_param_group(param_group)
