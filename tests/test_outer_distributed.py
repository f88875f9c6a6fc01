"""Outer optimization on real Gloo ranks: equal to the simulated backend fed with
the same per-rank data, and restarts (torch.save of state_dict, and
torch.distributed.checkpoint) that continue the uninterrupted trajectory."""

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp

import puredist
from workers import run_workers

STEPS = 12


def make_transform(comm_dtype=None, delay=2, global_dtype=None):
    return puredist.outer_optimizer(
        puredist.sgd(lr=0.7, momentum=0.9, nesterov=True),
        sync_every=4, warmup_steps=1, delay=delay, fragments=2, comm_dtype=comm_dtype, global_dtype=global_dtype,
    )


def initial_params():
    gen = torch.Generator().manual_seed(0)  # the same on every rank
    return [torch.randn(3, 4, generator=gen), torch.randn(7, generator=gen), torch.randn(2, generator=gen)]


def drift(rank, step, params):
    gen = torch.Generator().manual_seed(100 * rank + step)
    return [torch.randn(p.shape, generator=gen) for p in params]


def _real_equals_simulated(rank, world_size, comm_dtype, exact, delay, global_dtype=None, dtype=torch.float32):
    transform = make_transform(comm_dtype, delay, global_dtype)
    real = [p.to(dtype) for p in initial_params()]
    simulated = [p.unsqueeze(0).repeat(world_size, *[1] * p.dim()) for p in real]
    real_state, simulated_state = transform.init(real), transform.init(simulated)
    collective, simulation = puredist.DistributedCollective(), puredist.SimulatedCollective(world_size)
    for step in range(STEPS):
        for p, d in zip(real, drift(rank, step, real)):
            p.add_(d)
        per_rank = [drift(r, step, real) for r in range(world_size)]
        for i, p in enumerate(simulated):
            p.add_(torch.stack([d[i] for d in per_rank]))
        real_state = transform.update_(real, real_state, collective=collective)
        simulated_state = transform.update_(simulated, simulated_state, collective=simulation)
        for a, b in zip(real, simulated):
            torch.testing.assert_close(a, b[rank], rtol=0 if exact else 1e-6, atol=0 if exact else 1e-6)
    return real


# comm_dtype None: the global copy in the parameters' own dtype, so real ranks step each fragment as one flat
# tensor (puredist.outer.storage.flat), the simulation per leaf; two ranks sum in one order: bit for bit
# (delay 0: a synchronization started and applied in one step, its flat fragment derived once).
# A comm_dtype or a global_dtype at least as wide as the parameters: real ranks convert through one flat
# buffer (puredist.outer.storage.converted); a narrower global copy (fp64 parameters, fp32 copy) goes per leaf
@pytest.mark.parametrize("world_size, comm_dtype, exact, delay, global_dtype, dtype",
                         [(2, torch.bfloat16, True, 2, None, torch.float32),
                          (2, torch.bfloat16, True, 0, None, torch.float32),
                          (2, None, True, 2, torch.float64, torch.float32),
                          (2, torch.bfloat16, True, 2, torch.float64, torch.float32),
                          (2, None, True, 2, torch.float32, torch.float64),
                          (2, None, True, 2, None, torch.float32), (2, None, True, 0, None, torch.float32),
                          (4, None, False, 2, None, torch.float32)])
def test_real_ranks_equal_the_simulation(world_size, comm_dtype, exact, delay, global_dtype, dtype):
    finals = run_workers(_real_equals_simulated, world_size, comm_dtype, exact, delay, global_dtype, dtype)
    assert not torch.equal(finals[0][0], finals[1][0])  # local steps after the last sync differ


def train(transform, params, state, rank, steps):
    collective = puredist.DistributedCollective()
    for step in steps:
        for p, d in zip(params, drift(rank, step, params)):
            p.add_(d)
        state = transform.update_(params, state, collective=collective)
    return state


def _resume(rank, world_size, how, folder, comm_dtype):
    transform = make_transform(comm_dtype)
    uninterrupted = initial_params()
    train(transform, uninterrupted, transform.init(uninterrupted), rank, range(STEPS))

    params = initial_params()
    state = train(transform, params, transform.init(params), rank, range(7))
    assert state.in_flight  # a synchronization is under way at the checkpoint
    saved = transform.state_dict(state, rank=rank)
    saved.update({f"local.rank{rank}.{i}": p for i, p in enumerate(params)})
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer)
    else:
        dcp.save(saved, checkpoint_id=folder)
        fresh = initial_params()
        loaded = transform.state_dict(transform.init(fresh), rank=rank)  # the template: same keys
        loaded.update({f"local.rank{rank}.{i}": torch.zeros_like(p) for i, p in enumerate(fresh)})
        dcp.load(loaded, checkpoint_id=folder)

    resumed = [loaded[f"local.rank{rank}.{i}"].clone() for i in range(len(params))]
    state = transform.load_state_dict(transform.init(resumed), loaded, rank=rank)
    if comm_dtype is None:  # laid out as the template: each fragment's global copy and momentum one buffer again
        from puredist.outer.storage.flat_layout import flat_base
        fragment = state.global_params[:1]
        assert flat_base(fragment) is not None
        assert flat_base([s.momentum_buffer for s in state.outer_state[:1]]) is not None
    train(transform, resumed, state, rank, range(7, STEPS))
    for a, b in zip(resumed, uninterrupted):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    return True


@pytest.mark.parametrize("how, comm_dtype", [("torch.save", torch.bfloat16), ("dcp", torch.bfloat16), ("torch.save", None), ("dcp", None)])
def test_a_restart_mid_synchronization_continues_the_same_trajectory(how, comm_dtype, tmp_path):
    """``comm_dtype=None``: a flat fragment's in-flight views are saved per leaf and
    loaded per leaf (the per-leaf path applies them), then flat again."""
    assert run_workers(_resume, 2, how, str(tmp_path), comm_dtype) == [True, True]


def _diloco_with_a_scalar_parameter(rank, world_size):
    # outer SGD with rate 1 and no momentum: the new global copy is the mean of the ranks' parameters
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.tensor(2.0))]
    diloco = puredist.outer_optimizer(puredist.sgd(1.0), sync_every=1)
    state = diloco.init(params)
    with torch.no_grad():
        for p in params:
            p.add_(float(rank))
    state = diloco.update_(params, state, collective=puredist.DistributedCollective())
    puredist.DistributedCollective().check_replicated(params, what="the synchronized parameters")
    return [p.detach().clone() for p in params]


def test_a_model_with_a_scalar_parameter_synchronizes():
    # the initial copy's check digested each tensor's bytes through a view that a 0-dim tensor has not
    mean = sum(range(3)) / 3
    for ones, scalar in run_workers(_diloco_with_a_scalar_parameter, 3):
        assert torch.equal(ones, torch.full((3,), 1.0 + mean)) and torch.equal(scalar, torch.tensor(2.0 + mean))
