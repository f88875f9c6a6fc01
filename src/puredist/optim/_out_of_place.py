"""Out-of-place twins of ``torch.optim``'s multi-tensor kernels, for the pure
``update`` of :mod:`puredist.optim`.

A pure step made of a copy of the parameters and the state, then torch's in-place
kernel, passes over every byte once more than the step itself (on a CPU, AdamW over
1.2M parameters: 1.35x ``torch.optim``'s time). Each multi-tensor op has an
out-of-place form that computes the same values into new tensors at the cost of the
in-place one, so a kernel written with those, in torch's op order, writes its results
straight into the new tensors: bit for bit torch's step, without the copy.

:func:`adam_foreach` follows ``torch.optim.adam._multi_tensor_adam`` (torch 2.4 to
2.13: the eager, non-capturable path for real tensors) op for op, :func:`sgd_foreach`
``torch.optim.sgd._multi_tensor_sgd`` (undampened, dense); the tests compare them with
``torch.optim``'s classes bit for bit, for fp32 and fp64 tensors only (a 16-bit
in-place multiply rounds its scalar to the tensor's dtype first; the out-of-place one
does not). :func:`runs_foreach` is torch's own rule for when those kernels run.

This module must not decide whether a step is recorded or scheduled: the optimizer
calls it only for eager steps with fixed hyper-parameters.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.optim.optimizer import _default_to_fused_or_foreach


def runs_foreach(params: Sequence[torch.Tensor], foreach: bool | None, fused: bool | None) -> bool:
    """Whether ``torch.optim``'s functional ``adam``/``sgd`` with these choices run
    their multi-tensor kernel on ``params`` (``None``, ``None``: torch's default, multi-tensor on
    accelerators)."""
    if fused:
        return False
    if foreach is None and fused is None:
        return _default_to_fused_or_foreach(list(params), differentiable=False, use_fused=False)[1]
    return bool(foreach)


def adam_foreach(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor] | None,
    steps: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None, list[torch.Tensor]]:
    """One Adam (``decoupled``: AdamW) step into new tensors, the inputs untouched:
    ``(params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs or None, steps)``.

    With ``t`` the new step count, ``g`` the gradient (negated for ``maximize``, plus
    ``weight_decay * p`` unless ``decoupled``): ``m = lerp(m, g, 1 - beta1)``,
    ``v = beta2 v + (1 - beta2) g^2`` (``v_max = max(v_max, v)`` with amsgrad),
    ``p = p (1 - lr weight_decay)`` if ``decoupled``, then
    ``p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``.
    Runs under ``torch.no_grad`` (the caller's eager step)."""
    with torch.no_grad():
        if maximize:
            grads = torch._foreach_neg(grads)
        steps = torch._foreach_add(steps, 1.0)
        if weight_decay != 0:
            if decoupled:
                params = torch._foreach_mul(params, 1 - lr * weight_decay)
            else:
                grads = torch._foreach_add(grads, params, alpha=weight_decay)
        decayed = decoupled and weight_decay != 0  # params are new tensors already
        exp_avgs = torch._foreach_lerp(exp_avgs, grads, 1 - beta1)
        exp_avg_sqs = torch._foreach_mul(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        counts = [step.item() for step in steps]
        step_size = [(lr / (1 - beta1**count)) * -1 for count in counts]
        bias_correction2_sqrt = [(1 - beta2**count) ** 0.5 for count in counts]
        if max_exp_avg_sqs is not None:
            max_exp_avg_sqs = torch._foreach_maximum(max_exp_avg_sqs, exp_avg_sqs)
            denominators = torch._foreach_sqrt(max_exp_avg_sqs)
        else:
            denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denominators, bias_correction2_sqrt)
        torch._foreach_add_(denominators, eps)
        if decayed:
            torch._foreach_addcdiv_(params, exp_avgs, denominators, step_size)
        else:
            params = torch._foreach_addcdiv(params, exp_avgs, denominators, step_size)
    maxima = None if max_exp_avg_sqs is None else list(max_exp_avg_sqs)
    return list(params), list(exp_avgs), list(exp_avg_sqs), maxima, list(steps)


def sgd_foreach(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffers: list[torch.Tensor] | None,
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """One SGD step without dampening into new tensors, the inputs untouched:
    ``(params, momentum buffers or None)``. With ``g`` the gradient (negated for
    ``maximize``, plus ``weight_decay * p``): ``b = momentum b + g``, the step
    direction ``d = g + momentum b`` (``nesterov``) or ``b``, ``p = p - lr d``
    (without momentum ``d = g``). Runs under ``torch.no_grad``."""
    with torch.no_grad():
        if maximize:
            grads = torch._foreach_neg(grads)
        if weight_decay != 0:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
        if momentum != 0:
            momentum_buffers = torch._foreach_mul(momentum_buffers, momentum)
            torch._foreach_add_(momentum_buffers, grads, alpha=1.0)  # (torch's 1 - dampening)
            grads = torch._foreach_add(grads, momentum_buffers, alpha=momentum) if nesterov else momentum_buffers
        params = torch._foreach_add(params, grads, alpha=-lr)
    return list(params), None if momentum_buffers is None else list(momentum_buffers)
