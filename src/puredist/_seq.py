"""Passes over sequences that run in C: no Python frame per item.

Host work per call is budgeted (proportional to buckets, not leaves): where a step
asks a question of every tensor of a list, it asks it through ``map`` over a builtin,
as here.

This module must not touch tensor data: it reads Python objects and metadata only.
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Any, Sequence

import torch


def any_none(items: Sequence[object]) -> bool:
    """Whether an item is ``None``."""
    return any(map(operator.is_, items, repeat(None)))


def any_complex(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a tensor is complex."""
    return any(map(torch.is_complex, tensors))


def rows_of(kind: type, *columns: Sequence[Any]) -> list[tuple]:
    """``[kind(*row) for row in zip(*columns)]`` for a NamedTuple ``kind``, the tuples
    built in C (a NamedTuple's own constructor is a Python function: one frame per
    row)."""
    return list(map(tuple.__new__, repeat(kind), zip(*columns)))
