"""DiLoCo's failure paths: ranks that start apart are refused; a synchronization that
fails leaves the state passed in valid and un-applied (nothing half-reduced is saved
or applied) and a retry on the survivors re-issues it; loads are validated before
anything is built."""

import pytest
import torch
import torch.distributed as dist

import puredist
from faults import fault_at_collective
from puredist import CollectiveError, DistributedCollective, RankMismatchError, SimulatedCollective
from workers import run_workers


def diloco(**options):
    return puredist.outer_optimizer(puredist.sgd(lr=1.0), **{"sync_every": 2, **options})


def test_replicas_that_start_apart_are_refused_at_the_first_update():
    transform = diloco()
    params = [torch.tensor([[0.0, 1.0], [1.0, 1.0]])]  # replica 1 starts 1.0 away
    state = transform.init(params)
    with pytest.raises(RankMismatchError, match=r"Tensors \[0\] .*differ.*initial parameters"):
        transform.update_(params, state, collective=SimulatedCollective(2))
    assert torch.equal(params[0], torch.tensor([[0.0, 1.0], [1.0, 1.0]]))


def _start_apart(rank, world_size):
    transform = diloco()
    params = [torch.full((3,), float(rank))]
    with pytest.raises(RankMismatchError, match="initial parameters"):
        transform.update_(params, transform.init(params), collective=DistributedCollective())
    # only a later tensor apart (the first ones equal): every tensor is compared
    params = [torch.ones(3), torch.ones(2), torch.full((4,), float(rank))]
    with pytest.raises(RankMismatchError, match=r"Tensors \[2\] .*differ.*initial parameters"):
        transform.update_(params, transform.init(params), collective=DistributedCollective())
    return True


def test_ranks_that_start_apart_are_refused_on_every_rank():
    assert run_workers(_start_apart, 2) == [True, True]


def _sync_fails_in_flight(rank, world_size):
    transform = diloco(delay=1)
    params = [torch.zeros(4)]
    state = transform.init(params)
    if rank == 2:
        fault_at_collective(0, how="die", when="before")  # never joins the first synchronization
    params[0].add_(rank + 1)  # local progress before the sync
    state = transform.update_(params, state, collective=DistributedCollective())  # inner step 1: nothing due
    earlier = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in transform.state_dict(state, rank=rank).items()}
    state = transform.update_(params, state, collective=DistributedCollective())  # inner step 2: starts it, in flight
    params[0].add_(0.5)  # local progress while it is in flight
    before_params, before_global = params[0].clone(), state.global_params[0].clone()
    with pytest.raises(CollectiveError, match="No tensor holds a partial result"):
        transform.update_(params, state, collective=DistributedCollective())  # would apply it
    assert torch.equal(params[0], before_params) and torch.equal(state.global_params[0], before_global)
    with pytest.raises(CollectiveError):
        transform.state_dict(state, rank=rank)  # nothing half-reduced is saved
    # the failed state still serves as the template of a load (any state of the transform does)
    assert transform.load_state_dict(state, earlier, rank=rank).step == 1
    survivors = dist.new_group([0, 1], use_local_synchronization=True)
    state = transform.update_(params, state, collective=DistributedCollective(survivors))
    # outer sgd(lr=1) is plain averaging over the survivors: g = mean(1, 2) = 1.5, plus the 0.5 made meanwhile
    assert torch.equal(state.global_params[0], torch.full((4,), 1.5))
    assert torch.equal(params[0], torch.full((4,), 2.0))
    return transform.state_dict(state, rank=rank)["step"]


def test_a_failed_synchronization_leaves_the_state_unapplied_and_a_retry_on_survivors_completes_it():
    results = run_workers(_sync_fails_in_flight, 3, victims=(2,), timeout=60)
    assert results[:2] == [3, 3]


def saved_state(transform, params, steps, collective):
    state = transform.init(params)
    for _ in range(steps):
        for p in params:
            p.add_(torch.arange(p.shape[0], dtype=p.dtype).unsqueeze(-1))
        state = transform.update_(params, state, collective=collective)
    return state


@pytest.mark.parametrize(
    "other, match",
    [
        (dict(delay=0), r"saved by .*delay=1.*this transform is .*delay=0"),
        (dict(sync_every=4, delay=1), r"sync_every=2.*sync_every=4"),
        (dict(delay=1, comm_dtype=torch.bfloat16), r"comm_dtype=None.*comm_dtype=torch.bfloat16"),
        (dict(delay=1, fragments=2), r"fragments=1.*fragments=2"),
    ],
)
def test_a_checkpoint_of_another_configuration_is_refused(other, match):
    params = [torch.zeros(2, 3), torch.zeros(2, 5)]
    saved = diloco(delay=1).state_dict(saved_state(diloco(delay=1), params, 3, SimulatedCollective(2)), rank=0)
    target = diloco(**other)
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(target.init(params), saved, rank=0)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda s: s.update(step=-1), r"step.*non-negative int, got -1"),
        (lambda s: s.update({"in_flight.0.started": 1}), r"fragment 0.*started after inner step 1 .*saved step 4"),
        # a synchronization in flight left out would never be applied
        (lambda s: s.update({"in_flight.0.started": -1}),
         r"fragment 0.*step -1 .*started after inner step 4 in flight, applied after inner step 5"),
        (lambda s: s.update({"global.2": torch.zeros(2)}), r"entries this transform's checkpoint does not: \['global.2'\]"),
        (lambda s: s.update({"global.1": torch.zeros(2, 4)}), r"global.1.*shape \(2, 4\).*\(2, 5\)"),
    ],
)
def test_a_corrupt_checkpoint_is_refused(edit, match):
    params = [torch.zeros(2, 3), torch.zeros(2, 5)]
    transform = diloco(delay=1)
    saved = transform.state_dict(saved_state(transform, params, 4, SimulatedCollective(2)), rank=0)  # one in flight
    edit(saved)
    with pytest.raises(ValueError, match=match):
        transform.load_state_dict(transform.init(params), saved, rank=0)


def test_a_callers_own_entries_in_the_same_dict_load():
    params = [torch.zeros(2, 3), torch.zeros(2, 5)]
    transform = diloco(delay=1)
    saved = transform.state_dict(saved_state(transform, params, 3, SimulatedCollective(2)), rank=0)
    saved.update({"outer.linear.weight": torch.ones(1), "global.step": 7, "model.0.weight": torch.ones(1)})
    assert transform.load_state_dict(transform.init(params), saved, rank=0).step == 3


def test_a_load_into_a_flat_template_leaves_the_templates_tensors_alone():
    # the template's fragments are laid out flat (global copy, momentum, residuals: views of one buffer each); the
    # load lays the saved state out the same way in buffers of its own. The oracle: the template's own copy
    from puredist.outer.storage.flat_layout import flat_base

    transform = puredist.outer_optimizer(puredist.sgd(lr=0.7, momentum=0.9), sync_every=2, fragments=2,
                                         compressor=puredist.int8_blocks(8))
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(1, n, generator=gen).repeat(2, 1) for n in (3, 4, 5, 2)]  # fragments: leaves 0-1, 2-3
    template = transform.init(params)

    def tensors(state):
        return [*state.global_params, *(t for leaf in state.outer_state for t in leaf), *state.residuals]

    columns = [template.global_params, [s.momentum_buffer for s in template.outer_state], template.residuals]
    assert all(flat_base(column[a:b]) is not None for column in columns for a, b in ((0, 2), (2, 4)))
    kept = [t.clone() for t in tensors(template)]
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v
             for k, v in transform.state_dict(saved_state(transform, params, 5, SimulatedCollective(2)), rank=0).items()}
    loaded = transform.load_state_dict(template, saved, rank=0)
    assert all(torch.equal(t, k) for t, k in zip(tensors(template), kept))
    assert not all(torch.equal(t, k) for t, k in zip(tensors(loaded), kept))  # (what was saved differs from it)
    reloaded = transform.state_dict(loaded, rank=0)
    assert all(torch.equal(reloaded[k], v) if isinstance(v, torch.Tensor) else reloaded[k] == v for k, v in saved.items())
    loaded_columns = [loaded.global_params, [s.momentum_buffer for s in loaded.outer_state], loaded.residuals]
    assert all(flat_base(column[a:b]) is not None for column in loaded_columns for a, b in ((0, 2), (2, 4)))


def test_world_size_changes_load_by_the_documented_rule():
    params = [torch.zeros(2, 3)]
    transform = diloco(delay=1)
    in_flight = transform.state_dict(saved_state(transform, params, 4, SimulatedCollective(2)), rank=1)
    assert in_flight["in_flight.0.started"] == 4  # a delayed synchronization is in flight
    with pytest.raises(ValueError, match=r"no snapshot of rank 3.*another world size only when no delayed"):
        transform.load_state_dict(transform.init(params), in_flight, rank=3)
    settled = transform.state_dict(saved_state(transform, [torch.zeros(2, 3)], 5, SimulatedCollective(2)), rank=1)
    assert settled["in_flight.0.started"] == -1
    restored = transform.load_state_dict(transform.init(params), settled, rank=3)
    assert restored.step == 5 and restored.in_flight == ()


def _lower_level_fails(rank, world_size, pure):
    # 2 fragments: after inner step 1 fragment 0 synchronizes over everybody (applied at once) and
    # fragment 1, idle, is averaged within pairs; rank 3 dies before that pair averaging
    transform = puredist.outer_optimizer(puredist.sgd(lr=1.0), sync_every=2, fragments=2, lower_levels={1: 2})
    params = [torch.zeros(3), torch.zeros(5)]
    collective = DistributedCollective.with_subgroups([2, 4])
    state = transform.init(params)
    for p in params:
        p.add_(rank)
    if rank == 3:
        fault_at_collective(1, how="die", when="before")
    try:
        if pure:
            params, state = transform.update(params, state, collective=collective)
        else:
            state = transform.update_(params, state, collective=collective)
    except CollectiveError as error:
        assert error.state is not None and error.state.step == 1
        if pure:  # the inputs are untouched; the new parameters come with the new state
            assert all(torch.equal(p, torch.full_like(p, float(rank))) for p in params)
            params = error.params
        assert torch.equal(params[1], torch.full((5,), float(rank)))  # the pair averaging wrote nothing
        state = error.state
    assert torch.equal(state.global_params[0], torch.full((3,), 1.5))  # the outer step was applied
    assert torch.equal(params[0], state.global_params[0])  # and written into the parameters that go with it
    return state.step


@pytest.mark.parametrize("pure", [False, True], ids=["update_", "update"])
def test_a_lower_level_failure_after_the_outer_step_carries_the_new_state(pure):
    assert run_workers(_lower_level_fails, 4, pure, victims=(3,), timeout=60)[:3] == [1, 1, 1]


def test_a_checkpoint_written_by_puredist_0_1_0_is_refused_naming_the_version():
    # written by puredist 0.1.0 (commit af12312), whose count started before the first inner step was complete:
    # sync_every=2, delay=1, saved after 3 updates with a synchronization in flight
    from pathlib import Path

    saved = torch.load(Path(__file__).parent / "data" / "outer_checkpoint_0.1.0.pt")
    assert "format" not in saved and saved["in_flight.0.apply_step"] == 3
    transform = puredist.outer_optimizer(puredist.sgd(lr=0.7, momentum=0.9, nesterov=True), sync_every=2, delay=1)
    params = [torch.zeros(2, 3), torch.zeros(2, 5)]
    assert saved["config"] == transform.state_dict(transform.init(params), rank=0)["config"]  # the same options
    with pytest.raises(ValueError, match=r"saved by puredist 0\.1\.0 .*W \+ 1.*does not load it"):
        transform.load_state_dict(transform.init(params), saved, rank=0)
    current = transform.state_dict(transform.init(params), rank=0)
    with pytest.raises(ValueError, match=r"checkpoint of format 3; this version of puredist reads format 2"):
        transform.load_state_dict(transform.init(params), {**current, "format": 3}, rank=0)


def _delayed_sync_fails_with_another_due(rank, world_size):
    # streaming (H = 4, 2 fragments, delay 2): fragment 0 starts after inner step 2, applied after 4, when fragment 1
    # starts; rank 2 never joins fragment 0's. The in-flight one is waited before the next starts, so its failure is
    # recorded in the state passed in, and one retry on the survivors re-issues it and completes the step
    transform = puredist.outer_optimizer(puredist.sgd(lr=1.0), sync_every=4, fragments=2, delay=2)
    params = [torch.zeros(3), torch.zeros(5)]
    state = transform.init(params)
    if rank == 2:
        fault_at_collective(0, how="die", when="before")
    for _ in range(4):
        for p in params:
            p.add_(rank)
        try:
            state = transform.update_(params, state, collective=DistributedCollective())
        except CollectiveError:
            assert state.step == 3 and state.in_flight[0].handle.error is not None
    survivors = DistributedCollective(dist.new_group([0, 1], use_local_synchronization=True))
    state = transform.update_(params, state, collective=survivors)
    # outer sgd(lr=1) averages: fragment 0's global copy is the survivors' mean after inner step 2 (0 and 2), and the
    # write-back keeps each rank's progress since (2 * rank)
    assert torch.equal(state.global_params[0], torch.ones(3)) and torch.equal(params[0], torch.full((3,), 1.0 + 2 * rank))
    return state.step, [(item.fragment, item.started) for item in state.in_flight]


def test_a_failed_delayed_synchronization_is_recorded_before_the_next_starts_and_one_retry_completes():
    results = run_workers(_delayed_sync_fails_with_another_due, 3, victims=(2,), timeout=120, gloo_timeout=20)
    assert results[:2] == [(4, [(1, 4)])] * 2  # fragment 1's started after inner step 4, on the survivors
