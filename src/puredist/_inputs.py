"""A tensor given: what a collective or an optimizer's step refuses of it, and what it
must fit; checked before any tensor is touched (an unsupported tensor late in a list
never leaves the earlier ones averaged or stepped), naming the argument, the position
and the reason. This module reads tensors' metadata: it must not communicate.

What a collective refuses (:data:`_REFUSALS`, read by one loop; in place, once per
layout): sparse (non-strided), nested and ``meta`` tensors, float8, integer and bool
dtypes; an inference tensor outside ``torch.inference_mode()`` (torch refuses to
write it there); a conjugate view (it has no real view) or a negated one
(``z.conj().imag``: torch's multi-tensor copy cannot write it); a tensor whose
elements overlap (``expand``-ed); two tensors sharing memory (views that interleave
without a common element are told apart by :mod:`puredist._memory`). Complex tensors
are averaged as their real view (the complex mean), a DTensor as its local shard; one
with a ``Partial`` placement is refused. What an optimizer's fused kernel refuses:
its table of :class:`KernelRefusal` rows, read by :func:`check_kernel_takes`.

What a tensor must fit: rows stacked per replica (:func:`check_stacked`); float
leaves and their fp32 residuals (:func:`check_float_leaves`, :func:`check_residuals`);
an optimizer's states and gradients, its parameters (:func:`check_fits`,
:func:`check_state_count`); an outer state, the parameters it was made for
(:func:`check_params_fit`); a saved state entry, its parameter
(:func:`check_saved_entries`). Callers pass what they know (a field, the copies, a
table): this module imports nothing of the optimizers, collectives or transforms.
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Callable, NamedTuple, Sequence

import torch

from puredist._dtensors import check_not_pending, local_shard, local_shards
from puredist._layout import Checked, Layout, all_real_shards, layout_of
from puredist._memory import byte_span, may_overlap_itself, share_elements
from puredist._validation import HOLDS, Rule, check, check_same_shapes

FLOAT8 = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


def _label(noun: str, position: int, tensor: torch.Tensor) -> str:
    """How messages name a tensor: its position and (but a nested tensor, which has no
    shape) its shape, dtype and device."""
    if tensor.is_nested:
        return f"{noun} {position}"
    return f"{noun} {position} (shape {tuple(tensor.shape)}, {tensor.dtype}, {tensor.device})"


def checked(tensors: Sequence[object], *, arg: str = "tensors", noun: str = "tensor") -> Checked:
    """Check that every tensor can be reduced in place (see the module docstring),
    once per layout: a list of the same metadata as one already checked passes at
    the cost of reading its metadata. A :class:`~puredist._layout.Checked` passes as
    it is.

    Args:
        tensors: the tensors, in the order given.
        arg: the argument's name, for messages.
        noun: what an element is called in messages (``"leaf"`` for a pytree's leaves).

    Raises:
        TypeError: an element is not a tensor, or has an integer, bool or float8 dtype.
        ValueError: a sparse or meta tensor, overlapping elements, memory shared
            between two tensors, or a DTensor with a ``Partial`` placement — naming
            the tensor(s) and the reason.
    """
    if isinstance(tensors, Checked):
        return tensors
    result = Checked(tensors)
    layout = result.layout = layout_of(result)
    if not layout.checked:
        layout.memo["real"] = _check_each(result, arg, noun, in_place=True)
        _check_disjoint(_reduced(result, layout, arg, noun), arg, noun)
        layout.checked = True
    result.reduced = _reduced(result, layout, arg, noun)
    return result


def checked_like(originals: Sequence[torch.Tensor], fresh: list[torch.Tensor], *, why: object) -> Checked:
    """``fresh`` as a :class:`~puredist._layout.Checked`: new tensors made from
    ``originals`` (clones, the results of a multi-tensor kernel over them), so of the
    same shapes, dtypes, devices and strides at new addresses, each its own memory. Their layout is kept
    with the originals' under ``why`` (how they were made, with whatever else decides
    their metadata, e.g. the other operand's layout), so that tensors made anew at
    every step are checked and planned once, not at every call. (Also a buffer laid
    out from them, e.g. one flat tensor of their elements: ``why`` then says so.)"""
    result = Checked(fresh)

    def made() -> Layout:
        layout = Layout(fresh, plain=layout_of(originals).plain)
        layout.memo["real"] = _check_each(fresh, "tensors", "tensor", in_place=True)
        layout.checked = True  # fresh results: disjoint, never overlapping
        return layout

    layout = result.layout = layout_of(originals).derived(("like", why), made)
    result.reduced = _reduced(fresh, layout)
    return result


def _reduced(tensors: list, layout: Layout, arg: str = "tensors", noun: str = "tensor") -> list[torch.Tensor]:
    """``tensors`` as the collective writes them: the positions ``layout`` marked
    (complex, DTensor) converted, the rest as they are."""
    converted = layout.memo["real"]
    if not converted:
        return tensors
    if len(converted) == len(tensors) and all_real_shards(tensors, layout):  # (FSDP2's parameters)
        return local_shards(tensors)
    reduced = list(tensors)
    for position in converted:
        tensor = local_shard(reduced[position])
        if tensor.is_conj():  # (per call: a conjugate view has its base's metadata, so its layout)
            raise ValueError(
                f"Arg ``{arg}``: {noun} {position} is a conjugate view (z.conj()), which cannot be written as "
                "real numbers; average the tensor it conjugates instead (the mean of the conjugates is the "
                "conjugate of the mean)."
            )
        reduced[position] = torch.view_as_real(tensor.detach()) if tensor.is_complex() else tensor
    return reduced


def checked_for_reduction(
    tensors: Sequence[object], *, arg: str = "tensors", noun: str = "tensor", in_place: bool = True
) -> list[torch.Tensor]:
    """Check that every tensor can be reduced, and return them as the real-valued
    tensors to reduce (a complex tensor becomes its ``view_as_real``, a DTensor its
    local shard; writes go to them).

    Args:
        tensors: the tensors, in the order given.
        arg: the argument's name, for messages.
        noun: what an element is called in messages (``"leaf"`` for a pytree's leaves).
        in_place: whether the mean will be written into the tensors (then as
            :func:`checked`). ``False`` (an out-of-place mean, which may run under
            ``torch.func`` transforms, where memory is not observable) skips the
            memory checks and returns the tensors as they are, complex ones included.

    Raises:
        as :func:`checked`.
    """
    if in_place:
        return checked(tensors, arg=arg, noun=noun).reduced
    _check_each(tensors, arg, noun, in_place=False)
    return list(tensors)


class _Refusal(NamedTuple):
    """A kind of tensor a reduction refuses.

    Attributes:
        in_place_only: refused only where the mean is written into the tensor.
        refuses: ``refuses(tensor) -> bool`` of the tensor as reduced (a DTensor's
            local shard).
        error: the exception raised.
        reason: what the message says after the tensor's label (formatted with the
            tensor's ``layout`` and ``strides``).
    """

    in_place_only: bool
    refuses: Callable[[torch.Tensor], bool]
    error: type[Exception]
    reason: str


_REFUSALS = (  # in order: the first that applies is raised (lambdas: torch.compile traces them out of place)
    _Refusal(False, lambda t: t.is_nested, ValueError,
             " is a nested tensor; only dense tensors can be averaged (average its components, or its values buffer)."),
    _Refusal(False, lambda t: t.layout != torch.strided, ValueError,
             " has layout {layout}; only dense tensors can be averaged."),
    _Refusal(False, lambda t: t.is_meta, ValueError, " is a meta tensor: it holds no values to average."),
    _Refusal(False, lambda t: t.dtype in FLOAT8, TypeError,
             ": float8 cannot be summed portably by the backends; average a bf16 or fp16 copy instead."),
    _Refusal(False, lambda t: not (t.is_floating_point() or t.is_complex()), TypeError,
             ": averaging needs floating-point or complex tensors (the mean of integers or bools is not one of them)."),
    _Refusal(True, lambda t: t.is_inference() and not torch.is_inference_mode_enabled(), ValueError,
             " is an inference tensor (made under torch.inference_mode()): torch allows writing it only in inference "
             "mode; average it inside torch.inference_mode(), or pass a clone made outside it."),
    _Refusal(True, lambda t: t.is_neg(), ValueError,
             " is a negated view (e.g. z.conj().imag), which torch's multi-tensor copy cannot write; average the "
             "tensor it views instead (the mean of the negations is the negation of the mean)."),
    _Refusal(True, may_overlap_itself, ValueError,
             " has overlapping elements (strides {strides}, e.g. from expand()): its mean cannot be written back; "
             "pass a contiguous copy."),
)
"""What a collective refuses of a tensor, read by :func:`_check_each`."""

_OUT_OF_PLACE_REFUSALS = tuple(r for r in _REFUSALS if not r.in_place_only)


def _check_each(tensors: Sequence[object], arg: str, noun: str, *, in_place: bool) -> tuple[int, ...]:
    """Raise for the first tensor that cannot be reduced (the first of
    :data:`_REFUSALS` that applies to it); return the positions that the reduction
    converts (complex tensors and DTensors; ``in_place`` only)."""
    converted = []
    refusals = _REFUSALS if in_place else _OUT_OF_PLACE_REFUSALS
    for position, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"Arg ``{arg}`` must be a pytree of tensors; {noun} {position} is {type(tensor).__name__}: {tensor!r}."
            )
        check_not_pending(tensor, arg, lambda: _label(noun, position, tensor))
        local = local_shard(tensor) if in_place else tensor
        for refused in refusals:
            if refused.refuses(local):
                strides = local.stride() if "{strides}" in refused.reason else None  # (a sparse tensor has none)
                reason = refused.reason.format(layout=local.layout, strides=strides)
                raise refused.error(f"Arg ``{arg}``: {_label(noun, position, tensor)}{reason}")
        if in_place and (local is not tensor or local.is_complex()):
            converted.append(position)
    return tuple(converted)


def _check_disjoint(tensors: Sequence[torch.Tensor], arg: str, noun: str) -> None:
    # sorted by (device, start): the tensors whose ranges overlap one's are those after it that start inside it
    spans = sorted((str(t.device), *byte_span(t), position) for position, t in enumerate(tensors) if t.numel() > 0)
    for i, (device, _, end, first) in enumerate(spans):
        for j in range(i + 1, len(spans)):
            next_device, start, _, second = spans[j]
            if next_device != device or start >= end:
                break
            if not share_elements(tensors[first], tensors[second]):
                continue  # interleaved, each element its own
            a, b = sorted((first, second))
            raise ValueError(
                f"Arg ``{arg}``: {noun}s {a} and {b} share memory (the same tensor twice, or overlapping "
                "views): each would be averaged from values the other already replaced. Pass each "
                "tensor once."
            )


def check_stacked(tensors: Sequence[torch.Tensor], rows: int, *, arg: str, noun: str, why: str) -> None:
    """Raise ``ValueError`` unless every tensor is stacked ``[rows, *shape]`` (a row
    per replica): "``arg``: noun i has shape s; " and ``why`` (formatted with
    ``rows``). ``arg``: an argument's name (quoted as one) or what the tensors are."""
    for position, tensor in enumerate(tensors):
        if tensor.dim() == 0 or tensor.shape[0] != rows:
            subject = f"Arg ``{arg}``" if arg.isidentifier() else arg
            raise ValueError(f"{subject}: {noun} {position} has shape {tuple(tensor.shape)}; {why.format(rows=rows)}")


def check_tensors(values: Sequence[object], *, arg: str, noun: str) -> None:
    """Raise ``TypeError`` naming the first of ``values`` (the elements of the argument
    ``arg``) that is not a tensor: "Arg ``arg``: noun i is a T, not a tensor."."""
    if not all(isinstance(v, torch.Tensor) for v in values):
        i, bad = next((i, v) for i, v in enumerate(values) if not isinstance(v, torch.Tensor))
        raise TypeError(f"Arg ``{arg}``: {noun} {i} is a {type(bad).__name__}, not a tensor.")


def check_float_leaves(leaves: Sequence[torch.Tensor], layout: Layout, *, arg: str, needs: str) -> None:
    """Raise, once per ``layout`` (theirs), ``TypeError`` on a leaf whose dtype is not
    floating point ("Arg ``arg``: leaf i has dtype d; " and ``needs``), ``ValueError``
    on a DTensor with a ``Partial`` placement."""
    layout.derived(("float leaves", arg), lambda: _float_leaves(leaves, arg, needs))


def _float_leaves(leaves: Sequence[torch.Tensor], arg: str, needs: str) -> bool:
    for position, leaf in enumerate(leaves):
        if not leaf.is_floating_point():
            raise TypeError(f"Arg ``{arg}``: leaf {position} has dtype {leaf.dtype}; {needs}.")
        check_not_pending(leaf, arg, lambda: f"leaf {position}")
    return True


_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")


def check_residuals(leaves: Sequence[torch.Tensor], residuals: Sequence[torch.Tensor], layout: Layout, *,
                    arg: str) -> None:
    """Raise ``ValueError`` (naming the argument ``arg``) unless ``residuals`` are one
    fp32 tensor per leaf (``leaves`` of ``layout``), shaped as its local shard (a
    compressed averaging's payloads' sizes follow from them: a residual of another
    shape would broadcast, or make this rank's payloads another size than its peers')."""
    check(arg, len(residuals), HOLDS, what="residuals", count=len(leaves), per="leaves")
    shards = leaves
    if not layout.plain:  # a DTensor's residual: its local shard's, or a DTensor holding that shard
        shards, residuals = [local_shard(leaf) for leaf in leaves], [local_shard(r) for r in residuals]
    check_same_shapes(arg, list(map(_SHAPE, residuals)), list(map(_SHAPE, shards)), what="residual",
                      other="its leaf", tail=".")
    if residuals and set(map(_DTYPE, residuals)) != {torch.float32}:
        i = next(i for i, r in enumerate(residuals) if r.dtype != torch.float32)
        raise ValueError(f"Arg ``{arg}``: residual {i} has dtype {residuals[i].dtype}; residuals are fp32 (as init "
                         "makes them).")


class KernelRefusal(NamedTuple):
    """What an optimizer's fused kernel would refuse or step wrongly from inside the
    step: a row of the table :func:`check_kernel_takes` reads.

    Attributes:
        kernel: the optimizer whose fused kernel it is (``None``: every one).
        eager_only: only where the step runs eagerly (compiled, the fused kernel
            does not run).
        any_may: ``any_may(params)``: whether some parameter may be refused, read
            without a Python frame per parameter (the usual path).
        refuses: ``refuses(param)``.
        error: the exception raised.
        why: the message's reason, formatted with the first refused parameter's
            position ``i`` and ``dtype``.
    """

    kernel: str | None
    eager_only: bool
    any_may: Callable[[Sequence[torch.Tensor]], bool]
    refuses: Callable[[torch.Tensor], bool]
    error: type[Exception]
    why: str


def check_kernel_takes(params: Sequence[torch.Tensor], fused: bool | None, name: str,
                       refusals: Sequence[KernelRefusal]) -> None:
    """Where ``fused``, raise, naming the argument, before anything is stepped where
    the fused kernel of the optimizer ``name`` would raise its own error from inside
    the step or step wrongly: the first of ``refusals`` (in order) that applies to
    ``name`` (and, compiled, is not ``eager_only``), at its first refused parameter:
    "Arg ``fused`` of name: why; nothing was stepped. ..."."""
    if not fused:
        return
    for refusal in refusals:
        if refusal.kernel not in (None, name) or (refusal.eager_only and torch.compiler.is_compiling()):
            continue
        refused = [i for i, p in enumerate(params) if refusal.refuses(p)] if refusal.any_may(params) else []
        if refused:
            why = refusal.why.format(i=refused[0], dtype=params[refused[0]].dtype)
            raise refusal.error(
                f"Arg ``fused`` of {name}: {why}; nothing was stepped. Use fused=None (foreach or the for-loop kernel)."
            )


def check_fits(leaves: Sequence[torch.Tensor] | None, states: Sequence[NamedTuple],
               grads: Sequence[torch.Tensor | None], *, shaped_field: Callable[[Sequence[NamedTuple]], str | None],
               name: str, takes_sparse: bool) -> None:
    """Raise ``ValueError``, before anything is stepped, where a per-parameter state's
    buffer (its field ``shaped_field(states)``, ``None``: none) has another shape than
    its parameter (a state made for other parameters: the kernels would step some
    parameters, then fail), or a gradient (``None`` skips its parameter) has another
    shape than its parameter, or is sparse for an optimizer ``name`` that takes none
    (as ``torch.optim.Adam`` refuses). ``leaves`` ``None``: nothing to fit."""
    if leaves is None:
        return
    field = shaped_field(states)
    buffers = [getattr(state, field) for state in states] if field else []  # (comprehensions: torch.compile traces them)
    if buffers and buffers[0] is not None:  # (SGD before its first step: no buffer yet)
        check_same_shapes("state", [p.shape for p in leaves], [b.shape for b in buffers], what="parameter",
                          other="its state's buffers", tail=": a state made by init for other parameters. Nothing was "
                          "stepped.")
    shapes = [None if g is None else g.shape for g in grads]  # (comprehensions: torch.compile traces them)
    check_same_shapes("grads", shapes, [p.shape if s is not None else None for p, s in zip(leaves, shapes)],
                      what="gradient", other="its parameter", tail=". Nothing was stepped.")
    if not takes_sparse and any(map(getattr, grads, repeat("is_sparse"), repeat(False))):
        i = next(i for i, g in enumerate(grads) if g is not None and g.is_sparse)
        raise ValueError(
            f"Arg ``grads``: gradient {i} is sparse; {name} takes dense gradients only (torch.optim's neither: "
            "consider torch.optim.SparseAdam). Nothing was stepped."
        )


_NOT_TENSORS = Rule(lambda states, b: not (states and all(isinstance(s, torch.Tensor) for s in states)), ValueError,
                    "Arg ``{arg}`` holds tensors where per-parameter states belong: were the arguments given in "
                    "optax's order, update(grads, state, params)? puredist's is update(params, grads, state), as "
                    "torch.optim's step updates the parameters.")
"""A state's rule where it is not per-parameter states: not tensors (arguments swapped)."""


def check_state_count(states: Sequence[object], count: int, declared: Callable[[type], object]) -> None:
    """Raise ``ValueError`` unless ``states`` (the argument ``state``'s, in leaf order)
    are ``count`` per-parameter states, each of a type ``declared`` knows (it returns
    its declaration, else ``None``): tensors there name the arguments' order (optax's),
    anything else the count."""
    if len(states) != count or not all(map(declared, set(map(type, states)))):
        check("state", states, _NOT_TENSORS)
        raise ValueError(f"Arg ``state`` holds {len(states)} parameter states for {count} parameters.")


def check_params_fit(leaves: Sequence[torch.Tensor], copies: Sequence[torch.Tensor], residuals: Sequence[object], *,
                     same_dtype: bool, compressor: str | None) -> None:
    """Raise ``ValueError`` unless ``leaves`` (the argument ``params``') are the
    parameters a state was made for: as many as its global ``copies``, of the same
    shapes (and dtypes, where ``same_dtype``: the copies keep the parameters' own),
    and the state holds one of ``residuals`` per parameter where its transform has a
    ``compressor`` (its name), else none. Leaves are paired by position, so another
    tree (a frozen embedding left out) would pair unrelated tensors."""
    # (comprehensions, not operator.attrgetter: torch.compile traces this check and cannot call one)
    same = len(leaves) == len(copies) and [t.shape for t in leaves] == [t.shape for t in copies]
    if same and same_dtype:
        same = [t.dtype for t in leaves] == [t.dtype for t in copies]
    if same and len(residuals) != (len(copies) if compressor is not None else 0):  # one per parameter, or none
        raise ValueError(
            f"Arg ``state`` holds {len(residuals)} error-feedback residuals for {len(copies)} parameters: "
            f"it was made by init of a transform {'with' if compressor is None else 'without'} a compressor; this one "
            f"has {'none' if compressor is None else compressor}. Init a state with this transform."
        )
    if same:
        return
    differing = next(
        (i for i, (leaf, g) in enumerate(zip(leaves, copies))
         if leaf.shape != g.shape or (same_dtype and leaf.dtype != g.dtype)),
        min(len(leaves), len(copies)),
    )
    raise ValueError(
        f"Arg ``params`` has {len(leaves)} leaves; the state was made by init for {len(copies)}, and leaf "
        f"{differing} differs (params: "
        f"{_describe_leaf(leaves, differing)}, state: {_describe_leaf(copies, differing)}). Pass the "
        f"parameters init was given (the same tree), or init a state for these.{_vmap_hint(leaves, copies, differing)}"
    )


def _describe_leaf(leaves: Sequence[torch.Tensor], i: int) -> str:
    return f"shape {tuple(leaves[i].shape)}, {leaves[i].dtype}" if i < len(leaves) else "none"


def _vmap_hint(leaves: Sequence[torch.Tensor], copies: Sequence[torch.Tensor], i: int) -> str:
    """Where one side has exactly one more leading dimension, what ``vmap``'s dims
    likely got wrong (a stacked tree passed unmapped), else ``""``."""
    if i >= min(len(leaves), len(copies)):
        return ""
    param, copy = leaves[i].shape, copies[i].shape
    if copy[1:] == param and len(copy) == len(param) + 1:
        return (" Under torch.func.vmap: a state stacked per replica passed unmapped? Map it with "
                "in_dims=puredist.tree.vmap_axes(state) (and return it with out_dims=the same).")
    if param[1:] == copy and len(param) == len(copy) + 1:
        return " Under torch.func.vmap: stacked parameters passed unmapped? Map them (in_dims=0)."
    return ""


_FOREIGN_FIELDS = Rule(lambda v, b: not v, ValueError,  # v: the fields of a saved entry its optimizer does not keep
                       "Arg ``{arg}``: the state of parameter {index} has {value}, which {name} does not keep ({kept}): "
                       "a checkpoint of another optimizer?")
_MISSING_FIELDS = Rule(lambda v, b: not v, ValueError, "Arg ``{arg}``: the state of parameter {index} lacks {value}, "
                       "which {name} keeps for every parameter it stepped (its group's settings): an edited checkpoint?")
_FIELD_SHAPE = Rule(lambda v, b: v is None, ValueError,  # v: (field, its shape) of the first misshapen tensor field
                    "Arg ``{arg}``: ``{value[0]}`` of parameter {index} has shape {value[1]}, the parameter {shape}.")


def check_saved_entries(entries: Sequence[tuple[dict, torch.Tensor, tuple[frozenset, ...]]], name: str, *,
                        arg: str = "state_dict") -> None:
    """Raise ``ValueError`` unless each of ``entries``, ``(saved state, parameter, fields)``
    of parameter ``i`` (in the argument ``arg``), can be a state of the optimizer ``name``:
    its ``fields`` are those shaped like the parameter, the scalars, and those a stepped
    parameter's state holds all of; it has no other, lacks none of the last (but empty: not
    stepped yet), and each tensor of the first is shaped as the parameter."""
    for index, (entry, param, (shaped, scalars, kept)) in enumerate(entries):
        check(arg, sorted(set(entry) - shaped - scalars), _FOREIGN_FIELDS, index=index, name=name,
              kept=sorted(shaped | scalars))
        check(arg, sorted(kept - set(entry)) if entry else [], _MISSING_FIELDS, index=index, name=name)
        misshapen = ((f, tuple(entry[f].shape)) for f in shaped & set(entry)
                     if isinstance(entry[f], torch.Tensor) and entry[f].shape != param.shape)
        check(arg, next(misshapen, None), _FIELD_SHAPE, index=index, shape=tuple(param.shape))
