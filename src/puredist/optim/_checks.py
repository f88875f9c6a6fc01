"""The optimizers' rules, as data beside the optimizers: their hyper-parameters'
(:data:`HYPERS`, :func:`check_hyper`, :data:`ONE_KERNEL`), what a fused kernel
refuses (:data:`_FUSED_REFUSALS`, read by :func:`puredist._inputs.check_kernel_takes`),
and what those checks read of a state (:func:`counts_of`, :func:`shaped_field`). The
loops that apply them live with their kind (:mod:`puredist._validation`,
:mod:`puredist._inputs`); each raises before anything is stepped, naming the argument
and its value.

This module must not step anything.
"""

from itertools import repeat
from typing import Any, NamedTuple, Sequence

import torch

from puredist._dtensors import dtensor_type
from puredist._inputs import KernelRefusal, check_kernel_takes
from puredist._seq import any_complex, any_none
from puredist._validation import BETAS, NON_NEGATIVE, Rule, check
from puredist.optim._kernels import DTYPE, IS_CPU, cpu_fused_sgd_sound
from puredist.optim.base import declaration


HYPERS = {"betas": (BETAS,)}
"""The rules of the hyper-parameters that are not a non-negative number (the others'
rule), a schedule's values included."""


def check_hyper(name: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` satisfies hyper-parameter ``name``'s
    rules (:data:`HYPERS`; a non-negative number where it has none)."""
    check(name, value, *HYPERS.get(name, (NON_NEGATIVE,)))


ONE_KERNEL = Rule(lambda foreach, b: not (foreach and b["fused"]), ValueError,
                  "Args ``{arg}`` ({value}) and ``fused`` ({fused}) cannot both be True: pick one kernel.")
"""``foreach``'s rule, given ``fused``: torch's kernels are chosen one at a time."""


def counts_of(states: Sequence[NamedTuple], why: str) -> list[torch.Tensor]:
    """Each state's step count: its field declared :data:`~puredist.optim.base.Count`
    (the first, where several are).

    Raises:
        TypeError: a state counts no steps (``why`` needs them).
    """
    fields = {kind: _count_field(kind) for kind in set(map(type, states))}
    counts = [getattr(s, fields[type(s)]) if fields[type(s)] else None for s in states]
    if any_none(counts):
        raise TypeError(
            f"Arg ``state``: parameter {counts.index(None)}'s state counts no steps (made by an optimizer that keeps "
            f"no count, e.g. loaded from its checkpoint); {why}: init a new state."
        )
    return counts


def _count_field(kind: type) -> str | None:
    declared = declaration(kind)
    return declared.counts[0] if declared is not None and declared.counts else None


_HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})


def _any_dtensor(params: Sequence[torch.Tensor]) -> bool:
    dtensor = dtensor_type()
    return dtensor is not None and any(map(isinstance, params, repeat(dtensor)))


_FUSED_REFUSALS = (
    KernelRefusal(None, False, any_complex, lambda p: p.is_complex(), TypeError,
                  "torch's fused kernel takes no complex parameters (parameter {i} is {dtype})"),
    KernelRefusal("sgd", True, _any_dtensor, lambda p: isinstance(p, dtensor_type()), TypeError,
                  "torch's fused SGD kernel takes no DTensor parameters (it has no sharding rule)"),
    # torch 2.13's steps a 16-element bf16 tensor 2.4 off after one step at lr 0.7 (probed once per dtype)
    KernelRefusal("sgd", True, lambda ps: not _HALF_DTYPES.isdisjoint(map(DTYPE, ps)) and any(map(IS_CPU, ps)),
                  lambda p: p.is_cpu and p.dtype in _HALF_DTYPES and not cpu_fused_sgd_sound(p.dtype), ValueError,
                  f"torch {torch.__version__}'s fused SGD kernel on a CPU steps {{dtype}} tensors wrongly (parameter "
                  "{i}: it disagrees with its multi-tensor kernel by far more than rounding)"),
)
"""What torch's fused kernels refuse, read by :func:`check_fused_takes` in this order."""


def check_fused_takes(params: Sequence[torch.Tensor], fused: bool | None, name: str) -> None:
    """Raise, naming the argument, before anything is stepped where torch's fused
    kernel of the optimizer ``name`` would raise its own error from inside the step
    (complex parameters; SGD's: DTensor parameters) or step wrongly (SGD's: 16-bit
    parameters on a CPU where the installed torch's kernel disagrees with its
    multi-tensor kernel): the first of :data:`_FUSED_REFUSALS` that applies."""
    check_kernel_takes(params, fused, name, _FUSED_REFUSALS)


def shaped_field(states: Sequence[NamedTuple]) -> str | None:
    """The field of ``states`` that a step's check holds to its parameter's shape: the
    first declared :data:`~puredist.optim.base.Shaped`, where the states are of one
    declared kind; ``None`` where there is none (SGD without momentum)."""
    kinds = set(map(type, states))
    declared = declaration(kinds.pop()) if len(kinds) == 1 else None
    return declared.shaped[0] if declared is not None and declared.shaped else None
