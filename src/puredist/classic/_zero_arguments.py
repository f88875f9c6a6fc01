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

from puredist._validation import Rule, check

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


def _iterable(value: Any) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return True


def _tensors_or_dicts(listed: list) -> bool:
    return all(isinstance(p, torch.Tensor) for p in listed) or all(isinstance(p, dict) for p in listed)


def _groups_have_params(listed: list) -> bool:
    return all(isinstance(p, torch.Tensor) for p in listed) or all("params" in group for group in listed)


_PARAMS = (  # torch's errors for what an optimizer cannot take, in torch's order
    Rule(lambda v, b: not isinstance(v, torch.Tensor), TypeError,
         "`params` argument should be an iterable of Tensors, but got {typename}"),
    Rule(lambda v, b: _iterable(v), TypeError, "`params` argument should be an iterable of Tensors or dicts, but got {typename}"),
)
_LISTED_PARAMS = (
    Rule(lambda v, b: len(v) > 0, ValueError, "ZeroRedundancyOptimizer got an empty parameter list"),
    Rule(lambda v, b: _tensors_or_dicts(v), TypeError, "`params` argument should be an iterable of Tensors or dicts"),
    Rule(lambda v, b: _groups_have_params(v), ValueError,
         "Each parameter group passed-in via `params` must have a 'params' key mapping to the parameters in the group"),
)
_OPTIMIZER_CLASS = (
    Rule(lambda v, b: callable(v), TypeError,
         "Arg ``{arg}`` must build a torch.optim.Optimizer (a class, or e.g. functools.partial of one), "
         "got {name} of type {type}."),
    Rule(lambda v, b: b["overlap"] or v not in b["functional"], ValueError,  # torch's
         "Passing in a functional optimizer {value} when `overlap_with_ddp=False`"),
)
_OVERLAPPED = Rule(lambda v, b: not b["overlap"] or v in OVERLAP_OPTIMIZERS, ValueError,
                   "Arg ``{arg}`` {name} is not supported with `overlap_with_ddp=True` (its step must be per parameter); "
                   "supported: {supported}.")
_TAKEN = Rule(lambda v, b: not v, ValueError,
              "Arg ``{value[0]}`` of {functional} is not supported: puredist's overlap steps torch.optim.{plain}, "
              "which takes no {value[0]!r}.")
DENSE = Rule(lambda v, b: v is None, ValueError,  # v: (position, layout) of the first parameter not strided
             "Arg ``{arg}``: ZeroRedundancyOptimizer only supports dense (strided) parameters, "
             "got {value[1]} at parameter {value[0]}.")
ONE_DEVICE = Rule(lambda v, b: len(v) <= 1, ValueError, "Arg ``{arg}``: parameters must live on one device, got parameters on {value}.")
ONE_GROUP = Rule(lambda v, b: not b["overlap"] or v <= 1, ValueError,  # v: the number of param groups (torch's)
                 "ZeroRedundancyOptimizer with `overlap_with_ddp=True` only supports a single parameter group")
BUILT = Rule(lambda v, b: isinstance(v, torch.optim.Optimizer), TypeError,
             "Arg ``optimizer_class`` must build a torch.optim.Optimizer, got {type} from {name}.")


def listed_params(params: Any) -> list:
    """``params`` as a list, with torch's errors for what an optimizer cannot take."""
    check("params", params, *_PARAMS, typename=torch.typename(params))
    listed = list(params)
    check("params", listed, *_LISTED_PARAMS)
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
    overlap = dict(name=name, overlap=overlap_with_ddp)
    check("optimizer_class", optimizer_class, *_OPTIMIZER_CLASS, functional=[f for _, f in _FUNCTIONAL_FORMS], **overlap)
    for plain, functional in _FUNCTIONAL_FORMS:
        if optimizer_class is functional:
            optimizer_class, defaults = plain, _as_arguments_of(plain, functional, defaults)
    supported = ", ".join(f"torch.optim.{cls.__name__}" for cls in OVERLAP_OPTIMIZERS)
    check("optimizer_class", optimizer_class, _OVERLAPPED, supported=supported, **overlap)
    return optimizer_class, defaults


def _as_arguments_of(plain: type, functional: type, given: dict[str, Any]) -> dict[str, Any]:
    """``given`` (arguments of ``functional``) with ``functional``'s defaults for the
    others that ``plain`` takes; ``ValueError`` for one ``plain`` does not take."""
    takes = inspect.signature(plain).parameters
    check("defaults", sorted(set(given) - set(takes)), _TAKEN, functional=functional.__name__, plain=plain.__name__)
    unset = {
        name: parameter.default for name, parameter in inspect.signature(functional).parameters.items()
        if name in takes and name not in given and name != "params" and parameter.default is not inspect.Parameter.empty
    }
    return {**unset, **given}


def check_dense_on_one_device(params: Sequence[torch.Tensor], arg: str) -> None:
    """Raise ``ValueError`` naming ``arg`` unless every parameter is dense and all
    live on one device (what the staged broadcasts take)."""
    check(arg, next(((i, p.layout) for i, p in enumerate(params) if p.layout != torch.strided), None), DENSE)
    check(arg, sorted({str(p.device) for p in params}), ONE_DEVICE)
