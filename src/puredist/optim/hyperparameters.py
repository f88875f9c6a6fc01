"""Hyper-parameter schedules: a hyper-parameter may be a callable of the step count,
read on the host at each update and checked like the number it stands for, before
anything is stepped.

This module must not step anything itself: :func:`with_schedules` groups the parameters
by count and hands each group's values to the algorithm's ``run``.
"""

from itertools import repeat
from typing import Any, Callable, NamedTuple, Sequence

import torch

from puredist._transforms import transforms_active, vmap_levels
from puredist._validation import check_schedules
from puredist.optim._checks import counts_of


def read_counts(states: Sequence[NamedTuple], why: str) -> list[int]:
    """The step counts of ``states``, read on the host (``why`` needs them).

    Raises:
        TypeError: a state counts no steps (made by an optimizer that keeps no count).
        NotImplementedError: a count mapped by a ``torch.func`` transform, which hides it.
    """
    counts = counts_of(states, why)
    transformed = transforms_active()
    if transformed and any(map(vmap_levels, counts)):  # (grad keeps one value: read it)
        raise NotImplementedError(
            f"{why}, read on the host, which a torch.func transform hides when it maps the count. "
            "Every replica has taken the same steps: map the counts with in_dims=None (each per-parameter state's "
            "count), e.g. axes = puredist.optim.state_axes(state), "
            "vmap(opt.update, in_dims=(0, 0, axes), out_dims=(0, axes))."
        )
    if len(counts) > 1 and not transformed and _stackable(counts):
        # one read for all (on a GPU, where fused kernels keep the counts, each read waits for the device)
        return [int(count) for count in torch.stack(counts).tolist()]
    return [int(count) for count in counts]


def _stackable(values: Sequence[object]) -> bool:
    """Whether ``values`` are 0-dim tensors of one dtype on one device with values
    (one ``torch.stack`` takes them as they are: no conversion, no meta tensor)."""
    if not all(map(isinstance, values, repeat(torch.Tensor))):
        return False
    first = values[0]
    return first.device.type != "meta" and {(v.device, v.dtype, v.dim()) for v in values} == {(first.device, first.dtype, 0)}


Step = Callable[[list[torch.Tensor], list[torch.Tensor], list[NamedTuple], bool], list[NamedTuple]]
"""``step(params, grads, states, traced)`` runs torch's kernel in place on ``params`` and
the states' tensors; ``traced``: single-tensor kernels in their differentiable form
(no host reads of the step count), recorded by autograd and functorch."""


Hyper = float | Callable[[int], float]
"""A hyper-parameter: a number, or a schedule of the step count."""


def with_schedules(
    hypers: dict[str, Hyper],
    run: Callable[..., list[NamedTuple]],
    check: Callable[[list, bool], None],
    validate: Callable[[str, Any], None],
) -> tuple[Step, Callable[[Sequence[NamedTuple]], None]]:
    """``(step, check_states)``. ``step`` calls ``check(params, traced)``, then
    ``run(params, grads, states, traced, **values)``: once with ``hypers`` as they are,
    or, where some are schedules, once per group of parameters at the same count (a
    parameter skipped for want of a gradient keeps its own), with each schedule's value
    at that count, every value first passed to ``validate(name, value)`` (so nothing
    is stepped unless all are good). ``check_states(states)`` runs that validation
    alone, stepping nothing."""
    scheduled = [name for name, value in hypers.items() if callable(value)]

    def counts_of(states) -> list[int]:
        return read_counts(states, f"Arg ``{scheduled[0]}`` is a schedule of the step count")

    def step(params, grads, states, traced):
        check(params, traced)
        if not scheduled:
            return run(params, grads, states, traced, **hypers)
        counts = counts_of(states)
        groups = check_schedules(hypers, counts, validate)
        new = list(states)
        for count, values in groups.items():
            group = [k for k, c in enumerate(counts) if c == count]
            stepped = run([params[k] for k in group], [grads[k] for k in group], [states[k] for k in group], traced,
                          **values)
            for k, state in zip(group, stepped):
                new[k] = state
        return new

    def check_states(states: Sequence[NamedTuple]) -> None:
        """Raise ``ValueError`` where a step of parameters with these per-parameter
        states would (a schedule's value at their counts out of range); step nothing."""
        check_schedules(hypers, counts_of(states) if scheduled and states else (), validate)

    return step, check_states
