"""Sharded models (FSDP2, tensor parallelism): averaging and DiLoCo across replica
groups on real ``fully_shard`` models over Gloo, at 4 ranks as 2 replica groups x 2
shards and 4 x 1, against the same algorithm run on unsharded replicas (the simulated
backend, in-process); mixed DTensor/plain trees; sharding mismatches and pending
reductions refused on every rank."""

from typing import NamedTuple

import pytest
import torch
from torch import nn

import puredist
from workers import run_workers

STEPS = 10


def make_model():
    torch.manual_seed(0)  # the same initial model on every rank
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def drift(replica, step, name, shape):
    """A replica's training progress at a step: the same on the ranks of one replica group."""
    gen = torch.Generator().manual_seed(1000 * replica + 10 * step + hash(name) % 10)
    return torch.randn(shape, generator=gen)


def _mesh(replicas, shards):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))


def _sharded_against_oracle(rank, world_size, shards, transform_name, oracle_of):
    """Run the transform on a fully_shard-ed model; alongside, run it on the oracle:
    the replicas' whole tensors (``oracle_of == "model"``) or their shards at this
    rank's coordinate (``"shard"``: the rule "each shard averaged with the same shard
    of the other replica groups" itself), stacked and simulated in-process; or
    (``"ranks"``) each replica's whole tensors on these ranks, over the same group."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    replicas = world_size // shards
    mesh = _mesh(replicas, shards)
    replica = mesh.get_coordinate()[0]
    transform = TRANSFORMS[transform_name]()
    model = make_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    fully_shard(model, mesh=mesh["shard"])
    params = dict(model.named_parameters())

    def shard(name, full):  # this rank's shard of a whole tensor shaped like the parameter (no communication)
        p = params[name]
        return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()

    def seen(name, full):
        return full if oracle_of in ("model", "ranks") else shard(name, full)

    collective = puredist.DistributedCollective.from_mesh(mesh, "replicate")
    if oracle_of == "ranks":  # the whole tensors on these very ranks (a transform that is not elementwise)
        oracle, simulation = {n: t.clone() for n, t in initial.items()}, collective
    else:
        oracle = {n: torch.stack([seen(n, t)] * replicas) for n, t in initial.items()}
        simulation = puredist.SimulatedCollective(replicas)
    state, oracle_state = transform.init(params), transform.init(oracle)
    # exact for 2 replicas; Gloo's ring sums 4 in another order than the simulation, a sharded norm its shards
    tolerance = 0 if replicas == 2 and transform_name != "diloco_normalized" else 1e-6
    for step in range(STEPS):
        with torch.no_grad():
            for name, p in params.items():
                p.to_local().add_(shard(name, drift(replica, step, name, p.shape)))
                if oracle_of == "ranks":
                    oracle[name].add_(drift(replica, step, name, p.shape))
                else:
                    oracle[name].add_(torch.stack([seen(name, drift(r, step, name, p.shape)) for r in range(replicas)]))
        state = transform.update_(params, state, collective=collective)
        oracle_state = transform.update_(oracle, oracle_state, collective=simulation)
        for name, p in params.items():
            assert type(p).__name__ == "DTensor"
            ours = p.full_tensor() if oracle_of in ("model", "ranks") else p.to_local()
            theirs = oracle[name] if oracle_of == "ranks" else oracle[name][replica]
            torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance,
                                       msg=lambda m: f"{name} step {step}: {m}")
    return tuple(p.to_local().numel() for p in params.values())


TRANSFORMS = {
    "periodic": lambda: puredist.periodic_averager(3, warmup_steps=2),
    "diloco": lambda: puredist.outer_optimizer(
        puredist.sgd(lr=0.7, momentum=0.9, nesterov=True), sync_every=4, warmup_steps=1, delay=1, fragments=2,
    ),
    "diloco_int8": lambda: puredist.outer_optimizer(
        puredist.sgd(lr=0.7, momentum=0.9, nesterov=True), sync_every=4, warmup_steps=1,
        compressor=puredist.int8_blocks(8),
    ),
    # synchronous: stepped on the local shards (puredist.outer.storage.shards); Adam's state counts its steps
    "diloco_sync": lambda: puredist.outer_optimizer(
        puredist.sgd(lr=0.7, momentum=0.9, nesterov=True), sync_every=4, warmup_steps=1, fragments=2,
    ),
    "diloco_adam": lambda: puredist.outer_optimizer(puredist.adam(0.05), sync_every=3, warmup_steps=1),
    # built by hand, so not elementwise: a step normalized by the gradient's norm, the whole tensor's
    "diloco_normalized": lambda: puredist.outer_optimizer(_normalized_sgd(0.3), sync_every=2),
}


class _Count(NamedTuple):
    count: torch.Tensor


def _normalized_sgd(lr: float) -> puredist.Optimizer:
    def update_(params, grads, states):
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(lr * g / g.norm())
        return [_Count(s.count + 1) for s in states]

    return puredist.Optimizer(lambda params: [_Count(torch.zeros(())) for _ in params], None, update_)


@pytest.mark.parametrize(
    "shards, transform_name, oracle_of",
    [
        (2, "periodic", "model"), (2, "diloco", "model"), (1, "periodic", "model"), (1, "diloco", "model"),
        (1, "diloco_int8", "model"),
        # compression cuts its blocks over the rank's shards, so its oracle is the shards themselves
        (2, "diloco_int8", "shard"), (2, "diloco", "shard"),
        (2, "diloco_sync", "model"), (1, "diloco_sync", "model"), (2, "diloco_adam", "model"),
        (2, "diloco_normalized", "ranks"),
    ],
    ids=lambda value: {1: "4x1", 2: "2x2"}.get(value, str(value)),
)
def test_a_sharded_model_follows_its_oracle(shards, transform_name, oracle_of):
    local_sizes = run_workers(_sharded_against_oracle, 4, shards, transform_name, oracle_of)
    if shards == 2:  # each rank held and averaged only its shard (7 rows split 4 + 3)
        assert local_sizes[0] != local_sizes[1] and sum(local_sizes[0]) + sum(local_sizes[1]) == 5 * 7 + 7 + 7 * 3 + 3


def _diloco_state_is_sharded(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(2, 2)
    model = make_model()
    fully_shard(model, mesh=mesh["shard"])
    transform = TRANSFORMS["diloco"]()
    state = transform.init(dict(model.named_parameters()))
    local = sum(g.to_local().numel() for g in state.global_params)
    return local, sum(g.numel() for g in state.global_params), {type(g).__name__ for g in state.global_params}


def test_the_global_copy_is_sharded_like_the_parameters():
    results = run_workers(_diloco_state_is_sharded, 4)
    for local, whole, kinds in results:
        assert kinds == {"DTensor"} and local < whole
    assert results[0][0] + results[1][0] == results[0][1]  # the two shards of a replica group make the model


def _tensor_parallel_and_plain_leaves(rank, world_size):
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(2, 2)
    replica = mesh.get_coordinate()[0]
    weight = torch.arange(24.0).reshape(4, 6) * (replica + 1)  # replica 1 holds twice replica 0's values
    tree = {
        "column_parallel": distribute_tensor(weight, mesh["shard"], [Shard(1)], src_data_rank=None),
        "plain": torch.full((3,), float(replica)),
    }
    puredist.average_(tree, collective=puredist.DistributedCollective.from_mesh(mesh, "replicate"))
    expected = torch.arange(24.0).reshape(4, 6) * 1.5
    return (torch.equal(tree["column_parallel"].full_tensor(), expected), tree["column_parallel"].to_local().shape,
            torch.equal(tree["plain"], torch.full((3,), 0.5)))


def test_tensor_parallel_leaves_and_plain_tensors_average_together():
    for exact, local_shape, plain in run_workers(_tensor_parallel_and_plain_leaves, 4):
        assert exact and plain and tuple(local_shape) == (4, 3)


def _mismatched_sharding(rank, world_size):
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(2, 2)
    replica = mesh.get_coordinate()[0]
    weight = torch.ones(4, 4)
    # replica group 1 shards the other dimension: same local shapes, different shards
    leaf = distribute_tensor(weight, mesh["shard"], [Shard(replica)], src_data_rank=None)
    before = leaf.to_local().clone()
    try:
        puredist.average_([leaf], collective=puredist.DistributedCollective.from_mesh(mesh, "replicate"))
    except puredist.RankMismatchError as error:
        return "ranks passed different tensors" in str(error), torch.equal(leaf.to_local(), before)
    return "averaged", None


def test_replica_groups_sharded_differently_raise_on_every_rank():
    assert run_workers(_mismatched_sharding, 4) == [(True, True)] * 4


def _respecified_shards(rank, world_size):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = _mesh(2, 2)
    collective = puredist.DistributedCollective.from_mesh(mesh, "replicate")
    leaf = distribute_tensor(torch.ones(4, 4), mesh["shard"], [Shard(0)], src_data_rank=None)  # local (2, 4)
    puredist.average_([leaf], collective=collective)  # its layout is now known
    if mesh.get_coordinate()[0] == 1:  # the same local shard, read as columns of a (2, 8) tensor: another spec
        leaf = DTensor.from_local(leaf.to_local(), mesh["shard"], [Shard(1)], run_check=False, shape=(2, 8),
                                  stride=(8, 1))
    try:
        puredist.average_([leaf], collective=collective)
    except puredist.RankMismatchError as error:
        return "ranks passed different tensors" in str(error)
    return "averaged"


def test_a_shard_given_another_spec_at_the_same_address_is_checked_again():
    assert run_workers(_respecified_shards, 4) == [True] * 4


def _dtensor_residuals(rank, world_size):
    from torch.distributed.tensor import Shard, distribute_tensor

    from puredist._dtensors import like

    mesh = _mesh(2, 2)
    full = torch.arange(32.0).reshape(8, 4) * (mesh.get_coordinate()[0] + 1)
    leaf = distribute_tensor(full, mesh["shard"], [Shard(0)], src_data_rank=None)
    averager = puredist.compressed_averager(puredist.int8_blocks(8))
    state = averager.init([leaf])
    as_dtensors = state._replace(residuals=tuple(like(leaf, r) for r in state.residuals))  # e.g. for DCP
    collective = puredist.DistributedCollective.from_mesh(mesh, "replicate")
    means, _ = averager.update([leaf], as_dtensors, collective=collective)
    expected, _ = averager.update([leaf], state, collective=collective)
    return torch.equal(means[0].to_local(), expected[0].to_local())


def test_compressed_averaging_takes_residuals_kept_as_dtensors():
    assert run_workers(_dtensor_residuals, 4) == [True] * 4


def _different_shards_of_one_spec(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    # evenly sharded: both ranks hold a (2, 4) shard of the same spec, but different rows
    leaf = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)], src_data_rank=None)
    before = leaf.to_local().clone()
    with pytest.raises(puredist.RankMismatchError, match="ranks passed different tensors"):
        # averaging across the ranks that shard it (the world): they hold different rows, not replicas
        puredist.average_([leaf], collective=puredist.DistributedCollective())
    return torch.equal(leaf.to_local(), before)


def test_ranks_holding_different_shards_of_one_spec_raise_on_every_rank():
    assert run_workers(_different_shards_of_one_spec, 2) == [True, True]


def _pending_reduction(rank, world_size):
    from torch.distributed.tensor import DTensor, Partial

    mesh = _mesh(2, 2)
    pending = DTensor.from_local(torch.ones(3), mesh["shard"], [Partial()])
    collective = puredist.DistributedCollective.from_mesh(mesh, "replicate")
    messages = []
    for call in (puredist.average_, puredist.average):
        try:
            call({"w": pending}, collective=collective)
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_partial_placements_are_refused_before_any_collective():
    for messages in run_workers(_pending_reduction, 4):
        assert len(messages) == 2 and all("Partial" in m and "leaf 0" in m for m in messages)


def _mesh_errors(rank, world_size):
    mesh = _mesh(2, 2)
    try:
        puredist.DistributedCollective.from_mesh(mesh, "replica")
    except ValueError as error:
        return str(error)


def test_an_unknown_mesh_dimension_is_named():
    for message in run_workers(_mesh_errors, 4):
        assert "'replica'" in message and "('replicate', 'shard')" in message


RESUME_AT, TOTAL = 6, 11  # the last step is a local one


def _diloco_steps(model, params, transform, state, collective, replica, steps):
    for step in steps:
        with torch.no_grad():
            for name, p in params.items():
                from torch.distributed.tensor import distribute_tensor

                full = drift(replica, step, name, p.shape)
                p.to_local().add_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
        state = transform.update_(params, state, collective=collective)
    return state


def _restartable(shards, delay):
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(2, shards)
    model = make_model()
    fully_shard(model, mesh=mesh["shard"])
    transform = puredist.outer_optimizer(
        puredist.sgd(lr=0.7, momentum=0.9, nesterov=True), sync_every=2 if delay == 0 else 4, warmup_steps=2, delay=delay,
    )
    params = dict(model.named_parameters())
    return mesh, model, params, transform, transform.init(params), puredist.DistributedCollective.from_mesh(mesh, "replicate")


def _save_at_two_shards(rank, world_size, folder, delay):
    import torch.distributed.checkpoint as dcp

    mesh, model, params, transform, state, collective = _restartable(2, delay)
    replica = mesh.get_coordinate()[0]
    state = _diloco_steps(model, params, transform, state, collective, replica, range(RESUME_AT))
    assert bool(state.in_flight) == bool(delay)  # with a delay, the sync started after inner step 6 is saved in flight
    # the replicas' parameters differ between synchronizations: each replica group saves its own (under one
    # key for all groups, DCP would keep one group's shards for all); the DiLoCo state is the same in every group
    dcp.save({f"model.replica{replica}": model.state_dict(), "outer": transform.state_dict(state, rank=rank)},
             checkpoint_id=folder)
    state = _diloco_steps(model, params, transform, state, collective, replica, range(RESUME_AT, TOTAL))
    return replica, {n: p.full_tensor() for n, p in params.items()}


def _resume(rank, world_size, folder, shards, delay):
    import torch.distributed.checkpoint as dcp

    mesh, model, params, transform, fresh, collective = _restartable(shards, delay)
    replica = mesh.get_coordinate()[0]
    saved = {f"model.replica{replica}": model.state_dict(), "outer": transform.state_dict(fresh, rank=rank)}
    dcp.load(saved, checkpoint_id=folder)  # DCP reshards each DTensor: 2 shards saved, 1 loaded
    model.load_state_dict(saved[f"model.replica{replica}"])
    state = transform.load_state_dict(fresh, saved["outer"], rank=rank)
    assert state.step == RESUME_AT and all(type(g).__name__ == "DTensor" for g in state.global_params)
    state = _diloco_steps(model, params, transform, state, collective, replica, range(RESUME_AT, TOTAL))
    return replica, {n: p.full_tensor() for n, p in params.items()}


@pytest.mark.parametrize(
    "shards, delay",
    [(1, 0), (2, 1)],
    ids=["resharded 2x2 to 2x1", "2x2 with a sync in flight (its snapshots are per rank: same layout only)"],
)
def test_a_checkpoint_resumes_on_the_same_trajectory(tmp_path, shards, delay):
    folder = str(tmp_path / "checkpoint")
    uninterrupted = dict(run_workers(_save_at_two_shards, 4, folder, delay))  # 2 replica groups x 2 shards
    resumed = dict(run_workers(_resume, 2 * shards, folder, shards, delay))  # 2 replica groups x `shards`
    for replica in (0, 1):
        for name, tensor in uninterrupted[replica].items():
            assert torch.equal(resumed[replica][name], tensor), (replica, name)
    assert not torch.equal(uninterrupted[0]["0.weight"], uninterrupted[1]["0.weight"])  # local steps since the sync


def _classic_post_local_sgd(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    from puredist.classic import PeriodicModelAverager, PostLocalSGDOptimizer

    mesh = _mesh(2, 2)
    replica = mesh.get_coordinate()[0]
    inputs = [torch.randn(4, 5, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    # the oracle: each replica's unsharded model after one SGD step on its input, averaged
    stepped = []
    for r in range(2):
        plain = make_model()
        plain(inputs[r]).sum().backward()
        torch.optim.SGD(plain.parameters(), lr=0.1).step()
        stepped.append(dict(plain.named_parameters()))
    model = make_model()
    fully_shard(model, mesh=mesh["shard"])
    averager = PeriodicModelAverager(period=2, warmup_steps=0, process_group=mesh.get_group("replicate"))
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), averager)
    model(inputs[replica]).sum().backward()
    optimizer.step()  # step 0: averaged (0 is a multiple of the period)
    for name, p in model.named_parameters():
        expected = (stepped[0][name].detach() + stepped[1][name].detach()) / 2
        torch.testing.assert_close(p.full_tensor().detach(), expected, rtol=1e-6, atol=1e-6)
    return True


def test_torch_style_post_local_sgd_on_an_fsdp2_model():
    assert run_workers(_classic_post_local_sgd, 4) == [True] * 4


def _hierarchy_from_mesh(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dc", "replicate"))
    collective = puredist.DistributedCollective.from_mesh(mesh, ("dc", "replicate"))
    averager = puredist.hierarchical_averager({1: 2, 3: 4})  # pairs every step, everybody every 3
    ours = [torch.zeros(6)]
    oracle = [torch.zeros(4, 6)]  # the 4 ranks, simulated: blocks of 2 consecutive ranks are the pairs
    state, oracle_state = averager.init(ours), averager.init(oracle)
    simulation = puredist.SimulatedCollective(4)
    for step in range(6):
        ours[0].add_(drift(rank, step, "w", (6,)))
        oracle[0].add_(torch.stack([drift(r, step, "w", (6,)) for r in range(4)]))
        state = averager.update_(ours, state, collective=collective)
        oracle_state = averager.update_(oracle, oracle_state, collective=simulation)
        torch.testing.assert_close(ours[0], oracle[0][rank], rtol=1e-6, atol=1e-6)
    return collective.group_sizes


def test_several_mesh_dimensions_make_hierarchical_levels():
    assert run_workers(_hierarchy_from_mesh, 4) == [(2, 4)] * 4


def _hsdp_leaf(rank, world_size):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh(2, 2)
    replica = mesh.get_coordinate()[0]
    # HSDP's layout: replicated along "replicate", sharded along "shard", on the whole 2-D mesh
    leaf = distribute_tensor(torch.zeros(4, 6), mesh, [Replicate(), Shard(0)], src_data_rank=None)
    leaf.to_local().add_(replica + 1.0)  # the replica groups drift apart, as between synchronizations
    puredist.average_([leaf], collective=puredist.DistributedCollective.from_mesh(mesh, "replicate"))
    return torch.equal(leaf.to_local(), torch.full((2, 6), 1.5))


def test_an_hsdp_leaf_averages_across_its_own_replicate_dimension():
    assert run_workers(_hsdp_leaf, 4) == [True] * 4


def _mesh_slices(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dc", "replicate", "shard"))
    messages = []
    for bad in (lambda: puredist.DistributedCollective.from_mesh(mesh["dc", "replicate"], ("dc", "replicate")),
                lambda: puredist.DistributedCollective.from_mesh(mesh, ("dc", "dc"))):
        try:
            bad()
        except ValueError as error:
            messages.append(str(error))
    collective = puredist.DistributedCollective.from_mesh(mesh, ("dc", "replicate"))
    # the ranks that differ only in dc and replicate: same shard coordinate
    members = torch.distributed.get_process_group_ranks(collective.process_group)
    return messages, members, collective.group_sizes


def test_a_mesh_slice_over_several_dimensions_is_refused_instead_of_hanging():
    for rank, (messages, members, sizes) in enumerate(run_workers(_mesh_slices, 8, timeout=120)):
        assert len(messages) == 2 and "a slice" in messages[0] and "repeated" in messages[1]
        assert members == [r for r in range(8) if r % 2 == rank % 2] and sizes == (2, 4)


def _whole_world_mixes_shards(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(2, 2)
    model = make_model()
    fully_shard(model, mesh=mesh["shard"])
    before = [p.to_local().clone() for p in model.parameters()]
    try:  # the default group pairs rank 0's shards with rank 1's, which are other rows
        puredist.average_(dict(model.named_parameters()), collective=puredist.DistributedCollective())
    except puredist.RankMismatchError:
        return all(torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before))
    return "averaged"


def test_averaging_shards_over_the_whole_world_raises_on_every_rank():
    assert run_workers(_whole_world_mixes_shards, 4) == [True] * 4


def _fused_sgd_on_dtensors(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    param = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    before = param.to_local().clone()
    optimizer = puredist.sgd(0.1, momentum=0.9, fused=True)
    state = optimizer.init([param])
    with pytest.raises(TypeError, match="fused.*DTensor.*nothing was stepped"):
        optimizer.update_([param], [distribute_tensor(torch.ones(8), mesh, [Shard(0)])], state)
    return torch.equal(param.to_local(), before)


def test_fused_sgd_refuses_dtensor_parameters_before_stepping():
    # torch's fused SGD kernel has no sharding rule: it raised NotImplementedError from inside the step
    assert run_workers(_fused_sgd_on_dtensors, 2) == [True, True]
