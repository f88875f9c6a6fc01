"""The ZeRO plan: which rank owns (updates, and holds optimizer state for) which
parameter. A pure, deterministic function of the parameters' sizes, the world size
and optionally DDP's gradient buckets (lists of parameter indices, as DDP groups the
gradients it all-reduces: not the staging buckets of :mod:`puredist.staging`): every
rank computes the same plan, no communication.

Strategies (the load of a rank is the number of elements it owns):

- ``"balanced"`` (default): largest-first (LPT) over single parameters: each
  parameter, largest first, goes to the least-loaded rank. Worst rank at most
  ``total/W + (1 - 1/W) * largest`` — within one parameter of the optimum's lower
  bound ``max(largest, total/W)``.
- ``"whole_buckets"``: LPT over whole buckets; a bucket is never split (torch's
  ``shard_buckets=False`` contract, balanced instead of round-robin).
- ``"split_buckets"``: each bucket's parameters are spread over ranks by LPT,
  continuing the loads, largest bucket first (torch's ``shard_buckets=True``: a
  bucket's step is shared by several ranks).
- ``"round_robin_buckets"``: bucket ``i`` goes to rank ``i % W`` — torch's own
  assignment, kept to compare against.

Ties go to the lowest rank; equal sizes keep their index order.
"""

from __future__ import annotations

import functools
import hashlib
from typing import NamedTuple, Sequence

from puredist._docs import fields_documented
from puredist._validation import (
    AT_LEAST_ONE, LENGTH, NON_NEGATIVE_INTS, ONE_OF, PARTITION, Rule, check, check_owners, is_integral,
)

STRATEGIES = ("balanced", "whole_buckets", "split_buckets", "round_robin_buckets")
"""The names of :func:`plan_zero`'s strategies (see the module docstring)."""

__all__ = ["STRATEGIES", "ZeroPlan", "plan_zero", "reverse_order_buckets"]


@functools.lru_cache(maxsize=64)
def _owned(owners: tuple[int, ...], rank: int) -> tuple[int, ...]:
    return tuple(i for i, owner in enumerate(owners) if owner == rank)


@functools.lru_cache(maxsize=256)
def _by_owner(owners: tuple[int, ...], world_size: int, indices: tuple[int, ...]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    groups: list[list[int]] = [[] for _ in range(world_size)]
    for i in indices:
        groups[owners[i]].append(i)
    return tuple((owner, tuple(group)) for owner, group in enumerate(groups) if group)


def _outside(world_size: int, owners: tuple) -> tuple[tuple[int, object], ...]:
    """``(index, owner)`` of each owner that is not a rank in ``[0, world_size)``
    (worked out once per plan and kinds of owner, ZeRO checks at every step: 1, 1.0
    and numpy's 1 are equal keys, so the kinds are part of the key)."""
    return _outside_of(world_size, owners, frozenset(map(type, owners)))


@functools.lru_cache(maxsize=64)
def _outside_of(world_size: int, owners: tuple, kinds: frozenset) -> tuple[tuple[int, object], ...]:
    return tuple((i, owner) for i, owner in enumerate(owners) if not is_integral(owner) or not 0 <= owner < world_size)


_COVERS = Rule(lambda v, b: b["parameters"] is None or v == b["parameters"], ValueError,  # v: the plan's length
               "{what} covers {value} parameters, ``params`` has {parameters}.")


@fields_documented
class ZeroPlan(NamedTuple):
    """Ownership of every parameter (leaf order) among ``world_size`` ranks.

    Attributes:
        world_size: the number of ranks the plan shards over.
        owners: ``owners[i]`` is the rank that updates parameter ``i``.
    """

    world_size: int
    owners: tuple[int, ...]

    def owned_by(self, rank: int) -> tuple[int, ...]:
        """The indices of the parameters ``rank`` owns, increasing (worked out once per
        plan and rank: ZeRO asks at every step)."""
        return _owned(tuple(self.owners), rank)

    def by_owner(self, indices: Sequence[int]) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """``(owner, the indices among indices it owns, in order)`` for each rank that
        owns some, by rank (worked out once per plan and indices: ZeRO asks at every
        step, and per bucket in DDP's backward)."""
        return _by_owner(tuple(self.owners), self.world_size, tuple(indices))

    def check(self, what: str = "Arg ``plan``", *, parameters: int | None = None) -> None:
        """Raise ``ValueError`` (its message starting with ``what``) unless the plan
        covers ``parameters`` (``None``: any number) and every owner is a rank in
        ``[0, world_size)``."""
        check("plan", len(self.owners), _COVERS, what=what, parameters=parameters)
        check_owners(_outside(self.world_size, tuple(self.owners)), world_size=self.world_size, what=what)

    def loads(self, sizes: Sequence[int]) -> list[int]:
        """Elements owned by each rank, given each parameter's element count.

        Raises:
            ValueError: an owner outside the plan's ranks (:meth:`check`).
        """
        self.check()
        loads = [0] * self.world_size
        for owner, size in zip(self.owners, sizes):
            loads[owner] += size
        return loads

    def digest(self) -> str:
        """A short fingerprint of the plan, equal on ranks with equal plans."""
        return hashlib.blake2b(repr(tuple(self)).encode(), digest_size=8).hexdigest()


def _lpt(items: Sequence[tuple[int, Sequence[int]]], loads: list[int], owners: list[int]) -> None:
    """Assign groups ``(size, members)`` largest first to the least-loaded rank."""
    order = sorted(range(len(items)), key=lambda k: (-items[k][0], k))
    for k in order:
        size, members = items[k]
        rank = min(range(len(loads)), key=lambda r: (loads[r], r))
        loads[rank] += size
        for member in members:
            owners[member] = rank


def reverse_order_buckets(nbytes: Sequence[int], bucket_cap_bytes: int, first_bucket_cap_bytes: int) -> list[list[int]]:
    """The bucket layout DDP settles on after its first iteration, for a model whose
    gradients become ready in reverse registration order (the usual case): walking
    the parameters last to first, each joins the open bucket, which closes as soon as
    it holds ``first_bucket_cap_bytes`` (the first bucket) or ``bucket_cap_bytes``
    (the others) or more — torch's ``_compute_bucket_assignment_by_size`` rule, for
    one device and dtype.

    Returns:
        Parameter indices per bucket, in bucket (= gradient-ready) order.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index in reversed(range(len(nbytes))):
        current.append(index)
        current_bytes += nbytes[index]
        if current_bytes >= (first_bucket_cap_bytes if not buckets else bucket_cap_bytes):
            buckets.append(current)
            current, current_bytes = [], 0
    if current:
        buckets.append(current)
    return buckets


def plan_zero(
    sizes: Sequence[int],
    world_size: int,
    *,
    strategy: str = "balanced",
    buckets: Sequence[Sequence[int]] | None = None,
    start_loads: Sequence[int] | None = None,
) -> ZeroPlan:
    """Compute the ownership plan.

    Args:
        sizes: element count of each parameter, in leaf order.
        world_size: ranks to shard over (``>= 1``).
        strategy: one of ``STRATEGIES``.
        buckets: parameter indices per bucket (the DDP layout); required by the
            bucket strategies, ignored by ``"balanced"``.
        start_loads: elements each rank already owns (to plan parameters added
            later, e.g. a new param group, around an existing plan).

    Returns:
        The :class:`ZeroPlan`.

    Raises:
        ValueError: unknown strategy, ``world_size < 1``, negative size, missing or
            malformed ``buckets``.
    """
    check("strategy", strategy, ONE_OF, choices=STRATEGIES)
    check("world_size", world_size, AT_LEAST_ONE)
    sizes = list(sizes)
    check("sizes", sizes, NON_NEGATIVE_INTS)
    owners = [0] * len(sizes)
    loads = list(start_loads) if start_loads is not None else [0] * world_size
    check("start_loads", loads, LENGTH, length=world_size)
    if strategy == "balanced":
        _lpt([(size, (i,)) for i, size in enumerate(sizes)], loads, owners)
        return ZeroPlan(world_size, tuple(owners))
    if buckets is None:
        raise ValueError(f"Arg ``buckets`` is required by strategy {strategy!r}.")
    buckets = [list(bucket) for bucket in buckets]  # (iterators are read once)
    check("buckets", buckets, PARTITION, count=len(sizes))
    if strategy == "whole_buckets":
        _lpt([(sum(sizes[i] for i in bucket), tuple(bucket)) for bucket in buckets], loads, owners)
    elif strategy == "split_buckets":
        by_size = sorted(range(len(buckets)), key=lambda b: (-sum(sizes[i] for i in buckets[b]), b))
        for b in by_size:
            _lpt([(sizes[i], (i,)) for i in buckets[b]], loads, owners)
    else:
        for index, bucket in enumerate(buckets):
            for i in bucket:
                owners[i] = index % world_size
    return ZeroPlan(world_size, tuple(owners))
