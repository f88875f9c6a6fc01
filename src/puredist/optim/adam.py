"""Adam and AdamW, as ``torch.optim.Adam`` / ``AdamW`` (same arguments and math,
torch's own kernels).

This module must not communicate.
"""

from typing import NamedTuple, Sequence

import torch
from torch.optim.adam import adam as _adam_kernel
from torch.optim.optimizer import _get_scalar_dtype

from puredist._docs import fields_documented
from puredist._seq import any_complex, rows_of
from puredist._validation import check, check_hypers
from puredist.optim._checks import ONE_KERNEL, check_fused_takes, check_hyper
from puredist.optim._factory import make_optimizer
from puredist._transforms import is_transformed
from puredist.optim._kernels import batch_fused_multiply_add, grads_for, l2_while_compiling, steps_out_of_place
from puredist.optim._out_of_place import adam_foreach
from puredist.optim.base import Count, Optimizer, Shaped, config_text, param_state


@param_state(elementwise=True)
@fields_documented
class AdamParamState(NamedTuple):
    """Adam/AdamW state of one parameter (torch's layout).

    Attributes:
        step: the number of steps taken, a 0-dim float32 CPU tensor.
        exp_avg: first-moment running average.
        exp_avg_sq: second-moment running average.
    """

    step: Count
    exp_avg: Shaped
    exp_avg_sq: Shaped


@param_state(elementwise=True)
@fields_documented
class AMSGradParamState(NamedTuple):
    """Adam/AdamW state of one parameter with amsgrad (torch's layout).

    Attributes:
        step, exp_avg, exp_avg_sq: as :class:`AdamParamState`'s.
        max_exp_avg_sq: the running max of ``exp_avg_sq``.
    """

    step: Count
    exp_avg: Shaped
    exp_avg_sq: Shaped
    max_exp_avg_sq: Shaped


def _adam_family(
    lr, betas, eps, weight_decay, amsgrad, maximize, foreach, fused, differentiable: bool, decoupled: bool
) -> Optimizer:
    check_hypers(dict(eps=eps, weight_decay=weight_decay, lr=lr, betas=betas), scheduled=("lr", "weight_decay", "betas"),
                 validate=check_hyper)
    check("foreach", foreach, ONE_KERNEL, fused=fused)

    def init_leaf(p: torch.Tensor) -> AdamParamState | AMSGradParamState:
        if not torch.compiler.is_compiling() and is_transformed(p):  # states made under vmap: steps batched next
            batch_fused_multiply_add()
        zeros = lambda: torch.zeros_like(p, memory_format=torch.preserve_format)  # noqa: E731
        # as torch.optim.Adam: the fused kernel keeps the step on the parameter's device
        step = torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device if fused else "cpu")
        return AMSGradParamState(step, zeros(), zeros(), zeros()) if amsgrad else AdamParamState(step, zeros(), zeros())

    def kernel(params, grads, states, traced, lr: float, weight_decay: float, betas) -> None:
        maximize_here = maximize
        if not decoupled:
            grads, weight_decay, maximize_here = l2_while_compiling(params, grads, weight_decay, maximize)
        fused_here = False if traced else fused  # (recorded: the fused kernel has no differentiable form)
        _adam_kernel(
            params, grads_for(fused_here, params, grads),
            [s.exp_avg for s in states], [s.exp_avg_sq for s in states],
            [s.max_exp_avg_sq for s in states] if amsgrad else [],
            [s.step for s in states],
            foreach=False if traced else foreach,
            fused=fused_here,
            differentiable=traced,
            has_complex=any_complex(params),  # else the multi-tensor kernel takes g^2, not |g|^2
            decoupled_weight_decay=decoupled,
            amsgrad=amsgrad, beta1=betas[0], beta2=betas[1], lr=lr,
            weight_decay=weight_decay, eps=eps, maximize=maximize_here,
        )

    def run(params, grads, states, traced, lr, weight_decay, betas):
        kernel(params, grads, states, traced, lr, weight_decay, betas)  # counts the step in the states, in place
        return list(states)

    def pure_step(params, grads, states):
        """torch's multi-tensor step into new tensors (:mod:`puredist.optim._out_of_place`),
        where torch would run that kernel eagerly on fp32/fp64 tensors, every
        parameter has a gradient and no hyper-parameter is a schedule; ``None``
        elsewhere."""
        if not steps_out_of_place(params, grads, foreach, fused, lr, weight_decay, betas):
            return None
        new_params, exp_avgs, exp_avg_sqs, maxima, steps = adam_foreach(
            params, grads, [s.exp_avg for s in states], [s.exp_avg_sq for s in states],
            [s.max_exp_avg_sq for s in states] if amsgrad else None, [s.step for s in states],
            lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay, decoupled=decoupled,
            maximize=maximize,
        )
        if amsgrad:
            return new_params, rows_of(AMSGradParamState, steps, exp_avgs, exp_avg_sqs, maxima)
        return new_params, rows_of(AdamParamState, steps, exp_avgs, exp_avg_sqs)

    config = config_text("adamw" if decoupled else "adam", lr=lr, betas=betas if callable(betas) else tuple(betas),
                         eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                         fused=fused)
    return make_optimizer(
        AMSGradParamState if amsgrad else AdamParamState, init_leaf, run,
        hypers={"lr": lr, "weight_decay": weight_decay, "betas": betas}, config=config,
        differentiable=differentiable, check=lambda params, traced: check_fused_takes(params, fused and not traced,
                                                                                         "adam/adamw"),
        pure_step=pure_step, takes_sparse=False,
    )

def adam(
    lr: float = 1e-3,
    betas: Sequence[float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
    differentiable: bool = False,
    decoupled_weight_decay: bool = False,
) -> Optimizer:
    """Adam, as ``torch.optim.Adam``: L2 weight decay added to the gradient, or
    decoupled (AdamW) with ``decoupled_weight_decay=True``. ``lr``, ``weight_decay`` and
    ``betas`` may be schedules (see :mod:`puredist.optim`).

    Raises:
        ValueError: negative ``lr``/``eps``/``weight_decay``, ``betas`` outside [0, 1),
            ``fused`` and ``foreach`` both True.
    """
    return _adam_family(
        lr, betas, eps, weight_decay, amsgrad, maximize, foreach, fused, differentiable, decoupled_weight_decay
    )


def adamw(
    lr: float = 1e-3,
    betas: Sequence[float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
    differentiable: bool = False,
) -> Optimizer:
    """AdamW, as ``torch.optim.AdamW`` (decoupled weight decay). ``lr``,
    ``weight_decay`` and ``betas`` may be schedules (see :mod:`puredist.optim`).

    Raises:
        ValueError: negative ``lr``/``eps``/``weight_decay``, ``betas`` outside [0, 1),
            ``fused`` and ``foreach`` both True.
    """
    return _adam_family(lr, betas, eps, weight_decay, amsgrad, maximize, foreach, fused, differentiable, decoupled=True)
