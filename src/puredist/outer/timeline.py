"""When each fragment synchronizes, and what each synchronization is: pure functions
of an :class:`~puredist.outer.config.OuterConfig` and a count of completed inner steps.

``update`` runs once after each inner step, so the update that completes inner step
``c`` is the one that returns a state of step ``c``: that ``c`` is the *count* every
function here takes. One function holds the rule, :func:`sync_kind`:

- fragment ``f`` synchronizes after inner step ``c`` iff ``c >= 1`` and
  ``c - warmup_steps - offset(f)`` is a non-negative multiple of ``sync_every`` (``H``),
  where ``offset(f) = (f + 1) * H // fragments`` taken modulo ``H``
  (:func:`fragment_offset`): the fragments staggered evenly over a period, the last
  one at the period's end (torchft's order; one fragment: after inner steps ``H, 2H,
  ...``, DiLoCo's Algorithm 1);
- each synchronization takes an outer step, but for the one that ends a warm-up:
  with ``warmup_steps > 0``, a fragment's first synchronization (at
  ``warmup_steps + offset(f)``) only establishes the global copy as the mean of the
  local parameters, so that the warm-up's progress is not taken as one outer step.
  Without a warm-up the global copy is the initial parameters, and the first
  synchronization is an outer step from them.

The synchronization started after inner step ``c`` is applied after inner step ``c +
delay``. A lower level of ``lower_levels`` averages after the inner steps its period
divides (from the warm-up's end on), the fragments neither starting a
synchronization nor having one in flight.

This module must not touch tensor values or talk to other ranks.
"""

from __future__ import annotations

import enum
from typing import Collection

from puredist.outer.config import OuterConfig


class SyncKind(enum.Enum):
    """What a synchronization does with the averaged pseudo-gradient."""

    ESTABLISH = "establishes the global copy (the warm-up's end: plain averaging)"
    OUTER_STEP = "takes an outer step"


def fragment_offset(config: OuterConfig, fragment: int) -> int:
    """Inner steps from a period's start (the warm-up's end) to ``fragment``'s
    synchronization in it: ``(fragment + 1) * sync_every // fragments``, modulo
    ``sync_every`` (the last fragment's is 0: the period's end)."""
    return (fragment + 1) * config.sync_every // config.fragments % config.sync_every


def sync_kind(config: OuterConfig, fragment: int, count: int) -> SyncKind | None:
    """What ``fragment``'s synchronization started after inner step ``count`` does;
    ``None`` where none starts then. The schedule's one rule (see the module
    docstring)."""
    since = count - config.warmup_steps - fragment_offset(config, fragment)
    if count < 1 or since < 0 or since % config.sync_every:
        return None
    return SyncKind.ESTABLISH if config.warmup_steps and not since else SyncKind.OUTER_STEP


def due_fragments(config: OuterConfig, count: int) -> list[int]:
    """The fragments whose synchronization starts after inner step ``count`` (at most
    one: the offsets differ)."""
    return [f for f in range(config.fragments) if sync_kind(config, f, count) is not None]


def outer_step_fragments(config: OuterConfig, count: int) -> list[int]:
    """The fragments whose synchronization applied after inner step ``count`` takes
    an outer step (started ``delay`` inner steps before)."""
    started = count - config.delay
    return [f for f in range(config.fragments) if sync_kind(config, f, started) is SyncKind.OUTER_STEP]


def started_in_flight(config: OuterConfig, fragment: int, count: int) -> int:
    """The count after which ``fragment``'s synchronization still in flight after
    inner step ``count`` started (applied after a later one); ``-1`` where none is."""
    started = [c for c in range(max(count - config.delay + 1, 1), count + 1) if sync_kind(config, fragment, c)]
    return started[-1] if started else -1


def lower_level_fragments(config: OuterConfig, count: int, busy: Collection[int]) -> tuple[int | None, list[int]]:
    """``(level, fragments)``: the index into ``config.lower_sizes`` of the lower level
    that averages after inner step ``count`` (``None``: none) and the fragments it
    averages: those not in ``busy`` (starting a synchronization then, or with one in
    flight)."""
    level = config.lower_level(count)
    if level is None:
        return None, []
    return level, [f for f in range(config.fragments) if f not in busy]
