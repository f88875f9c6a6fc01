"""Properties of averaging on the simulated backend, over random pytrees and replica
counts, against a float64 brute-force mean."""

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import puredist
from puredist import SimulatedCollective, average, average_, hierarchical_averager, periodic_averager
from puredist.testing import divisors, replica_worlds
from puredist.tree import tree_leaves, tree_map

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def block_mean_oracle(tensor, group_size):
    """Brute force: every replica replaced by the float64 mean of its block."""
    out = tensor.double().clone()
    for start in range(0, tensor.shape[0], group_size):
        out[start : start + group_size] = tensor[start : start + group_size].double().mean(0)
    return out


@given(replica_worlds(replica_counts=range(1, 9)))
def test_pure_average_is_the_block_mean_and_preserves_everything_else(setup):
    replicas, group_size, tree = setup
    before = tree_map(torch.clone, tree)
    out = average(tree, collective=SimulatedCollective(replicas), group_size=group_size)
    for old, new, kept in zip(tree_leaves(tree), tree_leaves(out), tree_leaves(before)):
        assert torch.equal(old, kept)  # input untouched
        assert new.dtype == old.dtype and new.shape == old.shape
        tol = TOLERANCE[old.dtype]
        torch.testing.assert_close(new.double(), block_mean_oracle(old, group_size), rtol=tol, atol=tol)
        blocks = new.unflatten(0, (replicas // group_size, group_size))
        assert torch.equal(blocks, blocks[:, :1].expand_as(blocks))  # consensus within each group
        # the mean over all replicas is preserved (up to rounding)
        torch.testing.assert_close(new.double().mean(0), old.double().mean(0), rtol=tol, atol=tol)


@given(replica_worlds(replica_counts=range(1, 9)))
def test_in_place_equals_pure_and_is_idempotent(setup):
    replicas, group_size, tree = setup
    collective = SimulatedCollective(replicas)
    pure = average(tree, collective=collective, group_size=group_size)
    pointers = [t.data_ptr() for t in tree_leaves(tree)]
    assert average_(tree, collective=collective, group_size=group_size) is None
    assert [t.data_ptr() for t in tree_leaves(tree)] == pointers
    for a, b in zip(tree_leaves(tree), tree_leaves(pure)):
        assert torch.equal(a, b)
    twice = average(tree, collective=collective, group_size=group_size)
    for a, b in zip(tree_leaves(tree), tree_leaves(twice)):
        tol = TOLERANCE[a.dtype]
        torch.testing.assert_close(b, a, rtol=tol, atol=tol)


@st.composite
def hierarchies(draw):
    replicas = draw(st.sampled_from([1, 2, 4, 6, 8]))
    levels = draw(st.integers(1, 3))
    periods = sorted(draw(st.lists(st.integers(1, 6), min_size=levels, max_size=levels, unique=True)))
    sizes = sorted(draw(st.lists(st.sampled_from(divisors(replicas)), min_size=len(periods), max_size=len(periods))))
    sizes[-1] = replicas
    return replicas, dict(zip(periods, sizes)), draw(st.integers(0, 6))


def brute_force_level(periods, warmup, step):
    matching = [p for p in periods if step >= warmup and step % p == 0]
    return max(matching) if matching else None


@pytest.mark.filterwarnings("ignore:When the maximum period")
@given(hierarchies(), st.integers(0, 2**31 - 1))
def test_hierarchical_training_loop_matches_a_brute_force_loop(hierarchy, seed):
    replicas, period_sizes, warmup = hierarchy
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(replicas, 3, generator=gen, dtype=torch.float64), "b": torch.zeros(replicas, 2, dtype=torch.float64)}
    oracle = {k: v.clone() for k, v in params.items()}
    averager = hierarchical_averager(period_sizes, warmup)
    state = averager.init(params)
    collective = SimulatedCollective(replicas)
    for step in range(14):
        noise = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in params.items()}
        for k in params:  # a "local step": every replica drifts differently
            params[k].add_(noise[k])
            oracle[k].add_(noise[k])
        state = averager.update_(params, state, collective=collective)
        period = brute_force_level(list(period_sizes), warmup, step)
        if period is not None:
            oracle = {k: block_mean_oracle(v, period_sizes[period]) for k, v in oracle.items()}
        assert state.step == step + 1
        for k in params:
            torch.testing.assert_close(params[k], oracle[k], rtol=1e-12, atol=1e-12)


@given(period=st.integers(2, 5), warmup=st.integers(0, 5), replicas=st.sampled_from([2, 3, 4]))
def test_unscheduled_steps_are_no_ops_and_pure_update_never_mutates(period, warmup, replicas):
    averager = periodic_averager(period, warmup)
    params = [torch.randn(replicas, 4), None, (torch.randn(replicas, 2, dtype=torch.float64),)]
    snapshot = tree_map(torch.clone, params)
    state = averager.init(params)
    for step in range(warmup + 2 * period):
        new_params, new_state = averager.update(params, state, collective=SimulatedCollective(replicas))
        assert state.step == step and new_state.step == step + 1  # old state not mutated
        for old, kept in zip(tree_leaves(params), tree_leaves(snapshot)):
            assert torch.equal(old, kept)  # input params never mutated
        if step >= warmup and (step - warmup) % period == 0:
            assert all(n is not o for n, o in zip(tree_leaves(new_params), tree_leaves(params)))
        else:
            assert new_params is params
        state = new_state


def test_replicas_differing_are_named_and_the_replica_groups_alone_are_no_collective():
    same, differs = torch.ones(3, 2), torch.ones(3, 2)
    differs[2, 1] = 2.0
    SimulatedCollective(3).check_replicated([same, same.clone()], what="the copies")
    with pytest.raises(puredist.RankMismatchError, match=r"Tensors \[1\] \(of 3\) differ between replicas.*the copies"):
        SimulatedCollective(3).check_replicated([same, differs, same], what="the copies")
    # what the one-process backends share has no mean: refused as a collective, not a silent no-op
    with pytest.raises(TypeError, match="must be a puredist collective.*ReplicaGroups"):
        average_([same], collective=puredist.collectives.simulated.ReplicaGroups(3))


def _middle_rank_differs(rank, world_size):
    tensors = [torch.ones(2), torch.full((3,), 1.0 + (rank == 1))]  # rank 1 of 3 holds other values in tensor 1
    try:
        puredist.DistributedCollective().check_replicated(tensors, what="the copies")
    except puredist.RankMismatchError as error:
        return str(error)
    return None


def test_a_middle_rank_or_replica_differing_alone_is_refused_on_every_backend():
    # every rank's (replica's) values compared with the first's, not only the last's: 3 of them, the middle apart
    from torch.func import vmap

    from workers import run_workers

    same, differs = torch.ones(3, 2), torch.ones(3, 3)
    differs[1, 0] = 2.0
    pattern = r"Tensors \[1\] \(of 2\) differ between (replicas|ranks).*the copies"
    with pytest.raises(puredist.RankMismatchError, match=pattern):
        SimulatedCollective(3).check_replicated([same, differs], what="the copies")
    with pytest.raises(puredist.RankMismatchError, match=pattern):
        vmap(lambda a, b: puredist.VmapCollective(3).check_replicated([a, b], what="the copies") or a)(same, differs)
    for message in run_workers(_middle_rank_differs, 3):
        assert message is not None and re.search(pattern, message), message


def test_the_simulated_backend_rejects_bad_shapes_before_writing_anything():
    collective = SimulatedCollective(4)
    good, bad = torch.randn(4, 2), torch.randn(3, 2)
    copy = good.clone()
    with pytest.raises(ValueError, match=r"tensor 1 has shape \(3, 2\); simulated, every tensor is stacked \[4, "):
        collective.mean_([good, bad])
    assert torch.equal(good, copy)
    with pytest.raises(ValueError, match="group_size.*3 must divide.*4"):
        collective.mean_([good], group_size=3)
    with pytest.raises(ValueError, match=r"group_size.*2.0 must divide"):  # a float: refused by name, not inside
        puredist.average_([good], collective=collective, group_size=2.0)
    with pytest.raises(ValueError, match=r"Arg ``params``: tensor 0 has shape \(3, 2\)"):
        averager = puredist.compressed_averager(puredist.int8_blocks())
        averager.update([bad], averager.init([bad]), collective=collective)
    with pytest.raises(ValueError, match="num_replicas.*0"):
        SimulatedCollective(0)


@pytest.mark.parametrize(
    "params, match",
    [
        ([torch.zeros(2, 3, dtype=torch.int64)], "leaf 0.*int64.*floating-point"),
        ({"a": torch.zeros(2), "b": 3.0}, "pytree of tensors.*leaf 1.*float"),
    ],
)
def test_unsupported_leaves_are_rejected_before_any_tensor_is_touched(params, match):
    averager = periodic_averager(2)
    with pytest.raises(TypeError, match=match):
        averager.update_(params, averager.init(params), collective=SimulatedCollective(2))


def test_hierarchy_must_end_with_the_whole_group():
    averager = hierarchical_averager({2: 2, 4: 2})
    params = [torch.randn(4, 3)]
    with pytest.raises(ValueError, match="last value.*2.*must be equal.*4"):
        averager.update_(params, averager.init(params), collective=SimulatedCollective(4))
    averager = hierarchical_averager({2: 3, 4: 4})
    with pytest.raises(ValueError, match="positive divisor.*4, got 3"):
        averager.update_(params, averager.init(params), collective=SimulatedCollective(4))


def test_period_one_warns_like_torch():
    with pytest.warns(UserWarning, match="When period is 1, no need to use model averaging"):
        puredist.periodic_averager(1)
    with pytest.warns(UserWarning, match="maximum period in arg ``period_group_size_dict`` is 1"):
        puredist.hierarchical_averager({1: 2})


@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_pure_results_are_fresh_tensors_with_a_row_each(group_size):
    """A pure mean over the whole group must not hand back rows sharing one memory
    location (an expanded view): writing one row would write them all."""
    x = torch.randn(4, 3)
    out = average([x], collective=SimulatedCollective(4), group_size=group_size)[0]
    out[0].fill_(7.0)
    assert not torch.equal(out[1], out[0])
    average_([out], collective=SimulatedCollective(4))  # averaging it in place is allowed


def test_the_strategies_refuse_bad_arguments_by_name_when_built():
    from puredist.testing import parameter_trees

    for kwargs, match in [({"replicas": 0}, "``replicas`` must be an int >= 1, got 0"),
                          ({"replicas": -1}, "``replicas``"), ({"max_leaves": 0}, "``max_leaves``"),
                          ({"dtypes": (torch.int64,)}, "floating-point torch dtypes"), ({"dtypes": ()}, "non-empty")]:
        with pytest.raises(ValueError, match=match):
            parameter_trees(**kwargs)
    with pytest.raises(ValueError, match="``replica_counts`` must not be empty"):
        replica_worlds(())
    with pytest.raises(ValueError, match="``replica_counts`` must be an int >= 1, got 0"):
        replica_worlds((0, 2))
