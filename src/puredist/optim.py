"""Functional optimizers over explicit state: SGD, Adam, AdamW.

Each constructor validates its hyper-parameters and returns an :class:`Optimizer`:

- ``init(params) -> state``: a tree shaped like ``params`` holding one per-parameter
  state (a NamedTuple) where ``params`` holds a tensor (optax's layout:
  ``init({"w": w})["w"]`` is ``w``'s state);
- ``update(params, grads, state) -> (params, state)``: pure; new tensors, inputs
  untouched;
- ``update_(params, grads, state) -> state``: writes the new values into ``params``'
  own storage (and updates the state's tensors in place).

``params`` and ``grads`` are pytrees of the same structure; a ``None`` in ``grads``
where ``params`` has a tensor leaves that parameter and its state unchanged, as
``torch.optim`` skips parameters without ``.grad``. Because the state is per parameter, any sub-list of parameters can be
stepped with the matching sub-list of states (a flat sequence of per-parameter states
is taken for any tree): that is how ZeRO steps only the parameters a rank owns.

Each takes schedules, as optax does: ``lr``, ``weight_decay``, SGD's ``momentum`` and
Adam's ``betas`` (a pair) may be callables of the step count (the updates this
parameter has had, from 0), read on the host each update and checked like the numbers
they stand for, before anything is stepped; at update ``k`` the rate is ``lr(k)``
(``torch.optim``'s ``LambdaLR`` with ``lambda k: lr(k) / base_lr``; the others are
torch's param group's values set before each step). Adam's state counts its steps
anyway; SGD's state holds a count (``step``) only with a schedule or dampened momentum.
Under ``torch.func.vmap`` a schedule needs the counts unmapped (``in_dims=None`` for
``step``: every replica has taken the same steps).

Each constructor also takes ``differentiable`` (default False): with True, ``update``
records its step for autograd (differentiate through it, as under ``torch.func``
transforms, where it is always recorded); without, its new parameters are fresh leaves.

The math is torch's own: the steps call ``torch.optim``'s functional kernels
(``torch.optim.sgd.sgd``, ``torch.optim.adam.adam``) with the same foreach/fused
defaults as the ``torch.optim`` classes, so a run matches ``torch.optim.SGD`` /
``Adam`` / ``AdamW`` step for step.

This module must not communicate: an optimizer steps the tensors it is given, on
this rank (distribution is :mod:`puredist.zero_sharded`'s and :mod:`puredist.outer`'s).
"""

import functools
import operator
from itertools import repeat
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch.optim.adam import adam as _adam_kernel
from torch.optim.optimizer import _get_scalar_dtype
from torch.optim.sgd import sgd as _sgd_kernel

from puredist._dtensors import dtensor_type
from puredist._inputs import is_transformed, transforms_active, vmap_levels
from puredist._out_of_place import adam_foreach, runs_foreach, sgd_foreach
from puredist.tree import PyTree, tree_flatten, tree_unflatten
from puredist._docs import fields_documented


@fields_documented
class SGDParamState(NamedTuple):
    """SGD state of one parameter, with momentum (torch's layout).

    Attributes:
        momentum_buffer: the momentum buffer: zeros (``-0.0``) from ``init`` (the first
            step then makes it the gradient, as torch's first step does). ``None`` is
            taken as input (a state from before torch's first step) and never returned.
    """

    momentum_buffer: torch.Tensor | None


@fields_documented
class SGDCountedParamState(NamedTuple):
    """SGD state of one parameter, with momentum and a step count: with a schedule or
    dampened momentum (the count tells the first step, which takes the gradient
    undamped).

    Attributes:
        momentum_buffer: as :class:`SGDParamState`'s.
        step: the updates taken, a 0-dim float32 CPU tensor (as Adam's).
    """

    momentum_buffer: torch.Tensor | None
    step: torch.Tensor


@fields_documented
class SGDCountParamState(NamedTuple):
    """SGD state of one parameter without momentum, with a schedule.

    Attributes:
        step: the updates taken, a 0-dim float32 CPU tensor.
    """

    step: torch.Tensor


class SGDNoParamState(NamedTuple):
    """SGD state of one parameter without momentum or schedule: nothing (as optax's
    ``EmptyState``)."""


@fields_documented
class AdamParamState(NamedTuple):
    """Adam/AdamW state of one parameter (torch's layout).

    Attributes:
        step: the number of steps taken, a 0-dim float32 CPU tensor.
        exp_avg: first-moment running average.
        exp_avg_sq: second-moment running average.
    """

    step: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


@fields_documented
class AMSGradParamState(NamedTuple):
    """Adam/AdamW state of one parameter with amsgrad (torch's layout).

    Attributes:
        step, exp_avg, exp_avg_sq: as :class:`AdamParamState`'s.
        max_exp_avg_sq: the running max of ``exp_avg_sq``.
    """

    step: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor


_PARAM_STATES = (SGDParamState, SGDCountedParamState, SGDCountParamState, SGDNoParamState, AdamParamState,
                 AMSGradParamState)
"""Every per-parameter state holds tensors only, no ``None`` field (a configuration
that keeps no buffer or count has a state without that field), so that plain
``torch.func.vmap`` maps them (as optax's states)."""
_PARAM_STATE_TYPES = set(_PARAM_STATES)


@fields_documented
class Optimizer(NamedTuple):
    """A functional optimizer (see the module docstring).

    Attributes:
        init: ``init(params) -> state``: per-parameter states in a tree shaped like ``params``.
        update: ``update(params, grads, state) -> (params, state)``: pure.
        update_: ``update_(params, grads, state) -> state``: steps ``params`` in place.
        config: what it is, its kind and every hyper-parameter (a schedule shown as
            ``<schedule>``), e.g. ``"sgd(lr=0.7, momentum=0.9, ...)"``: what the outer
            optimizer's rank check and checkpoints compare; ``""`` for one built by hand.
        check: ``check(states, params=None, grads=None)`` raises ``ValueError`` where
            a step of parameters with these per-parameter states would (a schedule's
            value at their counts out of range; given the parameters and their
            gradients, aligned with ``states``, also a state or a gradient of another
            shape, or a sparse gradient an optimizer takes none of), stepping nothing:
            what ZeRO runs on every rank before its rank check, so that a rank owning
            nothing learns an owner's refusal instead of waiting for its broadcast.
            ``None``: nothing to check (one built by hand).
        elementwise: each element's step depends on that element's parameter,
            gradient and state only (no norm, no per-tensor statistic), so that a step
            of tensors laid end to end in one buffer equals the step of each: what
            lets DiLoCo step a fragment's global copy as one tensor
            (:mod:`puredist.outer.flat`). ``False`` for one built by hand unless it
            says so.
    """

    init: Callable[[PyTree], PyTree]
    update: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]
    update_: Callable[[PyTree, PyTree, PyTree], PyTree]
    config: str = ""
    check: Callable[..., None] | None = None
    elementwise: bool = False


def _config(kind: str, **hypers: Any) -> str:
    """``kind(name=value, ...)``, a schedule shown as ``<schedule>`` (a function's repr
    differs between processes; its values are checked where they are used)."""
    return f"{kind}(" + ", ".join(f"{k}={'<schedule>' if callable(v) else v!r}" for k, v in hypers.items()) + ")"


_Step = Callable[[list[torch.Tensor], list[torch.Tensor], list[NamedTuple], bool], list[NamedTuple]]
"""``step(params, grads, states, traced)`` runs torch's kernel in place on ``params`` and
the states' tensors; ``traced``: single-tensor kernels in their differentiable form
(no host reads of the step count), recorded by autograd and functorch."""


def _traced(tensors: Callable[[], list[torch.Tensor]], differentiable: bool) -> bool:
    """Whether the update must be recorded: a tensor of ``tensors()`` is wrapped by a
    ``torch.func`` transform (``grad``, ``vmap``, ...), or the optimizer is
    ``differentiable``, autograd is on and a tensor requires grad. ``tensors`` is called
    only where that can be (no transform running, autograd off: no pass over them)."""
    if transforms_active() and any(map(is_transformed, tensors())):
        return True
    return differentiable and torch.is_grad_enabled() and any(t.requires_grad for t in tensors())


def _fused_here(fused: bool | None, traced: bool) -> bool | None:
    """``fused`` where torch's fused kernel can run: not in a recorded step (it has no
    differentiable form), nor while ``torch.compile`` traces (the kernel is opaque to
    the compiler, which fuses torch's multi-tensor form itself)."""
    return False if traced or torch.compiler.is_compiling() else fused


def _grads_for(fused: bool | None, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> Sequence:
    """``grads`` as the kernel takes them: for torch's fused kernel each laid out like
    its parameter (a copy where its strides differ). That kernel pairs a parameter's
    elements with its gradient's by their place in memory, so a transposed parameter
    with a contiguous gradient (a pseudo-gradient, a gradient from ``torch.func``)
    would be stepped with other elements' gradients; ``torch.optim`` never meets one,
    as autograd lays a ``.grad`` out like its parameter."""
    if not fused or (not _any_none(grads) and list(map(_STRIDE, params)) == list(map(_STRIDE, grads))):
        return grads  # (C-level: no Python frame per tensor)
    return [g if g is None or g.stride() == p.stride() else torch.empty_like(p, dtype=g.dtype).copy_(g)
            for p, g in zip(params, grads)]


_STRIDE = torch.Tensor.stride


def _sgd_foreach_here(foreach: bool | None, traced: bool) -> bool | None:
    """SGD's multi-tensor choice: off in a recorded step (the for-loop kernel has the
    differentiable form), on while ``torch.compile`` traces: inductor (torch 2.13, CPU)
    miscompiles the for-loop kernel's ``param.add_(grad, alpha=-lr)`` in a graph that
    also takes ``torch.func.grad`` (13.0 off after three steps of plain SGD); the
    multi-tensor form compiles exactly (1e-7)."""
    if traced:
        return False
    return True if torch.compiler.is_compiling() else foreach


def _l2_while_compiling(params, grads, weight_decay: float, maximize: bool, traced: bool) -> tuple[list, float, bool]:
    """``(grads, weight_decay, maximize)`` for torch's kernel. While ``torch.compile``
    traces, the L2 term is added here, as one multi-tensor op in torch's own order
    (negate for ``maximize``, then add ``weight_decay * param``), and the kernel gets
    neither: inductor (torch 2.13, CPU) miscompiles the for-loop kernel's
    ``grad.add(param, alpha=weight_decay)`` in a graph that also takes
    ``torch.func.grad`` (0.2 off after one step); Adam's multi-tensor kernel does not
    compile on the CPU (its step counts), so the for-loop kernel runs, with this term
    taken out of it. Eagerly: as given."""
    if traced or not weight_decay or not torch.compiler.is_compiling():
        return grads, weight_decay, maximize
    if maximize:
        grads = torch._foreach_neg(grads)
    return torch._foreach_add(grads, params, alpha=weight_decay), 0.0, False


def _check_nonnegative(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:  # (NaN too)
        raise ValueError(f"Arg ``{name}`` must be a non-negative number, got {value!r}.")


def _check_betas(betas: Any) -> None:
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(map(_is_beta, betas))):
        raise ValueError(f"Arg ``betas`` must be two numbers in [0, 1), got {betas!r}.")


def _is_beta(value: Any) -> bool:
    try:
        return bool(0.0 <= value < 1.0)
    except (TypeError, RuntimeError):  # not a number (a string, None, a tensor of several values)
        return False


def _check_kernel_choice(foreach: bool | None, fused: bool | None) -> None:
    if foreach and fused:
        raise ValueError(f"Args ``foreach`` ({foreach}) and ``fused`` ({fused}) cannot both be True: pick one kernel.")


def _check_counted(states: Sequence[NamedTuple], why: str) -> None:
    """Raise ``TypeError`` unless every state counts its steps (``why`` needs them)."""
    uncounted = [k for k, s in enumerate(states) if getattr(s, "step", None) is None]
    if uncounted:
        raise TypeError(
            f"Arg ``state``: parameter {uncounted[0]}'s state counts no steps (made by an optimizer that keeps no "
            f"count, e.g. loaded from its checkpoint); {why}: init a new state."
        )


def _read_counts(states: Sequence[NamedTuple], why: str) -> list[int]:
    """The step counts of ``states``, read on the host (``why`` needs them).

    Raises:
        TypeError: a state counts no steps (made by an optimizer that keeps no count).
        NotImplementedError: a count mapped by a ``torch.func`` transform, which hides it.
    """
    _check_counted(states, why)
    transformed = transforms_active()
    if transformed and any(vmap_levels(s.step) for s in states):  # (grad keeps one value: read it)
        raise NotImplementedError(
            f"{why}, read on the host, which a torch.func transform hides when it maps the count. "
            "Every replica has taken the same steps: map the counts with in_dims=None (each per-parameter state's "
            "``step``), e.g. for a list of parameters axes = [a._replace(step=None) for a in "
            "puredist.tree.vmap_axes(state)], "
            "vmap(opt.update, in_dims=(0, 0, axes), out_dims=(0, axes))."
        )
    counts = [s.step for s in states]
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


Hyper = float | Callable[[int], float]
"""A hyper-parameter: a number, or a schedule of the step count."""


def _scheduled(
    hypers: dict[str, Hyper],
    run: Callable[..., list[NamedTuple]],
    check: Callable[[list, bool], None],
    validate: Callable[[str, Any], None],
) -> tuple[_Step, Callable[[Sequence[NamedTuple]], None]]:
    """``(step, check_states)``. ``step`` calls ``check(params, traced)``, then
    ``run(params, grads, states, traced, **values)``: once with ``hypers`` as they are,
    or, where some are schedules, once per group of parameters at the same count (a
    parameter skipped for want of a gradient keeps its own), with each schedule's value
    at that count, every value first passed to ``validate(name, value)`` (so nothing
    is stepped unless all are good). ``check_states(states)`` runs that validation
    alone, stepping nothing."""
    scheduled = [name for name, value in hypers.items() if callable(value)]

    def values_by_count(states) -> tuple[list[int], dict[int, dict[str, Any]]]:
        counts = _read_counts(states, f"Arg ``{scheduled[0]}`` is a schedule of the step count")
        groups = {}
        for count in sorted(set(counts)):
            values = {name: value(count) if callable(value) else value for name, value in hypers.items()}
            for name in scheduled:
                validate(name, values[name])
            groups[count] = values
        return counts, groups

    def step(params, grads, states, traced):
        check(params, traced)
        if not scheduled:
            return run(params, grads, states, traced, **hypers)
        counts, groups = values_by_count(states)
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
        if scheduled and states:
            values_by_count(states)

    return step, check_states


def _check_fused_takes(params: Sequence[torch.Tensor], fused: bool | None, name: str) -> None:
    """Raise, naming the argument, before anything is stepped where torch's fused
    kernel would raise its own ``NotImplementedError`` from inside the step: it has no
    complex kernels."""
    if not fused or not _any_complex(params):
        return
    complex_ = [i for i, p in enumerate(params) if p.is_complex()]
    if complex_:
        raise TypeError(
            f"Arg ``fused`` of {name}: torch's fused kernel takes no complex parameters (parameter {complex_[0]} "
            f"is {params[complex_[0]].dtype}); nothing was stepped. Use fused=None (foreach or the for-loop kernel)."
        )


_HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})


def _check_fused_sgd_takes(params: Sequence[torch.Tensor], fused: bool | None) -> None:
    """:func:`_check_fused_takes`, and what torch's fused SGD kernel would get wrong or
    refuse from inside the step: DTensor parameters (no sharding rule for it), and
    16-bit parameters on a CPU where the installed torch's kernel disagrees with its
    multi-tensor kernel (torch 2.13's steps a 16-element bf16 tensor 2.4 off after one
    step at lr 0.7; probed once per dtype)."""
    _check_fused_takes(params, fused, "sgd")
    if not fused or torch.compiler.is_compiling():  # (compiled, the fused kernel does not run)
        return
    dtensor = dtensor_type()
    if dtensor is not None and any(map(isinstance, params, repeat(dtensor))):
        raise TypeError(
            "Arg ``fused`` of sgd: torch's fused SGD kernel takes no DTensor parameters (it has no sharding rule); "
            "nothing was stepped. Use fused=None (foreach or the for-loop kernel)."
        )
    if _HALF_DTYPES.isdisjoint(map(_DTYPE, params)) or not any(map(_IS_CPU, params)):
        return  # (C-level: no Python frame per parameter on the usual path)
    wrong = [i for i, p in enumerate(params) if p.is_cpu and p.dtype in _HALF_DTYPES and not _cpu_fused_sgd_sound(p.dtype)]
    if wrong:
        raise ValueError(
            f"Arg ``fused`` of sgd: torch {torch.__version__}'s fused SGD kernel on a CPU steps {params[wrong[0]].dtype} "
            f"tensors wrongly (parameter {wrong[0]}: it disagrees with its multi-tensor kernel by far more than "
            "rounding); nothing was stepped. Use fused=None (foreach or the for-loop kernel)."
        )


@functools.cache
def _cpu_fused_sgd_sound(dtype: torch.dtype) -> bool:
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


def copies(tensors: Sequence[torch.Tensor], *, recorded: bool = False) -> list[torch.Tensor]:
    """Fresh copies of ``tensors`` (values, bits and strides): one multi-tensor kernel
    on a GPU, where a clone per tensor would cost a launch and the host's time for
    each. ``recorded``: clones that autograd and ``torch.func`` transforms record."""
    if recorded:
        return [t.clone() for t in tensors]
    with torch.no_grad():
        if len(tensors) > 1 and all(t.is_cuda for t in tensors):
            return list(torch._foreach_mul(tensors, 1))  # x * 1 is x exactly: -0.0, inf and subnormals too
        return [t.clone() for t in tensors]


def clone_states(states: Sequence[NamedTuple], *, recorded: bool = False) -> list[NamedTuple]:
    """Copies of per-parameter states (NamedTuples of one kind), field by field
    (``recorded``: as for :func:`copies`)."""
    if not states or not states[0]._fields:
        return list(states)  # (a state with no field holds nothing to copy)
    columns = []
    for column in zip(*states):
        if not _any_none(column):
            columns.append(copies(column, recorded=recorded))
        elif all(map(operator.is_, column, repeat(None))):
            columns.append(column)
        else:
            columns.append([None if t is None else t.clone() for t in column])
    return _states_of(type(states[0]), *columns)


def _per_leaf(spec, state: PyTree, count: int) -> list[NamedTuple]:
    """``state``'s per-parameter states in leaf order. ``state`` is shaped like the
    params tree (as ``init`` returns it) or, as ZeRO and the outer optimizer pass
    their sub-lists, a flat sequence of per-parameter states (told apart by type, with
    no exception on the way: this runs at every step)."""
    flat = isinstance(state, (tuple, list)) and not isinstance(state, _PARAM_STATES)
    if flat and set(map(type, state)) <= _PARAM_STATE_TYPES:
        states = list(state)
    else:
        try:
            states = spec.flatten_up_to(state)
        except (ValueError, TypeError) as error:
            raise ValueError(
                f"Arg ``state`` must be shaped like ``params`` ({count} parameters, structure {spec}), as init "
                f"returns it; got a {type(state).__name__} that is not."
            ) from error
    if len(states) != count or not set(map(type, states)) <= _PARAM_STATE_TYPES:
        if states and all(isinstance(s, torch.Tensor) for s in states):
            raise ValueError(
                "Arg ``state`` holds tensors where per-parameter states belong: were the arguments given in optax's "
                "order, update(grads, state, params)? puredist's is update(params, grads, state), as torch.optim's "
                "step updates the parameters."
            )
        raise ValueError(f"Arg ``state`` holds {len(states)} parameter states for {count} parameters.")
    return states


_BUFFER = {SGDParamState: "momentum_buffer", SGDCountedParamState: "momentum_buffer", AdamParamState: "exp_avg",
           AMSGradParamState: "exp_avg"}


def _sgd_state(buffer: torch.Tensor | None, count: torch.Tensor | None) -> NamedTuple:
    """The SGD state of one parameter holding what it has (no ``None`` field)."""
    if buffer is not None:
        return SGDParamState(buffer) if count is None else SGDCountedParamState(buffer, count)
    return SGDNoParamState() if count is None else SGDCountParamState(count)


def _check_shapes(leaves: Sequence[torch.Tensor], states: Sequence[NamedTuple]) -> None:
    """Raise ``ValueError``, before anything is stepped, where a per-parameter state's
    buffer has another shape than its parameter (a state made for other parameters:
    the kernels would step some parameters, then fail)."""
    kinds = set(map(type, states))
    if len(kinds) != 1:
        return
    field = _BUFFER.get(kinds.pop())
    if field is None:  # SGD without momentum: nothing shaped like the parameters
        return
    buffers = [getattr(state, field) for state in states]  # (comprehensions: torch.compile traces them)
    if not buffers or buffers[0] is None:  # SGD before its first step: no buffer yet
        return
    if [b.shape for b in buffers] == [p.shape for p in leaves]:
        return
    i = next(i for i, (b, p) in enumerate(zip(buffers, leaves)) if b.shape != p.shape)
    raise ValueError(
        f"Arg ``state``: parameter {i} has shape {tuple(leaves[i].shape)}, its state's buffers "
        f"{tuple(buffers[i].shape)}: a state made by init for other parameters. Nothing was stepped."
    )


def _check_grads(leaves: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], name: str,
                 takes_sparse: bool) -> None:
    """Raise ``ValueError``, before anything is stepped, where a gradient (``None``
    skips its parameter) has another shape than its parameter, or is sparse for an
    optimizer that takes none (as ``torch.optim.Adam`` refuses)."""
    shapes = [None if g is None else g.shape for g in grads]  # (comprehensions: torch.compile traces them)
    if shapes != [p.shape if s is not None else None for p, s in zip(leaves, shapes)]:
        i = next(i for i, (s, p) in enumerate(zip(shapes, leaves)) if s is not None and s != p.shape)
        raise ValueError(
            f"Arg ``grads``: gradient {i} has shape {tuple(shapes[i])}, its parameter {tuple(leaves[i].shape)}. "
            "Nothing was stepped."
        )
    if not takes_sparse and any(map(getattr, grads, repeat("is_sparse"), repeat(False))):
        i = next(i for i, g in enumerate(grads) if g is not None and _IS_SPARSE(g))
        raise ValueError(
            f"Arg ``grads``: gradient {i} is sparse; {name} takes dense gradients only (torch.optim's neither: "
            "consider torch.optim.SparseAdam). Nothing was stepped."
        )


_OUT_OF_PLACE_DTYPES = frozenset({torch.float32, torch.float64})
"""Where :mod:`puredist._out_of_place` equals torch's in-place kernels bit for bit: a
16-bit in-place multiply rounds its scalar to the tensor's dtype first, the
out-of-place one does not (on a CPU, bf16 ``x * 0.9`` differs in most elements)."""


def _steps_out_of_place(params, grads, foreach: bool | None, fused: bool | None, *hypers) -> bool:
    """Whether a pure update runs :mod:`puredist._out_of_place`'s step: eagerly, where
    torch would run its multi-tensor kernel, on fp32/fp64 parameters with dense
    gradients for all of them, no hyper-parameter a schedule. (Every pass over the
    leaves is a C-level ``map``: no Python frame per leaf.)"""
    return not (any(map(callable, hypers)) or torch.compiler.is_compiling()
                or _any_none(grads) or any(map(_IS_SPARSE, grads)) or not runs_foreach(params, foreach, fused)
                or not all(map(_OUT_OF_PLACE_DTYPES.__contains__, map(_DTYPE, params))))


_IS_SPARSE, _DTYPE, _IS_CPU = operator.attrgetter("is_sparse"), operator.attrgetter("dtype"), operator.attrgetter("is_cpu")


def _any_none(items: Sequence[object]) -> bool:
    """Whether an item is ``None`` (C-level: no Python frame per item)."""
    return any(map(operator.is_, items, repeat(None)))


def _any_complex(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a tensor is complex (C-level, as :func:`_any_none`)."""
    return any(map(torch.is_complex, tensors))


def _states_of(kind: type, *columns: Sequence[Any]) -> list[NamedTuple]:
    """``[kind(*row) for row in zip(*columns)]``, the tuples built in C (a NamedTuple's
    own constructor is a Python function: one frame per leaf)."""
    return list(map(tuple.__new__, repeat(kind), zip(*columns)))


_PureStep = Callable[[list[torch.Tensor], list[torch.Tensor], list[NamedTuple]], tuple[list, list] | None]
"""``pure_step(params, grads, states) -> (new params, new states)`` computed into new
tensors, the inputs untouched, or ``None`` where it does not apply (then the pure
``update`` copies and steps the copies in place)."""


def _make_optimizer(
    init_leaf: Callable, scheduled: tuple[_Step, Callable], differentiable: bool, config: str,
    pure_step: _PureStep | None = None, writes_grads: bool = False, takes_sparse: bool = True,
) -> Optimizer:
    """``writes_grads``: torch's multi-tensor kernel may write into the gradients (SGD
    with Nesterov momentum adds the momentum into them): the pure update steps copies.
    ``takes_sparse``: whether sparse gradients are stepped (else refused)."""
    kind = config.split("(")[0] or "this optimizer"
    step, check_states = scheduled
    def init(params: PyTree) -> PyTree:
        """A fresh per-parameter state for each leaf of ``params``, in a tree shaped
        like ``params`` (``{"w": w}`` gives ``{"w": state of w}``)."""
        leaves, spec = tree_flatten(params)
        return tree_unflatten(spec, [init_leaf(p) for p in leaves])

    def stepped(leaves: list, grad_leaves: list, state: list, traced: bool) -> list:
        """Step ``leaves`` in place with ``step`` (a ``None`` grad skips its parameter and
        keeps its state); return the new per-parameter states."""
        active = [i for i, g in enumerate(grad_leaves) if g is not None]
        new_state = list(state)
        new = step([leaves[i] for i in active], [grad_leaves[i] for i in active], [state[i] for i in active], traced)
        for i, s in zip(active, new):
            new_state[i] = s
        return new_state

    def update_(params: PyTree, grads: PyTree, state: PyTree) -> PyTree:
        """Step ``params`` in place (a ``None`` grad skips its parameter); return the
        new state, shaped like ``params``."""
        leaves, spec = tree_flatten(params)
        states = _per_leaf(spec, state, len(leaves))
        _check_shapes(leaves, states)
        grad_leaves = spec.flatten_up_to(grads)
        _check_grads(leaves, grad_leaves, kind, takes_sparse)
        return tree_unflatten(spec, stepped_in_place(leaves, grad_leaves, states))

    def stepped_in_place(leaves: list, grad_leaves: list, states: list) -> list:
        with torch.no_grad():  # as torch.optim steps its parameters (no detached views made)
            return stepped(leaves, grad_leaves, states, False)

    def update(params: PyTree, grads: PyTree, state: PyTree) -> tuple[PyTree, PyTree]:
        """Pure: ``(new params, new state)``; the inputs are not modified; the new
        parameters are fresh tensors (leaves, ``requires_grad`` kept). Under
        ``torch.func`` transforms (``vmap`` over stacked params, grads and states;
        ``grad``), and with autograd for an optimizer built ``differentiable=True``,
        the step is recorded instead: torch's single-tensor kernels in their
        differentiable form (equal to the eager step up to rounding: the step count's
        powers are taken in its dtype: about 1e-5 of ``lr`` for Adam's default betas)."""
        leaves, spec = tree_flatten(params)
        grad_leaves = spec.flatten_up_to(grads)
        states = _per_leaf(spec, state, len(leaves))
        _check_shapes(leaves, states)
        _check_grads(leaves, grad_leaves, kind, takes_sparse)
        traced = _traced(
            lambda: [*leaves, *(g for g in grad_leaves if g is not None),
                     *(t for s in states for t in s if isinstance(t, torch.Tensor))],
            differentiable,
        )
        if not traced and pure_step is not None:
            stepped_out_of_place = pure_step(leaves, grad_leaves, states)
            if stepped_out_of_place is not None:
                new, new_states = stepped_out_of_place
                for copy, leaf in zip(new, leaves):
                    if leaf.requires_grad:
                        copy.requires_grad_()
                return tree_unflatten(spec, new), tree_unflatten(spec, new_states)
        cloned = clone_states(states, recorded=traced)  # the inputs' state tensors are never handed out
        if writes_grads and not traced:  # nothing passed in is written, the gradients included
            grad_leaves = [None if g is None else g.detach().clone() for g in grad_leaves]
        if not traced:
            new = copies(leaves)
            for copy, leaf in zip(new, leaves):
                if leaf.requires_grad:
                    copy.requires_grad_()
            return tree_unflatten(spec, new), tree_unflatten(spec, stepped_in_place(new, grad_leaves, cloned))
        new = copies(leaves, recorded=True)  # the update is differentiable
        return tree_unflatten(spec, new), tree_unflatten(spec, stepped(new, grad_leaves, cloned, True))

    def check(states: Sequence[NamedTuple], params: Sequence[torch.Tensor] | None = None,
              grads: Sequence[torch.Tensor] | None = None) -> None:
        """Raise ``ValueError``, stepping nothing, where a step of parameters with these
        per-parameter states (and, given, these parameters and gradients) would
        (see :attr:`Optimizer.check`)."""
        if params is not None:
            _check_shapes(params, states)
            _check_grads(params, grads, kind, takes_sparse)
        check_states(states)

    return Optimizer(init, update, update_, config, check, elementwise=True)  # SGD, Adam, AdamW


def sgd(
    lr: float = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
    differentiable: bool = False,
) -> Optimizer:
    """Stochastic gradient descent, as ``torch.optim.SGD`` (same arguments and math;
    ``foreach``/``fused`` pick torch's kernel as the class does, ``None`` = torch's
    default; ``fused=True`` runs torch's fused kernel, on CPU or CUDA;
    ``differentiable=True``: ``update`` records its step for autograd, as under
    ``torch.func`` transforms).

    ``lr``, ``weight_decay`` and ``momentum`` may be schedules, ``lr(count) -> rate``
    (see the module docstring); a momentum schedule takes no dampening.

    Raises:
        ValueError: a negative ``lr``, ``momentum`` or ``weight_decay`` (a schedule's
            value: at the update, before anything is stepped); ``nesterov`` without
            momentum or with dampening; a momentum schedule with dampening; ``fused``
            and ``foreach`` both True.
    """
    for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
        if not callable(value):
            _check_nonnegative(name, value)
    _check_kernel_choice(foreach, fused)
    if nesterov and ((not callable(momentum) and momentum <= 0) or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    if callable(momentum) and dampening:
        raise ValueError(
            f"Args ``momentum`` (a schedule) and ``dampening`` ({dampening}): torch's first momentum step takes the "
            "gradient undamped, which a rate that starts later cannot follow; schedule momentum without dampening."
        )
    has_momentum = callable(momentum) or momentum > 0

    def first_traced_step(param, grad, lr, weight_decay, momentum):
        """torch's first momentum step (``buf = grad``) without its ``detach``, which would
        cut the gradient through the buffer; returns the buffer."""
        grad = -grad if maximize else grad
        if weight_decay:
            grad = grad.add(param, alpha=weight_decay)
        buffer = grad.clone()
        param.add_(grad.add(buffer, alpha=momentum) if nesterov else buffer, alpha=-lr)
        return buffer

    def dampened_traced_step(param, grad, state, lr, weight_decay, momentum):
        """torch's step with dampened momentum, choosing its first step (``buf = grad``,
        undamped) by the count on the device, so that a mapped count works; returns
        the buffer."""
        grad = -grad if maximize else grad
        if weight_decay:
            grad = grad.add(param, alpha=weight_decay)
        buffer = torch.where(state.step == 0, grad, state.momentum_buffer.mul(momentum).add(grad, alpha=1 - dampening))
        param.add_(buffer, alpha=-lr)  # (no nesterov: torch refuses it with dampening)
        return buffer

    def run(params, grads, states, traced, lr, weight_decay, momentum):
        buffers = [getattr(s, "momentum_buffer", None) for s in states]
        if momentum and dampening and traced:
            _check_counted(states, "SGD with dampening knows its first step by the count")
            buffers = [dampened_traced_step(p, g, s, lr, weight_decay, momentum) for p, g, s in zip(params, grads, states)]
            for state in states:
                state.step.add_(1)
            return [SGDCountedParamState(b, s.step) for b, s in zip(buffers, states)]
        if momentum and dampening:  # torch's first step copies the gradient undamped: a fresh buffer starts there
            counts = _read_counts(states, "SGD with dampening knows its first step by the count")
            buffers = [None if count == 0 else buffer for buffer, count in zip(buffers, counts)]
        first = [k for k, b in enumerate(buffers) if traced and momentum and b is None]
        for k in first:
            buffers[k] = first_traced_step(params[k], grads[k], lr, weight_decay, momentum)
        rest = [k for k in range(len(params)) if k not in first]
        rest_buffers = [buffers[k] for k in rest]  # the kernel fills in the buffers it creates
        rest_params, fused_here = [params[k] for k in rest], _fused_here(fused, traced)
        _sgd_kernel(rest_params, _grads_for(fused_here, rest_params, [grads[k] for k in rest]), rest_buffers,
                    foreach=_sgd_foreach_here(foreach, traced), fused=fused_here,
                    weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening, nesterov=nesterov,
                    maximize=maximize)
        for k, buffer in zip(rest, rest_buffers):
            buffers[k] = buffer
        counts = [getattr(s, "step", None) for s in states]
        for count in counts:  # scheduled: one more update taken (in place, as Adam's kernel counts)
            if count is not None:
                count.add_(1)
        if not has_momentum or all(map(operator.is_, buffers, [getattr(s, "momentum_buffer", None) for s in states])):
            return list(states)  # every buffer was stepped in place (the usual case: no new state to build)
        return [_sgd_state(b, count) for b, count in zip(buffers, counts)]

    def pure_step(params, grads, states):
        """torch's multi-tensor step into new tensors (:mod:`puredist._out_of_place`),
        where torch would run that kernel eagerly on fp32/fp64 tensors and dense
        gradients, every parameter has a gradient, nothing is dampened or scheduled
        (no counts) and every momentum buffer exists; ``None`` elsewhere."""
        if dampening or not _steps_out_of_place(params, grads, foreach, fused, lr, weight_decay, momentum):
            return None
        if not has_momentum:
            return sgd_foreach(params, grads, None, lr=lr, momentum=0.0, weight_decay=weight_decay,
                               nesterov=nesterov, maximize=maximize)[0], list(states)
        buffers = list(map(getattr, states, repeat("momentum_buffer"), repeat(None)))
        if _any_none(buffers):
            return None
        new_params, new_buffers = sgd_foreach(params, grads, buffers, lr=lr, momentum=momentum,
                                              weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)
        return new_params, _states_of(SGDParamState, new_buffers)

    def init_leaf(p: torch.Tensor) -> NamedTuple:
        counted = callable(lr) or callable(weight_decay) or callable(momentum) or (momentum and dampening)
        count = torch.zeros((), dtype=torch.float32) if counted else None
        # a zero buffer steps exactly as torch's first step (buf = grad): -0.0 * momentum + grad is grad,
        # signed zeros included (-0.0 is the additive identity; +0.0 would turn a -0.0 gradient into +0.0);
        # with dampening the first step starts from the gradient instead (see run)
        return _sgd_state(torch.full_like(p, -0.0, memory_format=torch.preserve_format) if has_momentum else None, count)

    check = lambda params, traced: _check_fused_sgd_takes(params, fused and not traced)  # noqa: E731
    hypers = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum}
    config = _config("sgd", lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                     nesterov=nesterov, maximize=maximize, foreach=foreach, fused=fused)
    return _make_optimizer(init_leaf, _scheduled(hypers, run, check, _check_nonnegative), differentiable, config,
                           pure_step, writes_grads=nesterov)


def _adam_family(
    lr, betas, eps, weight_decay, amsgrad, maximize, foreach, fused, differentiable: bool, decoupled: bool
) -> Optimizer:
    for arg, value in (("eps", eps), ("weight_decay", weight_decay), ("lr", lr)):
        if not callable(value) or arg == "eps":
            _check_nonnegative(arg, value)
    _check_kernel_choice(foreach, fused)
    if not callable(betas):
        _check_betas(betas)

    def validate(name: str, value: Any) -> None:
        _check_betas(value) if name == "betas" else _check_nonnegative(name, value)

    def init_leaf(p: torch.Tensor) -> AdamParamState | AMSGradParamState:
        zeros = lambda: torch.zeros_like(p, memory_format=torch.preserve_format)  # noqa: E731
        # as torch.optim.Adam: the fused kernel keeps the step on the parameter's device
        step = torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device if fused else "cpu")
        return AMSGradParamState(step, zeros(), zeros(), zeros()) if amsgrad else AdamParamState(step, zeros(), zeros())

    def kernel(params, grads, states, traced, lr: float, weight_decay: float, betas) -> None:
        maximize_here = maximize
        if not decoupled:
            grads, weight_decay, maximize_here = _l2_while_compiling(params, grads, weight_decay, maximize, traced)
        fused_here = _fused_here(fused, traced)
        _adam_kernel(
            params, _grads_for(fused_here, params, grads),
            [s.exp_avg for s in states], [s.exp_avg_sq for s in states],
            [s.max_exp_avg_sq for s in states] if amsgrad else [],
            [s.step for s in states],
            foreach=False if traced else foreach,
            fused=fused_here,
            differentiable=traced,
            has_complex=_any_complex(params),  # else the multi-tensor kernel takes g^2, not |g|^2
            decoupled_weight_decay=decoupled,
            amsgrad=amsgrad, beta1=betas[0], beta2=betas[1], lr=lr,
            weight_decay=weight_decay, eps=eps, maximize=maximize_here,
        )

    def run(params, grads, states, traced, lr, weight_decay, betas):
        kernel(params, grads, states, traced, lr, weight_decay, betas)  # counts the step in the states, in place
        return list(states)

    def pure_step(params, grads, states):
        """torch's multi-tensor step into new tensors (:mod:`puredist._out_of_place`),
        where torch would run that kernel eagerly on fp32/fp64 tensors, every
        parameter has a gradient and no hyper-parameter is a schedule; ``None``
        elsewhere."""
        if not _steps_out_of_place(params, grads, foreach, fused, lr, weight_decay, betas):
            return None
        new_params, exp_avgs, exp_avg_sqs, maxima, steps = adam_foreach(
            params, grads, [s.exp_avg for s in states], [s.exp_avg_sq for s in states],
            [s.max_exp_avg_sq for s in states] if amsgrad else None, [s.step for s in states],
            lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay, decoupled=decoupled,
            maximize=maximize,
        )
        if amsgrad:
            return new_params, _states_of(AMSGradParamState, steps, exp_avgs, exp_avg_sqs, maxima)
        return new_params, _states_of(AdamParamState, steps, exp_avgs, exp_avg_sqs)

    check = lambda params, traced: _check_fused_takes(params, fused and not traced, "adam/adamw")  # noqa: E731
    hypers = {"lr": lr, "weight_decay": weight_decay, "betas": betas}
    config = _config("adamw" if decoupled else "adam", lr=lr, betas=betas if callable(betas) else tuple(betas), eps=eps, weight_decay=weight_decay,
                     amsgrad=amsgrad, maximize=maximize, foreach=foreach, fused=fused)
    return _make_optimizer(init_leaf, _scheduled(hypers, run, check, validate), differentiable, config, pure_step,
                           takes_sparse=False)


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
    ``betas`` may be schedules (see the module docstring).

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
    ``weight_decay`` and ``betas`` may be schedules (see the module docstring).

    Raises:
        ValueError: negative ``lr``/``eps``/``weight_decay``, ``betas`` outside [0, 1),
            ``fused`` and ``foreach`` both True.
    """
    return _adam_family(lr, betas, eps, weight_decay, amsgrad, maximize, foreach, fused, differentiable, decoupled=True)

