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

Needs ``hypothesis`` (``pip install puredist[test]``).

This module must not be imported by the library itself: it needs ``hypothesis``, a
test dependency.
"""

from typing import Sequence

import torch

try:
    from hypothesis import strategies as st
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("puredist.testing needs hypothesis: pip install 'puredist[test]'") from error

from puredist.tree import PyTree

__all__ = ["DTYPES", "divisors", "parameter_trees", "replica_worlds"]

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
"""The floating-point dtypes the strategies draw from by default."""


def divisors(n: int) -> list[int]:
    """The group sizes ``n`` replicas can be split into: the divisors of ``n``."""
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def parameter_trees(
    draw, replicas: int | None = None, dtypes: Sequence[torch.dtype] = DTYPES, max_leaves: int = 8
) -> PyTree:
    """A nested pytree (dicts, lists, tuples, ``None`` leaves) of random tensors of
    up to 3 dimensions of size 1 to 4, each of one of ``dtypes``; with ``replicas``,
    every tensor has a leading replica axis of that size (rank ``r`` is row ``r``)."""
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
    return draw(tree)


@st.composite
def replica_worlds(draw, replica_counts: Sequence[int] = (1, 2, 3, 4, 6, 8), dtypes: Sequence[torch.dtype] = DTYPES):
    """``(replicas, group_size, tree)``: a number of simulated ranks, a group size
    dividing it (a level of a hierarchy), and a :func:`parameter_trees` tree with
    that many replicas."""
    replicas = draw(st.sampled_from(list(replica_counts)))
    group_size = draw(st.sampled_from(divisors(replicas)))
    return replicas, group_size, draw(parameter_trees(replicas, dtypes))
