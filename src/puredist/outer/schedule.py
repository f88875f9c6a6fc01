"""When each fragment synchronizes, and what each synchronization is: pure functions
of a step and an :class:`~puredist.outer.config.OuterConfig`.

One function says when each fragment synchronizes, :func:`sync_number`: fragment
``f``'s first synchronization starts at ``warmup_steps + f * sync_every // fragments``
(the fragments staggered evenly over a period; torch's periodic rule for ``f = 0``),
then one every ``sync_every`` steps. Which fragments are due at a step
(:func:`due_fragments`) and whether a synchronization is a fragment's first
(:func:`is_first_sync`, which only establishes the synchronized point: plain
averaging) follow from it. The one started at ``k`` is applied at ``k + delay``. At a
step where a lower level is due, it averages the fragments that neither start a
synchronization nor have one in flight.

This module must not touch tensor values or talk to other ranks.
"""

from __future__ import annotations

from typing import Collection, Sequence

import torch

from puredist._layout import Checked
from puredist.outer.config import OuterConfig


def split_fragments(sizes: Sequence[int], count: int) -> tuple[tuple[int, ...], ...]:
    """Cut leaf indices ``0..len(sizes)-1`` into ``count`` non-empty contiguous runs of
    about equal total size: a run ends once the running total reaches its share
    ``(f + 1) * total / count``, leaving at least one leaf for every later run."""
    fragments: list[tuple[int, ...]] = []
    total, running, start = sum(sizes), 0, 0
    for index, size in enumerate(sizes):
        running += size
        remaining_leaves = len(sizes) - index - 1
        remaining_runs = count - len(fragments) - 1
        share_reached = running * count >= (len(fragments) + 1) * total
        if remaining_runs > 0 and (share_reached or remaining_leaves == remaining_runs):
            fragments.append(tuple(range(start, index + 1)))
            start = index + 1
    fragments.append(tuple(range(start, len(sizes))))
    return tuple(fragments)


def fragment_leaves(config: OuterConfig, leaves: Sequence[torch.Tensor]) -> tuple[tuple[int, ...], ...]:
    """The leaf indices of each fragment (cut once per layout of checked leaves).

    Raises:
        ValueError: more fragments than leaves.
    """
    fragments = config.fragments
    if fragments > len(leaves):
        raise ValueError(f"Arg ``fragments`` {fragments} exceeds the {len(leaves)} parameter leaves.")
    if isinstance(leaves, Checked):  # the same leaves every step: cut once
        return leaves.layout.derived(("fragments", fragments), lambda: fragment_leaves(config, list(leaves)))
    return split_fragments([leaf.numel() for leaf in leaves], fragments)


def sync_number(config: OuterConfig, fragment: int, step: int) -> int | None:
    """Which synchronization of ``fragment`` starts at ``step``: ``0`` for its first,
    ``n`` for the one ``n * sync_every`` steps later, ``None`` where none starts.

    The schedule's one rule: the first starts ``fragment * sync_every // fragments``
    steps after the warm-up, the next ones every ``sync_every`` steps."""
    since = step - config.warmup_steps - fragment * config.sync_every // config.fragments
    if since < 0 or since % config.sync_every:
        return None
    return since // config.sync_every


def due_fragments(config: OuterConfig, step: int) -> list[int]:
    """The fragments whose synchronization starts at ``step``."""
    return [f for f in range(config.fragments) if sync_number(config, f, step) is not None]


def is_first_sync(config: OuterConfig, fragment: int, start_step: int) -> bool:
    """Whether the synchronization of ``fragment`` started at ``start_step`` is its
    first, which only establishes the synchronized point (plain averaging)."""
    return sync_number(config, fragment, start_step) == 0


def outer_step_fragments(config: OuterConfig, step: int) -> list[int]:
    """The fragments whose synchronization is applied at ``step`` as an outer step:
    started ``delay`` steps before, and not the fragment's first (which only
    averages)."""
    started = step - config.delay
    return [f for f in due_fragments(config, started) if not is_first_sync(config, f, started)]


def lower_level_fragments(config: OuterConfig, step: int, busy: Collection[int]) -> tuple[int | None, list[int]]:
    """``(level, fragments)``: the index into ``config.lower_sizes`` of the lower level
    that averages at ``step`` (``None``: none) and the fragments it averages: those not
    in ``busy`` (starting a synchronization at ``step`` or with one in flight)."""
    level = config.lower_level(step)
    if level is None:
        return None, []
    return level, [f for f in range(config.fragments) if f not in busy]
