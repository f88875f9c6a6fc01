"""Whether ``torch.func`` transforms run around a call, and which wrap a tensor: a
transformed tensor's values cannot be read on the host, nor its memory, so the
checks, the kernels' choice and the schedules ask here first. Reads functorch's
private interpreter stack and wrapper queries (``torch._C._functorch``) once per call.

This module must not import anything of puredist.
"""

from __future__ import annotations

import torch


def transforms_active() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``, ...) is running around
    this call: only then can a tensor be wrapped by one. One look at functorch's
    interpreter stack (private: ``torch._C._functorch.peek_interpreter_stack``, as
    ``torch._functorch.pyfunctorch`` reads it), instead of one per tensor. ``False``
    while ``torch.compile`` traces (a compiled function sees plain tensors)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._functorch.peek_interpreter_stack() is not None


def vmap_levels(tensor: torch.Tensor) -> set[int]:
    """The levels of the ``vmap`` transforms that map ``tensor``, looked for through
    any other wrappers (``torch.func.grad``'s keep one value). (private:
    ``torch._C._functorch``'s wrapper queries)"""
    functorch, levels = torch._C._functorch, set()
    while functorch.is_functorch_wrapped_tensor(tensor):
        if functorch.is_batchedtensor(tensor):
            levels.add(functorch.maybe_get_level(tensor))
        tensor = functorch.get_unwrapped(tensor)
    return levels


def is_transformed(tensor: object) -> bool:
    """Whether ``tensor`` is wrapped by a ``torch.func`` transform (mapped by ``vmap``,
    tracked by ``grad``): its values cannot be read on the host, nor its memory.
    (private: ``torch._C._functorch.is_functorch_wrapped_tensor``)"""
    return (
        transforms_active()
        and isinstance(tensor, torch.Tensor)
        and torch._C._functorch.is_functorch_wrapped_tensor(tensor)
    )
