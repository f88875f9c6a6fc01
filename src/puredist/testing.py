"""Hypothesis strategies for property tests of distributed code, in one process.

Generate parameter trees and replica worlds, then check a step function on
``SimulatedCollective`` (stacked tensors) or under ``torch.func.vmap`` with a
``VmapCollective`` against an oracle of your own::

    from hypothesis import given
    from puredist.testing import replica_worlds

    @given(replica_worlds())
    def test_my_step(world):
        replicas, group_size, tree = world  # tree leaves are [replicas, *shape]
        ...

A failing example prints each tensor's shape, dtype and values (see :func:`shown`).

Needs ``hypothesis``: ``pip install -e '.[testing]' -c constraints.txt`` in puredist's clone.

This module must not be imported by the library itself: it needs ``hypothesis``, a
test dependency.
"""

from typing import NamedTuple, Sequence

import torch

try:
    from hypothesis import note, strategies as st
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("puredist.testing needs hypothesis: pip install -e '.[testing]' -c constraints.txt "
                      "(in puredist's clone)") from error

from puredist._validation import AT_LEAST_ONE, FLOAT_DTYPES, NOT_EMPTY, check, check_each
from puredist.tree import PyTree, tree_map

__all__ = ["DTYPES", "ReplicaWorld", "divisors", "parameter_trees", "replica_worlds", "shown"]

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
"""The floating-point dtypes the strategies draw from by default."""


class _Shown:
    """A tensor's description for a failing example's report: shape, dtype, values."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __repr__(self) -> str:
        values = self.tensor.detach().double().tolist()  # (every value: the strategies' tensors are small)
        return f"tensor(shape={tuple(self.tensor.shape)}, {self.tensor.dtype}, {values})"


def shown(tree: PyTree) -> str:
    """``tree`` as text, each tensor as its shape, dtype and values (every value: for
    the strategies' small tensors), e.g. ``{'w': tensor(shape=(2,), torch.float32,
    [0.5, -1.0])}``."""
    return repr(tree_map(_Shown, tree))


class ReplicaWorld(NamedTuple):
    """A draw of :func:`replica_worlds` (unpacks as ``replicas, group_size, tree``);
    printed with its tensors' shapes, dtypes and values (:func:`shown`).

    Attributes:
        replicas: the number of simulated ranks.
        group_size: a group size dividing ``replicas``.
        tree: a parameter tree, each tensor stacked ``[replicas, *shape]``.
    """

    replicas: int
    group_size: int
    tree: PyTree

    def __repr__(self) -> str:
        return f"ReplicaWorld(replicas={self.replicas}, group_size={self.group_size}, tree={shown(self.tree)})"

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # hypothesis prints examples with this
        printer.text(repr(self))


def divisors(n: int) -> list[int]:
    """The group sizes ``n`` replicas can be split into: the divisors of ``n``."""
    return [d for d in range(1, n + 1) if n % d == 0]


def parameter_trees(
    replicas: int | None = None, dtypes: Sequence[torch.dtype] = DTYPES, max_leaves: int = 8
) -> st.SearchStrategy[PyTree]:
    """A nested pytree (dicts, lists, tuples, ``None`` leaves) of random tensors of
    up to 3 dimensions of size 1 to 4, each of one of ``dtypes``; with ``replicas``,
    every tensor has a leading replica axis of that size (rank ``r`` is row ``r``).
    A failing example's report notes the tree with its tensors' shapes, dtypes and
    values (:func:`shown`).

    Raises:
        ValueError: ``replicas`` or ``max_leaves`` not an int >= 1, or ``dtypes``
            empty or holding a dtype that is not floating-point.
    """
    if replicas is not None:
        check("replicas", replicas, AT_LEAST_ONE)
    check("max_leaves", max_leaves, AT_LEAST_ONE)
    check("dtypes", list(dtypes), FLOAT_DTYPES)
    return _parameter_trees(replicas, tuple(dtypes), max_leaves)


@st.composite
def _parameter_trees(draw, replicas: int | None, dtypes: Sequence[torch.dtype], max_leaves: int) -> PyTree:
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lead = () if replicas is None else (replicas,)

    def leaf(shape, dtype):
        return torch.randn((*lead, *shape), generator=gen, dtype=torch.float64).to(dtype)

    leaves = st.builds(leaf, st.lists(st.integers(1, 4), max_size=3), st.sampled_from(list(dtypes)))
    tree = st.recursive(
        leaves,
        lambda children: st.one_of(
            st.dictionaries(st.sampled_from("zyxwab"), children, max_size=3),
            st.lists(children, max_size=3),
            st.tuples(children, st.none()),
        ),
        max_leaves=max_leaves,
    )
    drawn = draw(tree)
    note(f"parameter tree: {shown(drawn)}")
    return drawn


def replica_worlds(
    replica_counts: Sequence[int] = (1, 2, 3, 4, 6, 8), dtypes: Sequence[torch.dtype] = DTYPES
) -> st.SearchStrategy[ReplicaWorld]:
    """A :class:`ReplicaWorld` ``(replicas, group_size, tree)``: a number of simulated ranks, a group size
    dividing it (a level of a hierarchy), and a :func:`parameter_trees` tree with
    that many replicas.

    Raises:
        ValueError: ``replica_counts`` empty or holding a count that is not an int
            >= 1; ``dtypes`` as :func:`parameter_trees`.
    """
    replica_counts = tuple(replica_counts)
    check("replica_counts", replica_counts, NOT_EMPTY)
    check_each("replica_counts", replica_counts, AT_LEAST_ONE)
    check("dtypes", list(dtypes), FLOAT_DTYPES)
    return _replica_worlds(replica_counts, tuple(dtypes))


@st.composite
def _replica_worlds(draw, replica_counts: Sequence[int], dtypes: Sequence[torch.dtype]):
    replicas = draw(st.sampled_from(list(replica_counts)))
    group_size = draw(st.sampled_from(divisors(replicas)))
    return ReplicaWorld(replicas, group_size, draw(parameter_trees(replicas, dtypes)))
