"""Ranks that disagree about the schedule (configuration or step) raise
RankMismatchError on every rank at the first mismatched collective, with nothing
changed, instead of pairing different steps' collectives until a timeout."""

import time

import pytest
import torch

import puredist
from puredist import DistributedCollective, RankMismatchError
from puredist.classic import ZeroRedundancyOptimizer
from workers import run_workers

BUILDERS = {
    "period": lambda rank: puredist.periodic_averager(period=2 if rank == 0 else 4, warmup_steps=0),
    "warmup": lambda rank: puredist.periodic_averager(period=2, warmup_steps=1 if rank == 0 else 3),
    "hierarchy": lambda rank: puredist.hierarchical_averager({2: 2, 4: 4} if rank < 2 else {2: 2, 6: 4}),
    "sync_every": lambda rank: puredist.outer_optimizer(puredist.sgd(lr=1.0), sync_every=2 if rank == 0 else 4),
    "delay": lambda rank: puredist.outer_optimizer(puredist.sgd(lr=1.0), sync_every=4, delay=rank % 2),
}


def _mismatched(rank, world_size, kind):
    transform = BUILDERS[kind](rank)
    collective = DistributedCollective.with_subgroups([2, 4]) if kind == "hierarchy" else DistributedCollective()
    params = [torch.zeros(3)]
    state = transform.init(params)  # equal on every rank, as DDP makes them
    params[0].add_(rank)
    for step in range(12):
        before = params[0].clone()
        try:
            state = transform.update_(params, state, collective=collective)
        except RankMismatchError as error:
            assert torch.equal(params[0], before)  # nothing changed
            return step, str(error)
    return None


def _first_collective_step(kind: str, rank: int) -> int:
    """Brute force, by torch's rules: the first step at which this rank communicates.
    Every configuration differs between the ranks, so the first collectives already
    mismatch: each rank raises at its own first one."""
    if kind == "period":
        period, warmup = (2 if rank == 0 else 4), 0
    elif kind == "warmup":
        period, warmup = 2, (1 if rank == 0 else 3)
    else:  # hierarchical (a period divides step 0) and DiLoCo (its initial check at step 0)
        return 0
    return next(k for k in range(100) if k >= warmup and (k - warmup) % period == 0)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_different_schedules_raise_on_every_rank_at_the_first_mismatch(kind):
    world_size = 4 if kind == "hierarchy" else 2
    results = run_workers(_mismatched, world_size, kind)
    assert all(r is not None for r in results), results
    assert [step for step, _ in results] == [_first_collective_step(kind, rank) for rank in range(world_size)]
    for _, message in results:
        assert "different steps or run different schedules" in message and "context" in message


def _different_steps(rank, world_size, transform_kind):
    if transform_kind == "averager":
        transform = puredist.periodic_averager(period=2)
    else:
        transform = puredist.outer_optimizer(puredist.sgd(lr=1.0), sync_every=2)
    params = [torch.zeros(3)]
    state = transform.init(params)
    params[0].add_(rank)
    # restored from another checkpoint: steps ahead, at an averaging step (DiLoCo's update after inner step 4)
    ahead, named = (2, "step 2") if transform_kind == "averager" else (3, "after inner step 4")
    if rank == 1:
        state = state._replace(step=ahead)
    before = params[0].clone()
    with pytest.raises(RankMismatchError, match=rf"(?s)different steps.*step 0.*{named}"):
        transform.update_(params, state, collective=DistributedCollective())
    assert torch.equal(params[0], before)
    return True


@pytest.mark.parametrize("transform_kind", ["averager", "outer"])
def test_ranks_at_different_steps_raise_instead_of_pairing_the_steps(transform_kind):
    assert run_workers(_different_steps, 2, transform_kind) == [True, True]


def _zero_extra_step(rank, world_size):
    params = [torch.nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(0)))]
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)
    params[0].grad = torch.ones(4)
    if rank == 0:
        zero._end_iteration()  # as if rank 0 had taken one more step
    before = params[0].detach().clone()
    with pytest.raises(RankMismatchError, match="different steps"):
        zero.step()
    assert torch.equal(params[0].detach(), before)
    return True


def test_an_extra_zero_step_on_one_rank_raises_on_every_rank():
    assert run_workers(_zero_extra_step, 2) == [True, True]


def _different_bucket_caps(rank, world_size):
    # a different cap cuts the same tensors into different messages: Gloo aborted the process
    # ("Received data size doesn't match expected size") before the cap was part of the check
    collective = DistributedCollective(bucket_cap_bytes=64 if rank == 0 else 256)
    params = [torch.full((40,), float(rank)), torch.full((7,), float(rank))]
    before = [p.clone() for p in params]
    with pytest.raises(RankMismatchError, match=r"(?s)bucket_cap_bytes=64.*bucket_cap_bytes=256") as error:
        puredist.average_(params, collective=collective)
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # nothing changed
    return str(error.value)


def test_collectives_with_different_bucket_caps_raise_on_every_rank_naming_the_cap():
    for message in run_workers(_different_bucket_caps, 2):
        assert "different steps or run different schedules" in message


def _one_rank_passes_a_leaf_it_cannot_average(rank, world_size, path):
    params = [torch.ones(3), torch.ones(2) if rank == 0 else torch.ones(2, dtype=torch.int64)]
    collective = puredist.DistributedCollective()
    averager = puredist.periodic_averager(2)
    calls = {
        "average_": lambda: puredist.average_(params, collective=collective),
        "average": lambda: puredist.average(params, collective=collective),
        "averager update_": lambda: averager.update_(params, averager.init(), collective=collective),
        "collective mean_": lambda: collective.mean_(params),
        "collective mean": lambda: collective.mean(params),
    }
    started = time.monotonic()
    if path.startswith("DiLoCo"):  # steps with valid leaves up to the step named, then rank 1's int64 leaf
        options = {"int8": dict(compressor=puredist.int8_blocks()), "lower level": dict(lower_levels={1: 2})}
        kind = path.split(", ")[-1]
        diloco = puredist.outer_optimizer(puredist.sgd(0.7, momentum=0.9), sync_every=3, warmup_steps=1,
                                          **options.get(kind, {}))
        good = [torch.ones(3), torch.ones(2)]
        state = diloco.init(good)
        until = {"step 0": 0, "a synchronization": 3, "int8": 6, "lower level": 2}[kind]  # (synchronizing after 1, 4, 7)
        while state.step < until:
            state = diloco.update_(good, state, collective=collective)
        update = diloco.update if "pure" in path else diloco.update_
        calls[path] = lambda: update(params, state, collective=collective)
    try:
        calls[path]()
    except Exception as error:  # noqa: BLE001 - the type and message are the result
        return type(error).__name__, str(error), time.monotonic() - started
    return None, "", time.monotonic() - started


@pytest.mark.parametrize("path", ["average_", "average", "averager update_", "collective mean_", "collective mean",
                                  "DiLoCo, step 0", "DiLoCo pure update, step 0",
                                  "DiLoCo, a synchronization", "DiLoCo, int8", "DiLoCo, lower level"])
def test_a_rank_refusing_its_input_makes_its_peers_raise_at_once_instead_of_waiting(path):
    # rank 1's int64 leaf cannot be averaged: it raises TypeError before any collective; its peer, about to
    # reduce, must learn it through the rank check (RankMismatchError naming the refusal), not by a timeout
    (peer, peer_message, peer_s), (refuser, refuser_message, _) = run_workers(
        _one_rank_passes_a_leaf_it_cannot_average, 2, path, timeout=60, gloo_timeout=20)
    assert refuser == "TypeError" and ("leaf 1" in refuser_message or "tensor 1" in refuser_message), refuser_message
    assert peer == "RankMismatchError" and "refused: TypeError" in peer_message, peer_message
    assert peer_s < 10


def _the_default_cap_given_or_not(rank, world_size):
    # the same caps in effect, spelled two ways: the same messages, so the same check
    collective = DistributedCollective(bucket_cap_bytes=puredist.DEFAULT_BUCKET_CAP_BYTES if rank == 0 else None)
    params = [torch.full((40,), float(rank))]
    puredist.average_(params, collective=collective)
    return params[0][0].item()


def test_a_collective_given_the_default_cap_checks_equal_to_one_given_none():
    assert run_workers(_the_default_cap_given_or_not, 2) == [0.5, 0.5]
