"""Which of torch's kernels a step runs, and the workarounds around them.

- whether a step is recorded (:func:`step_recorded`: while ``torch.compile`` traces,
  under a ``torch.func`` transform, or ``differentiable`` with autograd on) and then
  which kernel form it takes;
- torch's fused and multi-tensor kernels where they run, and where they do not
  (a recorded step);
- the workaround for torch 2.13's inductor on the CPU (:func:`l2_while_compiling`) and
  the probe of its fused SGD kernel on 16-bit CPU tensors (:func:`cpu_fused_sgd_sound`,
  run once per dtype, off the step path);
- whether a pure update runs :mod:`puredist.optim._out_of_place`'s twins of the
  multi-tensor kernels (:func:`steps_out_of_place`);
- the ``vmap`` rule torch 2.13 lacks for ``prims::fma``, which a compiled Adam step
  runs (:func:`batch_fused_multiply_add`).

This module must not validate arguments nor keep state: it chooses, the algorithms
(the modules ``puredist.optim.sgd`` and ``puredist.optim.adam``) run.
"""

import functools
import operator
from typing import Callable, Sequence

import torch
from torch.optim.sgd import sgd as _sgd_kernel

from puredist._seq import any_none
from puredist._transforms import is_transformed, transforms_active
from puredist.optim._out_of_place import runs_foreach


def step_recorded(tensors: Callable[[], list[torch.Tensor]], differentiable: bool) -> bool:
    """Whether the update must be recorded: while ``torch.compile`` traces (the traced
    code cannot tell whether a ``vmap`` maps its tensors: dynamo traces the ``vmap``
    itself, and its batched tensors take no in-place multi-tensor op; the recorded
    form runs with or without one), where a tensor of ``tensors()`` is wrapped by a
    ``torch.func`` transform (``grad``, ``vmap``, ...), or where the optimizer is
    ``differentiable``, autograd is on and a tensor requires grad. ``tensors`` is called
    only where that can be (no transform running, autograd off: no pass over them)."""
    if torch.compiler.is_compiling() or (transforms_active() and any(map(is_transformed, tensors()))):
        return True
    return differentiable and torch.is_grad_enabled() and any(t.requires_grad for t in tensors())


def grads_for(fused: bool | None, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> Sequence:
    """``grads`` as the kernel takes them: for torch's fused kernel each laid out like
    its parameter (a copy where its strides differ). That kernel pairs a parameter's
    elements with its gradient's by their place in memory, so a transposed parameter
    with a contiguous gradient (a pseudo-gradient, a gradient from ``torch.func``)
    would be stepped with other elements' gradients; ``torch.optim`` never meets one,
    as autograd lays a ``.grad`` out like its parameter."""
    if not fused or (not any_none(grads) and list(map(_STRIDE, params)) == list(map(_STRIDE, grads))):
        return grads  # (C-level: no Python frame per tensor)
    return [g if g is None or g.stride() == p.stride() else torch.empty_like(p, dtype=g.dtype).copy_(g)
            for p, g in zip(params, grads)]


_STRIDE = torch.Tensor.stride  # (C-level: no Python frame per tensor)


def l2_while_compiling(params, grads, weight_decay: float, maximize: bool) -> tuple[list, float, bool]:
    """``(grads, weight_decay, maximize)`` for torch's kernel. While ``torch.compile``
    traces, the L2 term is added here, per tensor (``vmap`` maps no multi-tensor op),
    in torch's order (negate for ``maximize``, then add ``weight_decay * param``),
    written as a subtraction (the same bits eagerly: ATen's ``sub`` is ``add`` with
    ``-alpha``), and the kernel gets neither: inductor (torch 2.13, CPU) miscompiles
    the kernel's ``grad.add(param, alpha=weight_decay)`` after a matmul, in a graph
    that takes ``torch.func.grad`` (0.2 off after one step). Eagerly: as given."""
    if not weight_decay or not torch.compiler.is_compiling():
        return grads, weight_decay, maximize
    return [(g.neg() if maximize else g).sub(p, alpha=-weight_decay) for p, g in zip(params, grads)], 0.0, False


@functools.cache
def cpu_fused_sgd_sound(dtype: torch.dtype) -> bool:
    """Whether torch's fused SGD kernel on a CPU steps ``dtype`` tensors as its
    multi-tensor kernel does, within a few units in the last place."""
    gen = torch.Generator().manual_seed(0)
    start, grad = (torch.randn(64, generator=gen).to(dtype) for _ in range(2))
    stepped = []
    for fused in (True, False):
        param = start.clone()
        _sgd_kernel([param], [grad.clone()], [None], foreach=not fused, fused=fused, weight_decay=0.0, momentum=0.0,
                    lr=0.5, dampening=0.0, nesterov=False, maximize=False)
        stepped.append(param.double())
    return bool(torch.allclose(stepped[0], stepped[1], rtol=4 * torch.finfo(dtype).eps, atol=0.0))


_OUT_OF_PLACE_DTYPES = frozenset({torch.float32, torch.float64})
"""Where :mod:`puredist.optim._out_of_place` equals torch's in-place kernels bit for bit: a
16-bit in-place multiply rounds its scalar to the tensor's dtype first, the
out-of-place one does not (on a CPU, bf16 ``x * 0.9`` differs in most elements)."""


def steps_out_of_place(params, grads, foreach: bool | None, fused: bool | None, *hypers) -> bool:
    """Whether a pure update runs :mod:`puredist.optim._out_of_place`'s step: eagerly, where
    torch would run its multi-tensor kernel, on fp32/fp64 parameters with dense
    gradients for all of them, no hyper-parameter a schedule (the caller asks for an
    unrecorded step only: never while ``torch.compile`` traces). (Every pass over the
    leaves is a C-level ``map``: no Python frame per leaf.)"""
    return not (any(map(callable, hypers))
                or any_none(grads) or any(map(IS_SPARSE, grads)) or not runs_foreach(params, foreach, fused)
                or not all(map(_OUT_OF_PLACE_DTYPES.__contains__, map(DTYPE, params))))


IS_SPARSE, DTYPE, IS_CPU = operator.attrgetter("is_sparse"), operator.attrgetter("dtype"), operator.attrgetter("is_cpu")


@functools.cache
def batch_fused_multiply_add() -> None:
    """Give torch's ``prims::fma`` a ``vmap`` rule where torch has none (2.13), once per
    process. ``torch.compile`` rewrites Adam's ``addcmul_(..., value=)`` and
    ``addcdiv_(..., value=)`` as that op; without a rule ``vmap`` runs it replica by
    replica, printing a "performance drop" warning from C++ each time it is traced.
    The op is elementwise, so the rule is the op on the batched operands, broadcast:
    the same values, one op. Imports ``torch._inductor.inductor_prims`` (about 1 s, that
    ``torch.compile`` imports anyway); nothing where torch has no such op or a rule."""
    try:
        from torch._inductor import inductor_prims
    except ImportError:  # pragma: no cover - a torch without inductor
        return
    fma = getattr(inductor_prims, "fma", None)
    if fma is None or torch._C._dispatch_has_kernel_for_dispatch_key(fma.name(), "FuncTorchBatched"):
        return

    def batched(info, in_dims, *operands):
        """Each tensor operand with its batch dimension first (1 where unmapped) and its
        other dimensions aligned on the right, as broadcasting aligns them."""
        ranks = [x.dim() - (d is not None) if isinstance(x, torch.Tensor) else 0 for x, d in zip(operands, in_dims)]
        aligned = [x if not isinstance(x, torch.Tensor) else
                   _aligned(x.movedim(d, 0) if d is not None else x.unsqueeze(0), max(ranks) - rank)
                   for x, d, rank in zip(operands, in_dims, ranks)]
        return fma(*aligned), 0

    torch.library.register_vmap(fma, batched)


def _aligned(x: torch.Tensor, missing: int) -> torch.Tensor:
    """``x`` (its batch dimension first) with ``missing`` dimensions of 1 after it."""
    return x.reshape(x.shape[:1] + (1,) * missing + x.shape[1:])
