"""The optimizer protocol, the declaration of per-parameter state types, and state
utilities.

An :class:`Optimizer` is a NamedTuple of pure functions:

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

Each per-parameter state type declares its fields once, where it is defined
(:func:`param_state`): a field :data:`Shaped` like its parameter or a :data:`Count`
of steps, and whether the optimizer keeping it steps elementwise or per tensor (a
norm, as LARS or LAMB). That declaration is the one source that ZeRO, the flat
DiLoCo path (:mod:`puredist.outer.storage.flat`), :func:`state_axes` (``vmap``), the state
checks and the checkpoints read.

This module must not communicate, nor step anything: it defines what an optimizer
is and what its state holds.
"""

import enum
import operator
import typing
from itertools import repeat
from typing import Annotated, Any, Callable, NamedTuple, Sequence

import torch
import torch.utils._pytree as torch_pytree

from puredist._docs import fields_documented
from puredist._seq import any_none, rows_of
from puredist._validation import Rule, check
from puredist.tree import PyTree


class FieldKind(enum.Enum):
    """What one field of a per-parameter state holds (see :func:`param_state`)."""

    SHAPED = "shaped like its parameter"
    """A tensor shaped like its parameter (a momentum, a moment): checked against the
    parameter's shape, laid end to end with the others of a flat DiLoCo fragment,
    mapped with the parameter under ``vmap``."""
    COUNT = "a step count"
    """A 0-dim tensor counting the updates taken: the same on every replica (left
    unmapped by :func:`state_axes`), never laid flat, required by a checkpoint that
    needs it."""

    def __repr__(self) -> str:
        """``FieldKind.COUNT``: Python that names the kind (an annotation shows it)."""
        return f"{type(self).__name__}.{self.name}"


Shaped = Annotated[torch.Tensor, FieldKind.SHAPED]
"""The annotation of a state field shaped like its parameter."""
Count = Annotated[torch.Tensor, FieldKind.COUNT]
"""The annotation of a state field counting the steps taken."""


@fields_documented
class StateDeclaration(NamedTuple):
    """What :func:`param_state` declared of a per-parameter state type.

    Attributes:
        elementwise: each element's step depends on that element's parameter,
            gradient and state only (no norm, no per-tensor statistic): a step of
            parameters laid end to end in one buffer equals the step of each.
        shaped: the fields shaped like the parameter, in field order.
        counts: the fields counting steps, in field order.
    """

    elementwise: bool
    shaped: tuple[str, ...]
    counts: tuple[str, ...]


_NAMED_TUPLE_CLASS = Rule(lambda v, b: isinstance(v, type) and issubclass(v, tuple) and hasattr(v, "_fields"),
                          TypeError, "param_state declares NamedTuple classes, got {value!r}.")
"""What :func:`param_state` declares."""

_ONE_KIND = Rule(lambda marks, b: len(marks) == 1, TypeError,  # ``marks``: the field's FieldKinds
                 "Field ``{arg}`` of {owner} must be annotated Shaped or Count (puredist.optim), got {hint!r}.")
"""A state field's rule: annotated with one :class:`FieldKind`."""


def param_state(*, elementwise: bool) -> Callable[[type], type]:
    """Declare a NamedTuple class a per-parameter optimizer state: every field
    annotated :data:`Shaped` or :data:`Count` (``Annotated[T, FieldKind...]``, ``T``
    possibly ``torch.Tensor | None``), and whether the optimizer that keeps it steps
    ``elementwise``. This one declaration is what ZeRO, the flat DiLoCo path
    (:mod:`puredist.outer.storage.flat`), :func:`state_axes`, the state checks and the
    checkpoints read. A state holds tensors only, no ``None`` field (a configuration
    that keeps no buffer or count has a state type without that field), so that plain
    ``torch.func.vmap`` maps it (as optax's states).

    Raises:
        TypeError: a field without one :class:`FieldKind`, or not a NamedTuple class.
    """
    def declare(cls: type) -> type:
        check("cls", cls, _NAMED_TUPLE_CLASS)
        hints = typing.get_type_hints(cls, include_extras=True)
        kinds = {}
        for name in cls._fields:
            marks = [m for m in getattr(hints.get(name), "__metadata__", ()) if isinstance(m, FieldKind)]
            check(name, marks, _ONE_KIND, owner=cls.__name__, hint=hints.get(name))
            kinds[name] = marks[0]
        cls.__param_state__ = StateDeclaration(
            bool(elementwise), tuple(n for n, k in kinds.items() if k is FieldKind.SHAPED),
            tuple(n for n, k in kinds.items() if k is FieldKind.COUNT),
        )
        return cls

    return declare


def declaration(kind: type) -> StateDeclaration | None:
    """What ``kind`` was declared with (:func:`param_state`); ``None`` for a type
    never declared (a state of an optimizer built by hand: nothing is assumed of it)."""
    return getattr(kind, "__param_state__", None)


def is_param_state(value: object) -> bool:
    """Whether ``value`` is a declared per-parameter state."""
    return hasattr(type(value), "__param_state__")


def state_axes(state: PyTree, axis: int = 0) -> PyTree:
    """``in_dims``/``out_dims`` for ``torch.func.vmap`` over replicas stacked along
    ``axis``: ``axis`` for each tensor of ``state`` (per-parameter states, in any
    tree), ``None`` for each declared count (every replica has taken the same steps,
    which a schedule reads on the host) and for everything that is not a tensor."""
    def axes_of(leaf):
        if not is_param_state(leaf):
            return axis if isinstance(leaf, torch.Tensor) else None
        counts = declaration(type(leaf)).counts
        return type(leaf)(*(None if name in counts or not isinstance(value, torch.Tensor) else axis
                            for name, value in zip(leaf._fields, leaf)))
    return torch_pytree.tree_map(axes_of, state, is_leaf=is_param_state)


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
            (:mod:`puredist.outer.storage.flat`). :func:`~puredist.optim.make_optimizer` takes
            it from the state type's declaration; ``False`` for one built by hand
            unless it says so.
    """

    init: Callable[[PyTree], PyTree]
    update: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]
    update_: Callable[[PyTree, PyTree, PyTree], PyTree]
    config: str = ""
    check: Callable[..., None] | None = None
    elementwise: bool = False


def config_text(kind: str, **hypers: Any) -> str:
    """``kind(name=value, ...)``, a schedule shown as ``<schedule>`` (a function's repr
    differs between processes; its values are checked where they are used)."""
    return f"{kind}(" + ", ".join(f"{k}={'<schedule>' if callable(v) else v!r}" for k, v in hypers.items()) + ")"


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
        if not any_none(column):
            columns.append(copies(column, recorded=recorded))
        elif all(map(operator.is_, column, repeat(None))):
            columns.append(column)
        else:
            columns.append([None if t is None else t.clone() for t in column])
    return rows_of(type(states[0]), *columns)
