"""Outer optimization: local SGD with an outer optimizer (DiLoCo), as a pure transform.

Every rank keeps a *global* copy of the parameters: their value at the last
synchronization. Every ``sync_every`` steps the ranks average the pseudo-gradient
``global - local``, take one step of an *outer* optimizer (any functional optimizer
of :mod:`puredist.optim`) on the global copy with it, and write the new global
parameters into the local ones, in place. With outer ``sgd(lr=1)`` (no momentum) this
is exactly periodic model averaging: ``g - mean(g - l) = mean(l)``. The documented
DiLoCo recipe is ``sgd(lr=0.7, momentum=0.9, nesterov=True)``.

Options (static, checked by :func:`outer_optimizer`):

- ``comm_dtype``: the pseudo-gradient is all-reduced in this dtype (e.g. bf16, half the
  bytes of fp32); the outer step runs in the global copy's dtype.
- ``global_dtype``: the global copy and the outer state are kept in this dtype (e.g. an
  fp32 master copy for bf16 parameters, as INTELLECT-1 does; torchft keeps the
  parameters' dtype): the pseudo-gradient ``global - local`` is taken in it, and the
  new global parameters are rounded to the parameters' dtype only when written back.
- ``compressor``: instead, the pseudo-gradient is averaged with a
  :class:`~puredist.compression.Compressor`'s payloads (int8, 4-bit, top-k) and error
  feedback: each rank's residual (what its payloads have not sent yet) is part of the
  state and of the checkpoint. The compressed averaging completes when it starts (the
  ``delay`` still decides when it is applied).
- ``global_device``: where the global copy and the outer state live (e.g. ``"cpu"``).
- ``fragments``: the parameter leaves are cut into this many contiguous fragments of
  about equal size; fragment ``f`` synchronizes ``f * sync_every // fragments`` steps
  after fragment 0, so no synchronization sends the whole model.
- ``delay``: the all-reduce started at step ``k`` is applied at step ``k + delay``
  (``0 <= delay < sync_every``), overlapping the communication with ``delay`` local
  steps; the local progress made meanwhile is kept: ``local <- global_new + (local -
  local_at_k)``. With ``delay=0`` the update is synchronous: ``local <- global_new``.
- ``lower_levels``: ``{period: group_size}`` — hierarchical averaging below the outer
  step: at step ``k`` (after warm-up) the largest of these periods dividing ``k``
  averages, within blocks of its group size, the fragments that are neither starting a
  synchronization at ``k`` nor have one in flight (plain averaging, no outer optimizer:
  the global copy and the outer state change only at outer synchronizations, so they
  stay identical on every rank; and an in-flight fragment's local progress stays its own).

Schedule (:func:`~puredist.outer.schedule.sync_number`): fragment ``f`` synchronizes at
step ``k`` iff ``k - warmup_steps - f * sync_every // fragments >= 0`` and is a multiple
of ``sync_every`` (torch's periodic rule for ``f = 0``). The global
copy starts as the initial parameters, which must be the same on every rank (as DDP's
initial broadcast makes them; ``init`` does not communicate). A fragment's *first*
synchronization only establishes the synchronized point — plain averaging,
``g <- g - mean(g - l) = mean(l)``, the outer state untouched — so that the progress of
the warm-up is not taken as one outer step; the outer optimizer steps from the second on.

The state, :class:`OuterState`, holds the step, the global copy, the outer optimizer's
per-parameter states and the synchronizations in flight; :attr:`OuterTransform.state_dict`
and :attr:`OuterTransform.load_state_dict` turn it into a flat dict of fixed keys (the
same for any state of one transform), which ``torch.save`` and
``torch.distributed.checkpoint`` both store.

Under ``torch.func.vmap`` over simulated replicas (a :class:`~puredist.VmapCollective`)
and under ``torch.compile(fullgraph=True)``, ``update`` runs out of place for
synchronous synchronizations (a compressor's too); the state keeps one structure from
``init`` on, so one vmapped (and compiled) step serves every step, from
``vmap(init, out_dims=puredist.tree.vmap_axes(init(params_of_one_replica)))`` on
(examples/jax_style_diloco.py).

Where things are: :mod:`~puredist.outer.schedule` (which fragment synchronizes when),
:mod:`~puredist.outer.sync` (one synchronization: start, apply),
:mod:`~puredist.outer.update` (one step, eager, pure and traced),
:mod:`~puredist.outer.checkpoint` (what a checkpoint holds),
:mod:`~puredist.outer.state` (the state and the transform's NamedTuples),
:mod:`~puredist.outer.checks` (the state's checks: a step's inputs, a saved
checkpoint), :mod:`~puredist.outer.config` (the options),
:mod:`~puredist.outer.transform` (:func:`outer_optimizer`).
"""

from puredist.outer.config import OuterConfig
from puredist.outer.schedule import split_fragments
from puredist.outer.state import InFlight, OuterState, OuterTransform
from puredist.outer.transform import outer_optimizer

__all__ = ["InFlight", "OuterConfig", "OuterState", "OuterTransform", "outer_optimizer", "split_fragments"]
