"""One fragment's synchronization, as DiLoCo's Algorithm 1 has it (Douillard et al.
2023): start it, then apply it.

- :func:`start`, after inner step ``c``: the pseudo-gradient ``Δ = global - local``
  (in the global copy's dtype, sent in ``comm_dtype`` or as a compressor's payloads
  with error feedback), averaged over the ranks, ``Δ̄ = mean(Δ)``; with a ``delay``,
  a snapshot of the local parameters, and the averaging left running.
- :func:`apply`, after inner step ``c + delay``: one outer step on the global copy
  with ``Δ̄`` as its gradient (or, where the synchronization ends a warm-up, plain
  averaging ``global - Δ̄ = mean(local)``: :func:`~puredist.outer.timeline.sync_kind`
  says which), then the new global copy written into the local parameters:
  ``local <- global``, or with a delay ``local <- global + (local - snapshot)`` (the
  progress made while the averaging ran is kept).

How the fragment's tensors are held (per leaf, flat, DTensor shards, out of place)
is the :class:`~puredist.outer.storage.base.Storage`'s; when a synchronization runs is
:mod:`puredist.outer.timeline`'s.
"""

from __future__ import annotations

from typing import NamedTuple

from puredist.collectives import Collective
from puredist.outer.config import OuterConfig
from puredist.outer.state import InFlight
from puredist.outer.storage import Fragment, Storage
from puredist.outer.storage.base import COMPLETED
from puredist.outer.timeline import SyncKind, sync_kind


class SyncContext(NamedTuple):
    """The rank-check context of one synchronization, formatted only when checked."""

    config: OuterConfig
    fragment: int
    started: int

    def __str__(self) -> str:
        return f"{self.config} sync of fragment {self.fragment} started after inner step {self.started}"


def start(config: OuterConfig, storage: Storage, fragment: Fragment, count: int,
          collective: Collective) -> tuple[InFlight, list]:
    """Start ``fragment``'s synchronization after inner step ``count``:
    ``(the synchronization in flight, the fragment's residuals after it)``. With a
    compressor it completes here (its new residuals returned); without one, with a
    delay, its averaging runs in the background; a failure raises here, before
    anything is applied."""
    payload = storage.pseudo_gradient(fragment)
    snapshot = storage.snapshot(fragment) if config.delay else ()
    context = SyncContext(config, fragment.index, count)
    if config.compressor is None:
        averaged, handle = storage.average(payload, collective, context=context, async_op=bool(config.delay))
        return InFlight(count, fragment.index, averaged, snapshot, handle), fragment.residuals
    averaged, residuals = storage.compress(payload, fragment, config.compressor, collective, context=context)
    return InFlight(count, fragment.index, tuple(averaged), snapshot, COMPLETED), residuals


def issue_again(config: OuterConfig, item: InFlight, collective: Collective) -> InFlight:
    """``item``, a delayed synchronization whose averaging failed (nothing was
    written), with its averaging issued again on ``collective``."""
    context = SyncContext(config, item.fragment, item.started)
    return item._replace(handle=collective.mean_(item.pseudo_grads, async_op=True, context=context))


def apply(config: OuterConfig, storage: Storage, fragment: Fragment, item: InFlight) -> Fragment:
    """Apply the completed synchronization ``item`` to ``fragment``: the fragment with
    its new global copy, outer states and local parameters (written in place by an
    in-place storage, new by the traced one)."""
    grads = storage.outer_grads(item.pseudo_grads, fragment)
    if sync_kind(config, item.fragment, item.started) is SyncKind.ESTABLISH:
        globals_, states = storage.establish(fragment, grads), fragment.states
    else:
        globals_, states = storage.outer_step(fragment, grads)
    locals_ = storage.write_back(fragment, globals_, item.snapshot)
    return fragment._replace(locals=locals_, globals=globals_, states=states)
