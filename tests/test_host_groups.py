"""The rank check's host side for device-only (NCCL) groups, on Gloo ranks that are
told their groups serve no host (so the Gloo twins are made and used as on NCCL): the
twins are created by every rank together, also after groups only some ranks know (the
case where torch's ``use_local_synchronization`` names would differ and hang), and a
mismatch is still caught on every rank, through the twin or, for a group without one,
on the device the group gathers on."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import puredist
from puredist import _host_groups
from workers import run_workers


def _device_only_groups(rank, world_size):
    _host_groups._serves_the_host = lambda group: False  # in this worker: every group is device-only
    if rank < 2:  # a group only ranks 0 and 1 know: their counts of groups differ from rank 2's
        pair = dist.new_group([0, 1], use_local_synchronization=True)
        dist.all_reduce(torch.ones(1), group=pair)
    collective = puredist.DistributedCollective()
    twin = _host_groups.host_group(collective.process_group)
    assert twin is not None and twin is not collective.process_group
    assert dist.get_process_group_ranks(twin) == list(range(world_size))
    tensors = [torch.full((3,), float(rank))]
    puredist.average_(tensors, collective=collective)
    assert torch.equal(tensors[0], torch.full((3,), 1.0))
    with pytest.raises(puredist.RankMismatchError, match="different tensors"):
        puredist.average_([torch.ones(3 + (rank == 2))], collective=collective)


def test_a_device_only_world_gets_its_twin_from_every_rank_together_and_checks_through_it():
    run_workers(_device_only_groups, 3, timeout=60, gloo_timeout=20)


def _device_only_subgroups(rank, world_size):
    _host_groups._serves_the_host = lambda group: False
    collective = puredist.DistributedCollective.with_subgroups([2])
    pair = collective._group(2)
    assert dist.get_process_group_ranks(_host_groups.host_group(pair)) == dist.get_process_group_ranks(pair)
    if rank >= 2:  # ranks 2 and 3 disagree within their pair; 0 and 1 agree
        with pytest.raises(puredist.RankMismatchError):
            puredist.average_([torch.ones(2 + (rank == 3))], collective=collective, group_size=2)
    else:
        puredist.average_([torch.ones(2)], collective=collective, group_size=2)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    across = puredist.DistributedCollective.from_mesh(mesh, "replicate")  # groups [0, 2] and [1, 3]
    assert dist.get_process_group_ranks(_host_groups.host_group(across.process_group)) == [rank % 2, rank % 2 + 2]
    shuffled = DeviceMesh("cpu", torch.tensor([[3, 1], [0, 2]]), mesh_dim_names=("replicate", "shard"))
    across = puredist.DistributedCollective.from_mesh(shuffled, "replicate")  # groups {0, 3} and {1, 2}
    assert _host_groups.host_group(across.process_group) is not None  # found whatever order the mesh lists them in
    # a group puredist did not make has no twin: the check gathers on the group's device
    odd = dist.new_subgroups_by_enumeration([[0, 1, 2], [3]])[0]
    assert _host_groups.host_group(odd) is None
    tensors = [torch.full((2,), float(rank))]
    puredist.average_(tensors, collective=puredist.DistributedCollective(odd))
    assert torch.equal(tensors[0], torch.full((2,), 1.0 if rank < 3 else 3.0))
    if rank < 3:  # rank 2 disagrees within {0, 1, 2}; rank 3 is a group of one
        with pytest.raises(puredist.RankMismatchError):
            puredist.average_([torch.ones(2 + (rank == 2))], collective=puredist.DistributedCollective(odd))


def _groups_made_on_gloo(rank, world_size):
    before = dist.get_pg_count()
    puredist.DistributedCollective.with_subgroups([2])
    puredist.DistributedCollective.from_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
                                             "replicate")
    after_mesh = dist.get_pg_count()
    return before, after_mesh


def test_a_gloo_world_gets_no_twins():
    before, after = run_workers(_groups_made_on_gloo, 4)[0]
    # the subgroups of 2 (one new_subgroups call) and the mesh's own groups: nothing more
    assert after - before == _groups_made_without_twins()


def _mesh_groups_only(rank, world_size):
    before = dist.get_pg_count()
    dist.new_subgroups(group_size=2)
    init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return dist.get_pg_count() - before


def _groups_made_without_twins():
    return run_workers(_mesh_groups_only, 4)[0]


def test_subgroups_and_mesh_groups_get_twins_and_a_group_without_one_still_checks():
    run_workers(_device_only_subgroups, 4, timeout=60, gloo_timeout=20)


def _world_group_freed_after_destroy(rank, world_size):
    import gc
    import weakref

    import puredist

    world = weakref.ref(dist.group.WORLD)
    collective = puredist.DistributedCollective()
    params = [torch.full((3,), float(rank))]
    puredist.average_(params, collective=collective)
    del collective
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    # a group kept alive past its destruction is torn down at interpreter exit, where Gloo's threads
    # abort the process ("terminate called without an active exception") now and then
    return world() is None and params[0][0].item() == 0.5


def test_nothing_keeps_a_destroyed_process_group_alive():
    assert run_workers(_world_group_freed_after_destroy, 2, broken=True) == [True, True]


def _groups_made_by_puredist_freed_after_destroy(rank, world_size, device_only):
    import gc
    import weakref

    if device_only:  # as on NCCL: the world, its subgroups and the mesh's groups get Gloo twins
        _host_groups._serves_the_host = lambda group: False
    hierarchical = puredist.DistributedCollective.with_subgroups([2])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    across = puredist.DistributedCollective.from_mesh(mesh, ("replicate", "shard"))  # a group of its own
    made = [dist.group.WORLD, hierarchical._group(2), across.process_group,
            *(_host_groups.host_group(g) for g in (dist.group.WORLD, hierarchical._group(2)) if device_only)]
    assert all(group is not None for group in made)
    params = [torch.full((3,), float(rank))]
    puredist.average_(params, collective=hierarchical, group_size=2)
    alive = [weakref.ref(group) for group in made]
    del hierarchical, across, mesh, made
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    return [ref() is None for ref in alive], params[0][0].item() == (0.5 if rank < 2 else 2.5)


@pytest.mark.parametrize("device_only", [False, True], ids=["gloo", "device-only (twins)"])
def test_the_groups_puredist_makes_do_not_keep_a_destroyed_world_alive(device_only):
    # the subgroups, mesh groups and twins puredist caches held the world and themselves past
    # destroy_process_group, to be torn down at interpreter exit (where Gloo's threads may abort)
    for freed, averaged in run_workers(_groups_made_by_puredist_freed_after_destroy, 4, device_only, broken=True):
        assert averaged and freed == [True] * len(freed), freed
