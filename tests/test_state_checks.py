"""States, checkpoints and settings that do not belong together are refused, on every
rank, before anything is communicated or changed (the third reliability round).

Each test builds the mismatch a user can make and checks that the error names it and
that every tensor and every state is as before:

- a params tree other than the one a DiLoCo state or an optimizer state was made for;
- ranks whose outer optimizers differ (learning rate), and checkpoints of another outer
  optimizer (another learning rate, another kind);
- a ``PostLocalSGDOptimizer`` checkpoint of one rank loaded on every rank;
- a ``consolidate_state_dict`` that failed, then ``state_dict()``;
- inf in one rank's pseudo-gradient under compression: the error names the rank and leaf.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
import torch
import torch.distributed as dist

import puredist
from puredist import RankMismatchError
from puredist.classic import ZeroRedundancyOptimizer
from test_post_local_sgd import PUREDIST, build, train_step
from workers import run_workers

NESTEROV = dict(lr=0.7, momentum=0.9, nesterov=True)


def _params(rank: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"emb": torch.randn(5, 3, generator=gen), "l1": torch.randn(3, 3, generator=gen),
            "l2": torch.randn(3, generator=gen)}


def _other_tree(rank, world_size):
    diloco = puredist.outer_optimizer(puredist.sgd(**NESTEROV), sync_every=1)
    collective = puredist.DistributedCollective()
    params = _params()
    state = diloco.update_(params, diloco.init(params), collective=collective)  # step 0: the first sync
    frozen_embedding = {"l1": params["l1"], "l2": params["l2"]}
    before = {k: v.clone() for k, v in params.items()}
    globals_before = [g.clone() for g in state.global_params]
    errors = []
    for wrong in (frozen_embedding, {**params, "l1": params["l1"].t().contiguous()[:2]}):
        with pytest.raises(ValueError, match=r"Arg ``params`` has \d leaves; the state was made by init for 3") as error:
            diloco.update_(wrong, state, collective=collective)
        errors.append(str(error.value))
    assert all(torch.equal(params[k], before[k]) for k in params)
    assert all(torch.equal(g, b) for g, b in zip(state.global_params, globals_before))
    state = diloco.update_(params, state, collective=collective)  # the right tree still works, on every rank
    return errors


def test_diloco_refuses_a_params_tree_other_than_its_states_on_every_rank():
    for errors in run_workers(_other_tree, 2):
        assert "leaf 0 differs (params: shape (3, 3)" in errors[0]  # l1 paired with the embedding's state
        assert "leaf 1 differs (params: shape (2, 3)" in errors[1]


@pytest.mark.parametrize("make", [lambda: puredist.sgd(0.1, momentum=0.9), lambda: puredist.adam(0.1)])
def test_an_optimizer_refuses_a_state_made_for_other_parameters_before_stepping(make):
    opt = make()
    params = [torch.ones(3, 2), torch.ones(4)]
    state = opt.init([torch.ones(2, 3), torch.ones(4)])  # same count, other shapes
    before = [p.clone() for p in params]
    grads = [torch.ones(3, 2), torch.ones(4)]
    for update in (opt.update_, lambda *a: opt.update(*a)[1]):
        with pytest.raises(ValueError, match=r"parameter 0 has shape \(3, 2\), its state's buffers \(2, 3\)"):
            update(params, grads, state)
    assert all(torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.parametrize("make", [lambda: puredist.sgd(0.1, momentum=0.9), lambda: puredist.adam(0.1)])
def test_an_optimizer_refuses_gradients_of_other_shapes_before_stepping(make):
    opt = make()
    params = [torch.ones(3, 4), torch.ones(4)]
    state = opt.init(params)
    before = [p.clone() for p in params]
    for grads in ([torch.ones(4), torch.ones(3, 4)], [torch.ones(1), None]):  # swapped; one that would broadcast
        for update in (opt.update_, lambda *a: opt.update(*a)[1]):
            with pytest.raises(ValueError, match=r"gradient 0 has shape \((4|1),\), its parameter \(3, 4\)"):
                update(params, grads, state)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(torch.equal(a, b) for s, t in zip(state, opt.init(params)) for a, b in zip(s, t))  # counts too


def test_adam_refuses_a_sparse_gradient_before_stepping_as_torch_does():
    opt = puredist.adam(0.1)
    params = [torch.ones(4), torch.ones(4)]
    state = opt.init(params)
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2), (4,), check_invariants=True)
    for update in (opt.update_, lambda *a: opt.update(*a)[1]):
        with pytest.raises(ValueError, match="gradient 1 is sparse; adam takes dense gradients only"):
            update(params, [torch.ones(4), sparse], state)
    assert all(torch.equal(p, torch.ones(4)) for p in params) and all(s.step.item() == 0 for s in state)
    with pytest.raises(ValueError, match="got nan"):  # as torch.optim.Adam refuses it
        puredist.adam(float("nan"))


def _different_outer_rates(rank, world_size):
    diloco = puredist.outer_optimizer(puredist.sgd(lr=0.7 if rank == 0 else 0.3, momentum=0.9), sync_every=2)
    params = _params()
    before = {k: v.clone() for k, v in params.items()}
    with pytest.raises(RankMismatchError, match=r"(?s)sgd\(lr=0.7.*sgd\(lr=0.3") as error:
        diloco.update_(params, diloco.init(params), collective=puredist.DistributedCollective())
    assert all(torch.equal(params[k], before[k]) for k in params)
    return str(error.value)


def test_ranks_with_different_outer_optimizers_raise_on_every_rank():
    assert len(run_workers(_different_outer_rates, 2)) == 2


@pytest.mark.parametrize("saved_with, loaded_with", [
    (puredist.sgd(**NESTEROV), puredist.sgd(lr=0.1)),
    (puredist.adam(1e-3), puredist.sgd(**NESTEROV)),
])
def test_a_checkpoint_of_another_outer_optimizer_is_refused(saved_with, loaded_with):
    params = list(_params().values())
    saving = puredist.outer_optimizer(saved_with, sync_every=2)
    saved = saving.state_dict(saving.init(params), rank=0)
    loading = puredist.outer_optimizer(loaded_with, sync_every=2)
    with pytest.raises(ValueError, match=r"was saved by .*" + saved_with.config.split("(")[0]):
        loading.load_state_dict(loading.init(params), saved, rank=0)


def test_a_checkpoint_of_another_kind_of_optimizer_built_by_hand_is_refused():
    # without a config to compare (an optimizer built by hand), the state's fields tell the kinds apart
    by_hand = lambda opt: puredist.Optimizer(opt.init, opt.update, opt.update_)  # noqa: E731
    params = list(_params().values())
    saving = puredist.outer_optimizer(by_hand(puredist.adam(1e-3)), sync_every=2)
    loading = puredist.outer_optimizer(by_hand(puredist.sgd(**NESTEROV)), sync_every=2)
    saved = saving.state_dict(saving.init(params), rank=0)
    with pytest.raises(ValueError, match=r"exp_avg.*momentum_buffer.*a checkpoint of another optimizer"):
        loading.load_state_dict(loading.init(params), saved, rank=0)


def test_a_checkpoint_that_marks_unused_state_fields_absent_still_loads():
    """Checkpoints from before states dropped their unused fields saved SGD without
    momentum as ``momentum_buffer`` and ``step`` marked absent: they load, the same
    values."""
    params = [p.unsqueeze(0) for p in _params().values()]  # one simulated rank
    transform = puredist.outer_optimizer(puredist.sgd(0.5), sync_every=1)
    state = transform.update_(params, transform.init(params), collective=puredist.SimulatedCollective(1))
    saved = transform.state_dict(state, rank=0)
    for i, g in enumerate(state.global_params):
        for field in ("momentum_buffer", "step"):
            saved[f"outer.{i}.{field}.present"], saved[f"outer.{i}.{field}"] = False, torch.zeros_like(g)
    loaded = transform.load_state_dict(transform.init(params), saved, rank=0)
    assert loaded.step == 1 and all(torch.equal(a, b) for a, b in zip(loaded.global_params, state.global_params))


def _everyone_loads_rank_0s_file(rank, world_size, folder):
    alone, _ = dist.new_subgroups(group_size=1)  # gradients stay local after the start: ranks drift apart
    model, optimizer, _ = build(PUREDIST, alone)
    for step in range(5):  # between averagings (the last at step 3): ranks differ
        train_step(model, optimizer, rank, step)
    torch.save(optimizer.state_dict(), f"{folder}/rank{rank}.pt")
    dist.barrier()
    optimizer.load_state_dict(torch.load(f"{folder}/rank0.pt"))  # local, as torch's
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="another rank's parameters or optimizer state"):
        train_step(model, optimizer, rank, 5)  # the first step after it: every rank refuses, nothing stepped
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_every_rank_loading_rank_0s_post_local_sgd_file_refuses_its_next_step_on_every_rank_without_waiting(tmp_path):
    run_workers(_everyone_loads_rank_0s_file, 2, str(tmp_path), timeout=30, gloo_timeout=20)


def _other_momentum_same_parameters(rank, world_size):
    alone, _ = dist.new_subgroups(group_size=1)
    model, optimizer, _ = build(PUREDIST, alone)
    for step in range(5):
        train_step(model, optimizer, rank, step)
    saved = optimizer.state_dict()
    if rank == 1:  # its own file, its own parameters, but another momentum (as another rank's would be)
        for entry in saved["state"].values():
            entry["momentum_buffer"] = entry["momentum_buffer"] * 2
    optimizer.load_state_dict(saved)
    with pytest.raises(RuntimeError, match="another rank's parameters or optimizer state"):
        train_step(model, optimizer, rank, 5)


def test_a_post_local_sgd_state_with_another_momentum_is_refused_on_every_rank():
    # the digest covers the optimizer state, not only the parameters
    run_workers(_other_momentum_same_parameters, 2)


def _optimizer_loaded_before_the_model(rank, world_size, folder, models_of):
    # per-rank files, loaded as any torch.optim optimizer may be: the optimizer first, then the model. With each
    # rank's own model the run goes on equal to an uninterrupted one; with another rank's model (models_of), the
    # first step raises on every rank and steps nothing
    from test_post_local_sgd import STEPS, params_of

    alone, _ = dist.new_subgroups(group_size=1)
    model, optimizer, hook_state = build(PUREDIST, alone)
    for step in range(5):
        train_step(model, optimizer, rank, step)
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, f"{folder}/rank{rank}.pt")
    dist.barrier()
    for step in range(5, STEPS):
        train_step(model, optimizer, rank, step)
    uninterrupted = params_of(model)

    model, optimizer, hook_state = build(PUREDIST, alone)
    hook_state.iter = 5
    optimizer.load_state_dict(torch.load(f"{folder}/rank{rank}.pt")["optim"])
    model.load_state_dict(torch.load(f"{folder}/rank{models_of[rank]}.pt")["model"])
    if models_of[rank] != rank or models_of != list(range(world_size)):
        loaded = params_of(model)
        with pytest.raises(RuntimeError, match="another rank's parameters.*nothing was stepped"):
            train_step(model, optimizer, rank, 5)
        return all(torch.equal(a, b) for a, b in zip(params_of(model), loaded))
    for step in range(5, STEPS):
        train_step(model, optimizer, rank, step)
    return all(torch.equal(a, b) for a, b in zip(params_of(model), uninterrupted))


@pytest.mark.parametrize("models_of", [[0, 1], [0, 0]], ids=["own models", "rank 0's model everywhere"])
def test_post_local_sgd_loaded_before_its_model_resumes_or_refuses_at_the_first_step(tmp_path, models_of):
    assert run_workers(_optimizer_loaded_before_the_model, 2, str(tmp_path), models_of, timeout=60) == [True, True]


def _failed_consolidation(rank, world_size):
    param = torch.nn.Parameter(torch.ones(4))
    zero = ZeroRedundancyOptimizer([param], torch.optim.Adam, lr=0.1)
    for _ in range(1):
        param.grad = torch.ones(4)
        zero.step()
    zero.consolidate_state_dict(to=0)
    for _ in range(2):
        zero.step()
    gather_object = dist.gather_object

    def failing(*args, **kwargs):  # the fault: the gather fails on every rank (a peer gone)
        raise RuntimeError("injected: connection reset by peer")

    dist.gather_object = failing
    try:
        with pytest.raises(RuntimeError, match="injected"):
            zero.consolidate_state_dict(to=0)
    finally:
        dist.gather_object = gather_object
    if rank == 0:
        with pytest.raises(RuntimeError, match=r"last consolidate_state_dict\(\) failed .*injected"):
            zero.state_dict()
    zero.consolidate_state_dict(to=0)  # and again, once the group works
    if rank == 0:
        steps = [entry["step"] for entry in zero.state_dict()["state"].values()]
        assert all(float(step) == 3 for step in steps), steps


def test_a_failed_consolidation_leaves_no_stale_state_dict():
    run_workers(_failed_consolidation, 2)


def _non_finite_pseudo_gradient(rank, world_size):
    diloco = puredist.outer_optimizer(puredist.sgd(**NESTEROV), sync_every=1, compressor=puredist.int8_blocks())
    collective = puredist.DistributedCollective()
    params = list(_params().values())
    state = diloco.update_(params, diloco.init(params), collective=collective)
    if rank == 1:
        params[1][0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"inf or NaN \(rank 1: inf or NaN in leaf 1\)") as error:
        diloco.update_(params, state, collective=collective)
    return str(error.value)


def test_inf_in_one_ranks_compressed_pseudo_gradient_names_the_rank_and_leaf_on_every_rank():
    messages = run_workers(_non_finite_pseudo_gradient, 2)
    assert all("different steps" not in m for m in messages)


def _save_compressed(rank, world_size, folder):
    diloco = puredist.outer_optimizer(puredist.sgd(**NESTEROV), sync_every=1, compressor=puredist.int4_blocks())
    params = list(_params().values())
    state = diloco.init(params)
    for _ in range(2):
        params[0].add_(0.1 * (rank + 1))
        state = diloco.update_(params, state, collective=puredist.DistributedCollective())
    torch.save(diloco.state_dict(state, rank=rank), f"{folder}/rank{rank}.pt")


def _load_compressed(rank, world_size, folder):
    diloco = puredist.outer_optimizer(puredist.sgd(**NESTEROV), sync_every=1, compressor=puredist.int4_blocks())
    template = diloco.init(list(_params().values()))
    with pytest.raises(ValueError, match="saved at world size 2, this run has 1"):
        diloco.load_state_dict(template, torch.load(f"{folder}/rank{rank}.pt"), rank=rank)


def test_a_compressed_diloco_checkpoint_is_refused_at_another_world_size(tmp_path):
    # ranks' residuals are their own: loading rank 0's at one rank would drop rank 1's without a word
    run_workers(_save_compressed, 2, str(tmp_path))
    run_workers(_load_compressed, 1, str(tmp_path))


def _owner_refuses(rank, world_size):
    import time

    # one parameter: rank 0 owns it, rank 1 owns nothing; the rate turns negative at the third step
    zero = puredist.zero(puredist.sgd(lr=lambda count: 0.1 - 0.06 * count))
    params = [torch.ones(3)]
    plan = puredist.plan_zero([3], world_size)
    assert plan.owners == (0,)
    state = zero.init(params, plan=plan, rank=rank)
    collective = puredist.DistributedCollective()
    for _ in range(2):
        state = zero.update_(params, [torch.ones(3)], state, collective=collective)
    before = params[0].clone()
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"A ZeRO step was refused \(rank 0: .*``lr`` must be a non-negative"):
        zero.update_(params, [torch.ones(3)], state, collective=collective)
    assert torch.equal(params[0], before)
    return time.perf_counter() - started


def test_a_rank_that_owns_nothing_raises_the_owners_refusal_at_once():
    for seconds in run_workers(_owner_refuses, 2, gloo_timeout=20, timeout=40):
        assert seconds < 10  # well before the collective's timeout (20 s), which it used to wait out


def _diloco_mid_run():
    """A DiLoCo run on 2 simulated ranks saved with a delayed synchronization in flight;
    the transform, the saved dict, a template, and the drift of each later step."""
    transform = puredist.outer_optimizer(puredist.sgd(**NESTEROV), sync_every=2, fragments=2, delay=1)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(1, 3, generator=gen).expand(2, 3).clone(), torch.randn(1, 2, 2, generator=gen).expand(2, 2, 2).clone()]
    drifts = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(7)]
    collective = puredist.SimulatedCollective(2)
    state = transform.init(params)
    for drift in drifts[:3]:
        for p, d in zip(params, drift):
            p.add_(d)
        state = transform.update_(params, state, collective=collective)
    assert state.in_flight  # fragment 0's synchronization started at step 2 applies at step 3
    return transform, transform.state_dict(state, rank=0), [p.clone() for p in params], drifts[3:]


def _continue(transform, saved, params, drifts):
    params = [p.clone() for p in params]
    state = transform.load_state_dict(transform.init(params), saved, rank=0)
    for drift in drifts:
        for p, d in zip(params, drift):
            p.add_(d)
        state = transform.update_(params, state, collective=puredist.SimulatedCollective(2))
    return params


MID_RUN = _diloco_mid_run()
UNCHANGED = _continue(*MID_RUN)


def _mutated(value, how: str):
    if how == "drop":
        return None
    if isinstance(value, torch.Tensor):
        if how == "shape":
            return torch.cat([value.flatten(), value.flatten()[:1]]) if value.numel() else torch.zeros(1)
        return value.double() if value.dtype != torch.float64 else value.float()
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + (1 if how == "shape" else -1)
    return value + " changed"


@given(key=st.sampled_from(sorted(MID_RUN[1])), how=st.sampled_from(["drop", "shape", "dtype"]))
def test_a_checkpoint_with_any_entry_changed_or_dropped_is_refused_or_continues_the_same_run(key, how):
    transform, saved, params, drifts = MID_RUN
    changed = dict(saved)
    if how == "drop":
        del changed[key]
    else:
        changed[key] = _mutated(saved[key], how)
    try:
        continued = _continue(transform, changed, params, drifts)
    except ValueError as error:
        assert "saved" in str(error)  # refused, naming the argument
        return
    assert all(torch.equal(a, b) for a, b in zip(continued, UNCHANGED)), (key, how)


def _residuals_at_another_sharding(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def transform_and_state(replicas, shards):
        mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
        leaf = distribute_tensor(torch.ones(4, 4), mesh, [Replicate(), Shard(0)])
        diloco = puredist.outer_optimizer(puredist.sgd(**NESTEROV), sync_every=2, compressor=puredist.int8_blocks())
        return diloco, diloco.init([leaf])

    diloco, state = transform_and_state(2, 1)  # two replicas of an unsharded model: residuals (4, 4)
    saved = diloco.state_dict(state, rank=rank)
    diloco, template = transform_and_state(1, 2)  # one replica sharded in two: this rank's shard (2, 4)
    with pytest.raises(ValueError, match=r"residual 0 has shape \(4, 4\), this rank's shard \(2, 4\).*another sharding"):
        diloco.load_state_dict(template, saved, rank=rank)


def test_compressed_residuals_saved_at_another_sharding_are_refused():
    run_workers(_residuals_at_another_sharding, 2)


def _owner_refuses_the_gradients(rank, world_size, bad):
    import time

    # one parameter, owned by rank 0; every rank passes the same bad gradient
    zero = puredist.zero(puredist.adam(lr=0.1))
    params = [torch.ones(3)]
    state = zero.init(params, plan=puredist.plan_zero([3], world_size), rank=rank)
    grad = torch.ones(4) if bad == "shape" else torch.ones(3).to_sparse()
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"A ZeRO step was refused \(rank 0: .*gradient 0"):
        zero.update_(params, [grad], state, collective=puredist.DistributedCollective())
    assert torch.equal(params[0], torch.ones(3))
    return time.perf_counter() - started


@pytest.mark.parametrize("bad", ["shape", "sparse"])
def test_a_rank_that_owns_nothing_raises_the_owners_refusal_of_its_gradients_at_once(bad):
    for seconds in run_workers(_owner_refuses_the_gradients, 2, bad, gloo_timeout=20, timeout=40):
        assert seconds < 10


def _one_rank_passes_bad_input(rank, world_size, bad):
    import time

    zero = puredist.zero(puredist.sgd(lr=0.1))
    params = [torch.ones(3), torch.ones(2)]
    plan = puredist.plan_zero([3, 2], world_size)
    state = zero.init(params, plan=plan, rank=rank)
    grads = [torch.ones(3), torch.ones(2)]
    if rank == 1 and bad == "grads":
        grads = grads[:1]
    if rank == 1 and bad == "plan":
        state = state._replace(plan=puredist.plan_zero([3, 2], world_size + 1))
    started = time.perf_counter()
    if rank == 1:
        expected = r"Arg ``grads``" if bad == "grads" else r"shards over 3 ranks, the collective has 2"
        with pytest.raises(ValueError, match=expected):
            zero.update_(params, grads, state, collective=puredist.DistributedCollective())
        time.sleep(8)  # alive, as a rank that logs or checkpoints after its error: its peer must not wait for it
    else:
        with pytest.raises(RankMismatchError, match=r"rank 1: .*refused: ValueError"):
            zero.update_(params, grads, state, collective=puredist.DistributedCollective())
    assert all(torch.equal(p, torch.ones_like(p)) for p in params)
    return time.perf_counter() - started


@pytest.mark.parametrize("bad", ["grads", "plan"])
def test_a_rank_refusing_its_zero_input_makes_its_peers_raise_at_once(bad):
    # a gradient list of another length or a plan for another world size on one rank: its peer waited in
    # the rank check until that rank's process left, or until the collective's timeout
    seconds = run_workers(_one_rank_passes_bad_input, 2, bad, gloo_timeout=20, timeout=40)
    assert seconds[0] < 5, seconds


def _another_ranks_state(rank, world_size):
    import time

    zero = puredist.zero(puredist.adam(lr=0.1))
    params = [torch.ones(3), torch.ones(2), torch.ones(1)]
    plan = puredist.plan_zero([3, 2, 1], world_size)  # owners (0, 1, 1)
    state = zero.init(params, plan=plan, rank=0)  # rank 1 given rank 0's: one state for its two parameters
    grads = [torch.ones(3), torch.ones(2), torch.ones(1)]
    started = time.perf_counter()
    expected = (r"Arg ``state`` holds 1 parameter states for 2 parameter\(s\) rank 1 owns \(another rank's state\?"
                if rank == 1 else r"rank 1: .*refused: ValueError")
    with pytest.raises(ValueError if rank == 1 else RankMismatchError, match=expected):
        zero.update_(params, grads, state, collective=puredist.DistributedCollective())
    assert all(torch.equal(p, torch.ones_like(p)) for p in params)
    return time.perf_counter() - started


def test_a_zero_state_of_another_rank_is_refused_and_its_peer_raises_at_once():
    # it raised IndexError on that rank alone, outside the refusal its peers learn: they waited in the rank check
    seconds = run_workers(_another_ranks_state, 2, gloo_timeout=20, timeout=40)
    assert seconds[0] < 5, seconds


@pytest.mark.parametrize("owners", [(0, 2), (0, -1), (0, "1")])
def test_a_plan_naming_a_rank_outside_its_world_is_refused_by_name(owners):
    plan = puredist.ZeroPlan(2, owners)
    zero = puredist.zero(puredist.sgd(lr=0.1))
    stacked = [torch.ones(2, 3), torch.ones(2, 2)]
    with pytest.raises(ValueError, match=r"Arg ``plan``: owners must be ranks in \[0, 2\), got .* at parameter 1"):
        zero.init(stacked, plan=plan, rank=0)
    with pytest.raises(ValueError, match=r"Arg ``plan``: owners must be ranks in \[0, 2\)"):
        zero.init(stacked, plan=plan, rank=None)
    with pytest.raises(ValueError, match=r"owners must be ranks in \[0, 2\)"):
        plan.loads([3, 2])
    # a state carrying such a plan (built by hand) is refused before anything is stepped
    state = zero.init(stacked, plan=puredist.ZeroPlan(2, (0, 1)), rank=None)._replace(plan=plan)
    with pytest.raises(ValueError, match=r"The state's plan: owners must be ranks in \[0, 2\)"):
        zero.update_(stacked, [torch.ones(2, 3), torch.ones(2, 2)], state, collective=puredist.SimulatedCollective(2))
    assert all(torch.equal(p, torch.ones_like(p)) for p in stacked)
