"""What :class:`~puredist.classic.ZeroRedundancyOptimizer`'s constructor and
``add_param_group`` take, checked with torch's messages where torch has one: the
parameters, the class that builds the local optimizer (torch's functional forms
included, with the overlap), one device.

This module must not communicate or build an optimizer.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
from torch.distributed.optim.utils import functional_optim_map

OVERLAP_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.Adamax,
)
"""The optimizers ``overlap_with_ddp=True`` accepts: torch's own list there (those
with a functional form, whose state is per parameter)."""


def listed_params(params: Any) -> list:
    """``params`` as a list, with torch's errors for what an optimizer cannot take."""
    if isinstance(params, torch.Tensor):
        raise TypeError(f"`params` argument should be an iterable of Tensors, but got {torch.typename(params)}")
    try:
        listed = list(params)
    except TypeError as error:
        raise TypeError(f"`params` argument should be an iterable of Tensors or dicts, but got {torch.typename(params)}") from error
    if not listed:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    if not all(isinstance(p, torch.Tensor) for p in listed):
        if not all(isinstance(p, dict) for p in listed):
            raise TypeError("`params` argument should be an iterable of Tensors or dicts")
        if any("params" not in group for group in listed):
            raise ValueError(
                "Each parameter group passed-in via `params` must have a 'params' key mapping to the parameters in "
                "the group"
            )
    return listed


_FUNCTIONAL_FORMS = tuple(functional_optim_map.items())
"""``(torch.optim class, torch's functional form of it)``: torch's overlap runs the
functional form, and takes either class there."""


def local_optimizer(optimizer_class: Any, overlap_with_ddp: bool, defaults: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """What builds the local optimizer and with which arguments, as torch checks them:
    anything that builds an optimizer from param groups and keywords (a class,
    ``functools.partial`` of one); with the overlap, one of ``OVERLAP_OPTIMIZERS``
    or torch's functional form of one, which torch refuses without it. For a
    functional form, its ``torch.optim`` class is built with the functional form's
    defaults for the arguments not given (torch's functional SGD steps at lr 0.01,
    its kernels one tensor at a time); arguments only the functional form takes are refused."""
    name = getattr(optimizer_class, "__name__", repr(optimizer_class))
    if not callable(optimizer_class):
        raise TypeError(
            f"Arg ``optimizer_class`` must build a torch.optim.Optimizer (a class, or e.g. functools.partial of one), "
            f"got {name} of type {type(optimizer_class).__name__}."
        )
    for plain, functional in _FUNCTIONAL_FORMS:
        if optimizer_class is functional:
            if not overlap_with_ddp:
                raise ValueError(f"Passing in a functional optimizer {optimizer_class} when `overlap_with_ddp=False`")
            optimizer_class, defaults = plain, _as_arguments_of(plain, functional, defaults)
    if overlap_with_ddp and optimizer_class not in OVERLAP_OPTIMIZERS:
        supported = ", ".join(f"torch.optim.{cls.__name__}" for cls in OVERLAP_OPTIMIZERS)
        raise ValueError(
            f"Arg ``optimizer_class`` {name} is not supported with `overlap_with_ddp=True` "
            f"(its step must be per parameter); supported: {supported}."
        )
    return optimizer_class, defaults


def _as_arguments_of(plain: type, functional: type, given: dict[str, Any]) -> dict[str, Any]:
    """``given`` (arguments of ``functional``) with ``functional``'s defaults for the
    others that ``plain`` takes; ``ValueError`` for one ``plain`` does not take."""
    takes = inspect.signature(plain).parameters
    foreign = sorted(set(given) - set(takes))
    if foreign:
        raise ValueError(
            f"Arg ``{foreign[0]}`` of {functional.__name__} is not supported: puredist's overlap steps "
            f"torch.optim.{plain.__name__}, which takes no {foreign[0]!r}."
        )
    unset = {
        name: parameter.default for name, parameter in inspect.signature(functional).parameters.items()
        if name in takes and name not in given and name != "params" and parameter.default is not inspect.Parameter.empty
    }
    return {**unset, **given}


def check_dense_on_one_device(params: Sequence[torch.Tensor], arg: str) -> None:
    """Raise ``ValueError`` naming ``arg`` unless every parameter is dense and all
    live on one device (what the staged broadcasts take)."""
    sparse = [i for i, p in enumerate(params) if p.layout != torch.strided]
    if sparse:
        raise ValueError(
            f"Arg ``{arg}``: ZeroRedundancyOptimizer only supports dense (strided) parameters, "
            f"got {params[sparse[0]].layout} at parameter {sparse[0]}."
        )
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"Arg ``{arg}``: parameters must live on one device, got parameters on {sorted(map(str, devices))}.")
