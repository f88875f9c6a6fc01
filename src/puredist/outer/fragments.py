"""Which parameter leaves form each fragment: ``fragments`` contiguous runs of about
equal size (:func:`split_fragments`), cut once per layout of the leaves
(:func:`fragment_leaves`). When each fragment synchronizes is
:mod:`puredist.outer.timeline`'s.

This module must not touch tensor values or talk to other ranks.
"""

from __future__ import annotations

from typing import Sequence

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
