"""The functional ZeRO step on the simulated backend: every rank at once in one
process, against the unsharded optimizer on each parameter's owner (hypothesis over
trees, replica counts and plans) and against the same step on real Gloo ranks."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import puredist
from workers import run_workers

OPTIMIZERS = {
    "adam": lambda: puredist.adam(lr=0.01, weight_decay=0.1),
    "sgd": lambda: puredist.sgd(lr=0.1, momentum=0.9, nesterov=True),
}


def stacked_tree(shapes, replicas, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(replicas, *shape, generator=gen) for shape in shapes]


shapes = st.lists(st.lists(st.integers(1, 4), min_size=0, max_size=2).map(tuple), min_size=1, max_size=5)


@given(shapes=shapes, replicas=st.integers(1, 4), seed=st.integers(0, 2**16), data=st.data(),
       name=st.sampled_from(sorted(OPTIMIZERS)))
def test_a_simulated_zero_step_is_the_owners_unsharded_step_copied_to_every_rank(shapes, replicas, seed, data, name):
    owners = tuple(data.draw(st.lists(st.integers(0, replicas - 1), min_size=len(shapes), max_size=len(shapes))))
    plan, optimizer = puredist.ZeroPlan(replicas, owners), OPTIMIZERS[name]()
    sharded = puredist.zero(optimizer)
    params = stacked_tree(shapes, replicas, seed)
    state = sharded.init(params, plan=plan, rank=None)
    # the oracle: each parameter alone, as its owner holds it, stepped by the plain optimizer
    alone = [p[owner].clone() for p, owner in zip(params, owners)]
    alone_states = [optimizer.init([a]) for a in alone]
    collective = puredist.SimulatedCollective(replicas)
    for step in range(3):
        grads = stacked_tree(shapes, replicas, seed + 1 + step)  # each rank's own (ZeRO uses the owner's)
        state = sharded.update_(params, grads, state, collective=collective)
        for i, (p, owner) in enumerate(zip(params, owners)):
            alone_states[i] = optimizer.update_([alone[i]], [grads[i][owner]], alone_states[i])
            assert torch.equal(p, alone[i].expand_as(p)), f"step {step} leaf {i}"
    assert state.step == 3


def test_strided_rows_are_stepped_as_the_owner_steps_its_dense_tensor_fused_kernels_too():
    # torch's fused kernels step a non-dense tensor wrongly: a row of a transposed leaf is one
    optimizer = puredist.adam(lr=0.01, fused=True)
    sharded, plan = puredist.zero(optimizer), puredist.ZeroPlan(3, (1, 2))
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(5, 3, generator=gen).t(), torch.randn(3, 4, generator=gen)]  # leaf 0: rows strided
    alone = [p[owner].clone() for p, owner in zip(params, plan.owners)]
    state, alone_state = sharded.init(params, plan=plan, rank=None), optimizer.init(alone)
    for _ in range(3):
        grads = [torch.randn(5, 3, generator=gen).t(), torch.randn(3, 4, generator=gen)]
        state = sharded.update_(params, grads, state, collective=puredist.SimulatedCollective(3))
        alone_state = optimizer.update_(alone, [g[owner].contiguous() for g, owner in zip(grads, plan.owners)], alone_state)
        assert all(torch.equal(p, a.expand_as(p)) for p, a in zip(params, alone))


def _on_real_ranks(rank, world_size, shapes, owners):
    sharded = puredist.zero(OPTIMIZERS["adam"]())
    plan = puredist.ZeroPlan(world_size, owners)
    params = [p[rank].clone() for p in stacked_tree(shapes, world_size, 0)]
    state = sharded.init(params, plan=plan, rank=rank)
    for step in range(3):
        grads = [g[rank] for g in stacked_tree(shapes, world_size, 1 + step)]
        state = sharded.update_(params, grads, state, collective=puredist.DistributedCollective())
    return params


def test_the_simulated_step_equals_real_ranks_bit_for_bit():
    shapes, owners, replicas = [(3, 2), (5,), (), (4, 1)], (2, 0, 1, 2), 3
    real = run_workers(_on_real_ranks, replicas, shapes, owners)
    sharded = puredist.zero(OPTIMIZERS["adam"]())
    params = stacked_tree(shapes, replicas, 0)
    state = sharded.init(params, plan=puredist.ZeroPlan(replicas, owners), rank=None)
    for step in range(3):
        state = sharded.update_(params, stacked_tree(shapes, replicas, 1 + step), state,
                                collective=puredist.SimulatedCollective(replicas))
    for rank in range(replicas):
        assert all(torch.equal(p[rank], r) for p, r in zip(params, real[rank]))


def test_a_simulated_step_refuses_what_it_cannot_run_before_stepping_anything():
    sharded, plan = puredist.zero(puredist.sgd(lr=0.1)), puredist.ZeroPlan(2, (0, 1))
    params = stacked_tree([(3,), (2,)], 2, 0)
    before = [p.clone() for p in params]
    with pytest.raises(TypeError, match="``collective``.*VmapCollective"):
        sharded.update_(params, params, sharded.init(params, plan=plan, rank=None), collective=puredist.VmapCollective(2))
    with pytest.raises(ValueError, match="needs the state of every parameter.*rank=None"):
        sharded.update_(params, params, sharded.init(params, plan=plan, rank=0), collective=puredist.SimulatedCollective(2))
    with pytest.raises(ValueError, match=r"``grads``: tensor 1 has shape \(3,\)"):
        sharded.update_(params, [params[0], torch.ones(3)], sharded.init(params, plan=plan, rank=None),
                        collective=puredist.SimulatedCollective(2))
    with pytest.raises(ValueError, match=r"``params``: tensor 0 has shape \(3,\)"):
        sharded.init([torch.ones(3), torch.ones(2, 2)], plan=plan, rank=None)
    assert all(torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.parametrize("name, tolerance", [("sgd", 0.0), ("adam", 1e-6)])
def test_the_pure_zero_step_under_vmap_equals_the_simulated_step(name, tolerance):
    from torch.func import vmap

    from puredist.tree import vmap_axes

    replicas, shapes = 3, [(4,), (2, 3), (5,)]
    plan, sharded = puredist.ZeroPlan(replicas, (2, 0, 1)), puredist.zero(OPTIMIZERS[name]())
    params, eager = stacked_tree(shapes, replicas, 0), stacked_tree(shapes, replicas, 0)
    eager_state = sharded.init(eager, plan=plan, rank=None)
    one = sharded.init(params, plan=plan, rank=None)  # every parameter's state, stacked for every replica
    state = one._replace(owned=tuple(type(s)(*(None if t is None else torch.stack([t] * replicas) for t in s))
                                     for s in one.owned))
    axes = vmap_axes(state)
    mapped = vmap(lambda p, g, s: sharded.update(p, g, s, collective=puredist.VmapCollective(replicas)),
                  in_dims=(0, 0, axes), out_dims=(0, axes))
    for step in range(3):
        grads = stacked_tree(shapes, replicas, 10 + step)  # each replica's own: the owner's counts
        params, state = mapped(params, grads, state)
        eager_state = sharded.update_(eager, grads, eager_state, collective=puredist.SimulatedCollective(replicas))
        for p, e in zip(params, eager):  # (Adam's differentiable kernel takes the step's powers in float32)
            torch.testing.assert_close(p, e, rtol=tolerance, atol=tolerance)
    for mine, theirs in zip(state.owned, eager_state.owned):  # every replica holds the owner's state
        for ours, reference in zip(mine, theirs):
            if reference is not None:
                torch.testing.assert_close(ours, reference.expand_as(ours), rtol=tolerance, atol=tolerance)
    assert state.step == 3


def test_the_pure_zero_step_under_vmap_refuses_one_rank_s_state():
    from torch.func import vmap

    plan, sharded = puredist.ZeroPlan(2, (0, 1)), puredist.zero(puredist.sgd(lr=0.1))
    params = stacked_tree([(3,), (2,)], 2, 0)
    state = sharded.init([p[0] for p in params], plan=plan, rank=0)  # rank 0's share: one parameter's state
    step = vmap(lambda p, g: sharded.update(p, g, state, collective=puredist.VmapCollective(2)))
    with pytest.raises(ValueError, match=r"under vmap every replica needs the state of every parameter \(2, from "
                                         r"init\(\.\.\., rank=None\)\), got 1"):
        step(params, params)


def _pure_nesterov_zero(rank, world_size):
    simulated = rank is None
    shapes = [(3,), (4,)]
    params = [torch.zeros((2, *s) if simulated else s) for s in shapes]
    collective = puredist.SimulatedCollective(2) if simulated else puredist.DistributedCollective()
    zero = puredist.zero(puredist.sgd(lr=0.1, momentum=0.9, nesterov=True, foreach=True))
    state = zero.init(params, plan=puredist.plan_zero([3, 4], 2), rank=rank)
    grads = [torch.ones_like(p) for p in params]
    for _ in range(2):  # the second step has a momentum buffer, which torch's kernel adds into the gradients
        params, state = zero.update(params, grads, state, collective=collective)
    return all(torch.equal(g, torch.ones_like(g)) for g in grads)


def test_the_pure_zero_step_leaves_the_gradients_alone():
    # torch's multi-tensor Nesterov SGD adds the momentum into the gradients in place: the pure ZeRO step handed
    # it the caller's (the owner's changed from 1 to 2.71)
    assert _pure_nesterov_zero(None, 2)
    assert run_workers(_pure_nesterov_zero, 2) == [True, True]
