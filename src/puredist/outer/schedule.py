"""When each fragment synchronizes, and what each synchronization is: pure functions
of a step and an :class:`~puredist.outer.config.OuterConfig`.

Fragment ``f`` synchronizes at step ``k`` iff ``k - warmup_steps - offsets[f] >= 0``
and is a multiple of ``sync_every`` (torch's periodic rule for ``f = 0``); the one
started at ``k`` is applied at ``k + delay``. A fragment's first synchronization only
establishes the synchronized point (plain averaging). At a step where a lower level is
due, it averages the fragments that neither start a synchronization nor have one in
flight.

This module must not touch tensor values or talk to other ranks.
"""

from __future__ import annotations

from typing import Collection, Sequence

import torch

from puredist._inputs import Checked
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


def due_fragments(config: OuterConfig, step: int) -> list[int]:
    """The fragments whose synchronization starts at ``step``."""
    since = step - config.warmup_steps
    return [f for f, offset in enumerate(config.offsets) if since - offset >= 0 and (since - offset) % config.sync_every == 0]


def is_first_sync(config: OuterConfig, fragment: int, start_step: int) -> bool:
    """Whether the synchronization of ``fragment`` started at ``start_step`` is its
    first, which only establishes the synchronized point (plain averaging)."""
    return start_step == config.warmup_steps + config.offsets[fragment]


def lower_level_fragments(config: OuterConfig, step: int, busy: Collection[int]) -> tuple[int | None, list[int]]:
    """``(level, fragments)``: the index into ``config.lower_sizes`` of the lower level
    that averages at ``step`` (``None``: none) and the fragments it averages: those not
    in ``busy`` (starting a synchronization at ``step`` or with one in flight)."""
    level = config.lower_level(step)
    if level is None:
        return None, []
    return level, [f for f in range(config.fragments) if f not in busy]
