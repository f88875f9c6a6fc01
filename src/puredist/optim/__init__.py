"""Functional optimizers over explicit state: SGD, Adam, AdamW.

Each constructor validates its hyper-parameters and returns an :class:`Optimizer`
(the protocol: :mod:`puredist.optim.base`): ``init(params) -> state`` (per-parameter
states in a tree shaped like ``params``), the pure ``update(params, grads, state) ->
(params, state)`` and the in-place ``update_(params, grads, state) -> state``.

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

The modules, one concern each:

- :mod:`~puredist.optim.base`: the :class:`Optimizer` protocol and how a
  per-parameter state type declares each of its fields once (:func:`param_state`:
  :data:`Shaped` like its parameter or a :data:`Count`; the optimizer elementwise or
  per tensor), which ZeRO, the flat DiLoCo path, :func:`state_axes` (``vmap``), the
  checks and checkpoints read; :func:`copies` and :func:`clone_states`;
- ``_factory``: :func:`make_optimizer`, an optimizer from a declared state type, a
  per-parameter ``init_leaf`` and an in-place ``run`` (how SGD and Adam are built, and
  how to add one);
- ``sgd``, ``adam`` (the modules, whose names :func:`sgd` and :func:`adam` take over as
  attributes of this package): one algorithm a file, its state types declared there;
- :mod:`~puredist.optim.hyperparameters`: hyper-parameters that are schedules of the count;
- ``_kernels`` (and ``_out_of_place``): which torch kernel runs,
  its workarounds and probes; ``_checks``: the optimizers' rules, checked before anything is stepped.

This package must not communicate: an optimizer steps the tensors it is given, on
this rank (distribution is :mod:`puredist.zero_step`'s and :mod:`puredist.outer`'s).
"""

from puredist.optim._factory import make_optimizer
from puredist.optim.adam import AMSGradParamState, AdamParamState, adam, adamw
from puredist.optim.base import (
    Count, FieldKind, Optimizer, Shaped, StateDeclaration, clone_states, copies, declaration, param_state, state_axes,
)
from puredist.optim.hyperparameters import Hyper
from puredist.optim.sgd import SGDCountParamState, SGDCountedParamState, SGDNoParamState, SGDParamState, sgd

__all__ = [
    "AMSGradParamState", "AdamParamState", "Count", "FieldKind", "Hyper", "Optimizer", "SGDCountParamState",
    "SGDCountedParamState", "SGDNoParamState", "SGDParamState", "Shaped", "StateDeclaration", "adam", "adamw",
    "clone_states", "copies", "declaration", "make_optimizer", "param_state", "sgd", "state_axes",
]
