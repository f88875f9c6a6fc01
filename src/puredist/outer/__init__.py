"""Outer optimization: local SGD with an outer optimizer (DiLoCo), as a pure transform.

Every rank keeps a *global* copy of the parameters: their value at the last
synchronization. The training loop calls ``update`` (or ``update_``) once after each
inner step; after every ``sync_every`` (``H``) completed inner steps the ranks
average the pseudo-gradient ``global - local``, take one step of an *outer*
optimizer (any functional optimizer of :mod:`puredist.optim`) on the global copy with
it, and write the new global parameters into the local ones, in place: DiLoCo's
Algorithm 1 (Douillard et al. 2023), exactly as torchft's ``DiLoCo`` runs it. With
outer ``sgd(lr=1)`` (no momentum) this is periodic model averaging:
``g - mean(g - l) = mean(l)``. The documented DiLoCo recipe is
``sgd(lr=0.7, momentum=0.9, nesterov=True)``.

Timeline (:func:`~puredist.outer.timeline.sync_kind`), counting completed inner
steps ``c`` (the state's ``step`` after the update)::

    warmup_steps=0, H=4:   c = 1 2 3 [4] 5 6 7 [8] ...   [c]: outer step
    warmup_steps=2, H=4:   c = 1 (2) 3 4 5 [6] 7 8 9 [10] ...   (c): the global copy established

Without a warm-up the global copy is the initial parameters, which must be the same
on every rank (as DDP's initial broadcast makes them; ``init`` does not communicate;
the first update checks them), and the first synchronization is an outer step from
them. A warm-up's end (inner step ``warmup_steps``) establishes the global copy as
the mean of the local parameters, without an outer step, so that the warm-up's
progress is not taken as one. The parameters equal the global copy only after an
update that applied every parameter's last synchronization with no inner step since:
with one fragment and no delay, after inner step ``warmup_steps + n * H``; with
fragments or a delay, ``state.global_params`` holds each fragment's last synchronized
value.

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
  about equal size (Streaming DiLoCo); fragment ``f`` synchronizes ``(f + 1) * H //
  fragments`` inner steps into each period (the last at its end), so no
  synchronization sends the whole model.
- ``delay``: the synchronization started after inner step ``c`` is applied after inner
  step ``c + delay`` (``0 <= delay < sync_every``), overlapping the communication with
  ``delay`` local steps; the local progress made meanwhile is kept: ``local <-
  global_new + (local - local_at_c)``. With ``delay=0`` the update is synchronous:
  ``local <- global_new``.
- ``lower_levels``: ``{period: group_size}`` — hierarchical averaging below the outer
  step: after inner step ``c`` (from the warm-up's end on) the largest of these
  periods dividing ``c`` averages, within blocks of its group size, the fragments
  that are neither starting a synchronization then nor have one in flight (plain
  averaging, no outer optimizer: the global copy and the outer state change only at
  outer synchronizations, so they stay identical on every rank; and an in-flight
  fragment's local progress stays its own).

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

Where things are: :mod:`~puredist.outer.timeline` (when each fragment synchronizes,
and what the synchronization does), :mod:`~puredist.outer.sync` (one
synchronization: the algorithm), :mod:`~puredist.outer.update` (one step: the
synchronizations in the timeline's order), :mod:`~puredist.outer.storage` (how a
fragment's tensors are held: per leaf, flat, DTensor shards, stacked replicas, out of
place), :mod:`~puredist.outer.fragments` (which leaves form each fragment),
:mod:`~puredist.outer.checkpoint` (what a checkpoint holds),
:mod:`~puredist.outer.state` (the state and the transform's NamedTuples),
:mod:`~puredist.outer.checks` (the state's checks: a step's inputs, a saved
checkpoint), :mod:`~puredist.outer.config` (the options),
:mod:`~puredist.outer.transform` (:func:`outer_optimizer`).
"""

from puredist.outer.config import OuterConfig
from puredist.outer.fragments import split_fragments
from puredist.outer.state import InFlight, OuterState, OuterTransform
from puredist.outer.transform import outer_optimizer

__all__ = ["InFlight", "OuterConfig", "OuterState", "OuterTransform", "outer_optimizer", "split_fragments"]
