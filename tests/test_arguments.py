"""Bad arguments are refused by name (the argument and its value), when a transform is
built or before anything is touched, and the classic classes take what torch's take.
Each case was found by a review: before, it failed deep inside with an unrelated
message, or silently did something else."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist

import puredist
from puredist import SimulatedCollective
from puredist.classic import HierarchicalModelAverager, ZeroRedundancyOptimizer
from workers import run_workers


def test_plan_zero_reads_buckets_given_as_iterators_once():
    # a generator was used up by the check, and every parameter went to rank 0
    as_lists = puredist.plan_zero([4, 4, 4, 4], 2, strategy="whole_buckets", buckets=[[0, 1], [2, 3]])
    for strategy in ("whole_buckets", "split_buckets", "round_robin_buckets"):
        lists = puredist.plan_zero([4, 4, 4, 4], 2, strategy=strategy, buckets=[[0, 1], [2, 3]])
        lazy = puredist.plan_zero([4, 4, 4, 4], 2, strategy=strategy, buckets=(iter(b) for b in ([0, 1], [2, 3])))
        assert lazy == lists, strategy
    assert as_lists.owners == (0, 0, 1, 1)
    with pytest.raises(ValueError, match=r"Arg ``sizes`` must be non-negative ints, got \[None, 1\]"):
        puredist.plan_zero([None, 1], 2)


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: puredist.compressed_averager(puredist.int8_blocks), TypeError, r"Arg ``compressor`` must be a puredist"),
        (lambda: puredist.compressed_averager(None), TypeError, r"Arg ``compressor``.*got None"),
        (lambda: puredist.outer_optimizer(puredist.sgd, sync_every=4), TypeError, r"Arg ``outer`` must be a puredist"),
        (lambda: puredist.outer_optimizer(torch.optim.SGD, sync_every=4), TypeError, r"Arg ``outer``.*SGD"),
        (lambda: puredist.zero(puredist.sgd), TypeError, r"Arg ``optimizer`` must be a puredist optimizer"),
        (lambda: puredist.outer_optimizer(puredist.sgd(0.7), sync_every=4, global_device="cpuu"), TypeError,
         r"Arg ``global_device``.*'cpuu'"),
        (lambda: puredist.outer_optimizer(puredist.sgd(0.7), sync_every=4, global_device=3.5), TypeError,
         r"Arg ``global_device``.*3.5"),
        (lambda: puredist.outer_optimizer(puredist.sgd(0.7), sync_every=4, global_device="meta"), ValueError,
         r"Arg ``global_device`` 'meta'"),
        (lambda: puredist.outer_optimizer(puredist.sgd(0.7), sync_every=4, global_dtype=torch.float8_e4m3fn),
         TypeError, r"Arg ``global_dtype``.*float8"),
        (lambda: puredist.outer_optimizer(puredist.sgd(0.7), sync_every=4, comm_dtype=torch.float8_e5m2),
         TypeError, r"Arg ``comm_dtype``.*float8"),
        (lambda: puredist.outer_optimizer(puredist.sgd(0.7), sync_every=4, lower_levels=[2]), TypeError,
         r"Arg ``lower_levels`` must be a mapping"),
        (lambda: puredist.hierarchical_averager(None), TypeError, r"Arg ``period_group_sizes`` must be a mapping"),
        (lambda: puredist.adam(1e-3, betas=(0.9, "0.999")), ValueError, r"Arg ``betas``.*'0.999'"),
        (lambda: puredist.adamw(1e-3, betas=(0.9, None)), ValueError, r"Arg ``betas``.*None"),
        (lambda: puredist.sgd(0.1, foreach=True, fused=True), ValueError,
         r"Args ``foreach`` \(True\) and ``fused`` \(True\) cannot both be True"),
        (lambda: puredist.adam(1e-3, foreach=True, fused=True), ValueError, r"``foreach``.*``fused``.*pick one kernel"),
        (lambda: puredist.int4_blocks(6.0), ValueError, r"Arg ``block_size`` must be a positive int, got 6.0"),
        (lambda: puredist.top_k(True), ValueError, r"Arg ``fraction`` must be in \(0, 1\], got True"),
    ],
)
def test_a_bad_argument_is_refused_by_name_when_built(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_a_bad_collective_group_size_or_rank_is_refused_by_name():
    params = [torch.ones(2, 3)]
    with pytest.raises(TypeError, match=r"Arg ``collective`` must be a puredist collective.*NoneType"):
        puredist.average_(params, collective=None)
    with pytest.raises(TypeError, match=r"Arg ``collective``"):
        puredist.average(params, collective="gloo")
    averager = puredist.periodic_averager(2)
    with pytest.raises(TypeError, match=r"Arg ``collective``"):
        averager.update_(params, averager.init(), collective=None)
    assert torch.equal(params[0], torch.ones(2, 3))
    plan = puredist.plan_zero([3], 2)
    for rank in ("0", True, 0.0):
        with pytest.raises(ValueError, match=r"Arg ``rank`` must be an int in \[0, 2\)"):
            puredist.zero(puredist.sgd(0.1)).init([torch.ones(3)], plan=plan, rank=rank)


def test_a_range_refuses_its_exclusive_bound_and_takes_the_last_value_below_it():
    from torch.func import vmap

    plan = puredist.plan_zero([3, 2], 2)
    with pytest.raises(ValueError, match=r"Arg ``rank`` must be an int in \[0, 2\).*got 2"):
        puredist.zero(puredist.sgd(0.1)).init([torch.ones(3), torch.ones(2)], plan=plan, rank=2)
    puredist.zero(puredist.sgd(0.1)).init([torch.ones(3), torch.ones(2)], plan=plan, rank=1)
    rows = torch.arange(6.0).view(3, 2)
    with pytest.raises(ValueError, match=r"Arg ``src`` must be an int in \[0, 3\), got 3"):
        vmap(lambda t: puredist.VmapCollective(3).broadcast([t], src=3)[0])(rows)
    assert torch.equal(vmap(lambda t: puredist.VmapCollective(3).broadcast([t], src=2)[0])(rows), rows[2].expand(3, 2))


def test_a_block_longer_than_the_values_is_one_block_of_them():
    # a block of 2**40 elements was padded to its full size on first use (an allocation of 4 TB)
    values = torch.randn(37)
    for huge, fitting in ((puredist.int8_blocks(2**40), puredist.int8_blocks(37)),
                          (puredist.int4_blocks(2**40), puredist.int4_blocks(38))):
        payload, exact = huge.encode(values), fitting.encode(values)
        assert all(torch.equal(a, b) for a, b in zip(payload, exact))
        assert torch.equal(huge.decode(payload, 37), fitting.decode(exact, 37))
    # blocks shorter than the values are as before: whole blocks, the last one padded
    q, scales = puredist.int4_blocks(8).encode(values)
    assert scales.numel() == 5 and q.numel() == 20
    # rounding to the nearest of [-7, 7] * scale (scale = the block's absmax / 7) errs by at most half a scale
    padded = torch.cat([values, values.new_zeros(3)]).view(5, 8)
    half_scale = (padded.abs().amax(dim=1, keepdim=True) / 14).expand(5, 8).reshape(-1)[:37]
    error = (puredist.int4_blocks(8).decode((q, scales), 37) - values).abs()
    assert bool((error <= half_scale * (1 + 1e-6)).all()), (error - half_scale).max()


def _classic_arguments(rank, world_size):
    param = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="must have a 'params' key"):  # torch's error (a bare KeyError before)
        ZeroRedundancyOptimizer([{"lr": 0.1}], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="should be an iterable of Tensors or dicts"):
        ZeroRedundancyOptimizer([param, {"params": [param]}], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match=r"Arg ``optimizer_class`` must build a torch.optim.Optimizer.*'SGD'"):
        ZeroRedundancyOptimizer([param], "SGD", lr=0.1)
    # what torch takes: anything that builds an optimizer, e.g. functools.partial of a class
    zero = ZeroRedundancyOptimizer([param], functools.partial(torch.optim.SGD, momentum=0.9), lr=0.1)
    reference = torch.nn.Parameter(torch.ones(3))
    plain = torch.optim.SGD([reference], lr=0.1, momentum=0.9)
    for _ in range(3):
        for p in (param, reference):
            p.grad = torch.full((3,), 0.5)
        zero.step()
        plain.step()
    assert torch.equal(param, reference)
    zero.consolidate_state_dict(to=np.int64(0))  # numpy's ints are ranks, as for torch
    assert zero.state_dict()["state"][0]["momentum_buffer"].shape == (3,)
    # torch's message (and check) first: the last group size must be the group's size
    with pytest.raises(ValueError, match=r"The last value in arg ``period_group_size_dict`` 2 must be equal"):
        HierarchicalModelAverager({2: 2}, warmup_steps=0)
    return True


def test_the_classic_classes_take_and_refuse_what_torchs_do():
    assert run_workers(_classic_arguments, 1) == [True]


def test_a_float_group_size_is_refused_by_name_by_the_simulated_backend():
    collective = SimulatedCollective(4)
    with pytest.raises(ValueError, match=r"group_size.*2.0 must divide"):
        collective.mean_([torch.ones(4, 2)], group_size=2.0)


def test_a_distributed_collective_without_a_process_group_is_refused_naming_the_fix():
    assert not dist.is_initialized()  # (this process: the workers' groups live in theirs)
    with pytest.raises(ValueError, match="call init_process_group"):  # torch's own error, before anything else
        puredist.DistributedCollective()


def _with_subgroups_of_strings(rank, world_size):
    with pytest.raises(ValueError, match=r"Arg ``group_sizes`` must hold positive ints, got \['1'\]"):
        puredist.DistributedCollective.with_subgroups(["1"])
    return dist.get_world_size()


def test_subgroup_sizes_that_are_not_ints_are_refused_by_name():
    assert run_workers(_with_subgroups_of_strings, 2) == [2, 2]


def test_a_plans_owners_are_judged_by_their_values_and_types_whatever_was_checked_before():
    # the check was cached on the owners' values alone: 1.0 == 1 == np.int64(1), so the first plan checked
    # decided for the others
    from puredist import zero_plan

    valid, floats = puredist.ZeroPlan(2, (0, 1)), puredist.ZeroPlan(2, (0, 1.0))
    numpy_owners = puredist.ZeroPlan(2, tuple(np.array([0, 1])))

    def outcome(plan):
        try:
            return plan.loads([3, 2])
        except ValueError as error:
            return str(error)

    for first in (numpy_owners, floats, valid):
        zero_plan._outside_of.cache_clear()  # this plan is the first one checked
        outcome(first)
        assert outcome(valid) == [3, 2] and outcome(numpy_owners) == [3, 2]
        assert "owners must be ranks in [0, 2), got 1.0 at parameter 1" in outcome(floats)


def test_plan_zero_takes_numpy_sizes_and_bucket_indices():
    sizes = list(np.array([10, 20, 30, 40]))
    plain = puredist.plan_zero([10, 20, 30, 40], 2, strategy="whole_buckets", buckets=[[0, 1], [2, 3]])
    assert puredist.plan_zero(sizes, 2, strategy="whole_buckets", buckets=np.array_split(np.arange(4), 2)) == plain
    assert puredist.plan_zero(sizes, 2) == puredist.plan_zero([10, 20, 30, 40], 2)


def _with_subgroups_of_an_iterator(rank, world_size):
    collective = puredist.DistributedCollective.with_subgroups(iter([1]))
    tensors = [torch.full((2,), float(rank))]
    collective.mean_(tensors, group_size=1)  # each rank alone: unchanged
    return collective.group_sizes, tensors[0].tolist()


def test_subgroup_sizes_given_as_an_iterator_are_read_once():
    for sizes, values in run_workers(_with_subgroups_of_an_iterator, 2):
        assert sizes == (1, 2) and values in ([0.0, 0.0], [1.0, 1.0])


def test_a_numpy_int_group_size_is_taken_where_an_int_is_and_a_float_refused():
    """A group size is an integral number (numpy's too, as the configuration reads
    it); 2.0 and True are refused by name, however equal to a size they compare."""
    from puredist.collectives.base import check_group_sizes

    collective = SimulatedCollective(4)
    check_group_sizes(collective, [np.int64(2), 4], arg="lower_levels")
    for bad in (2.0, True):
        with pytest.raises(ValueError, match=rf"``lower_levels`` {bad} must be a size of group"):
            check_group_sizes(collective, [bad], arg="lower_levels")
    runs = []
    for size in (np.int64(2), 2):  # the same steps as with the int
        transform = puredist.outer_optimizer(puredist.sgd(lr=0.7), sync_every=4, lower_levels={1: size})
        params = [torch.zeros(4, 2)]
        state = transform.init(params)
        for _ in range(2):
            params[0].add_(torch.arange(4.0).view(4, 1))  # each replica drifts its own way
            state = transform.update_(params, state, collective=collective)
        runs.append(params[0])
    assert torch.equal(*runs) and runs[0][:, 0].unique().numel() == 2  # two groups of two averaged
