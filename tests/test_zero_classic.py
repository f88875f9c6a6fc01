"""ZeroRedundancyOptimizer (not overlapped) and the functional ZeRO core on Gloo:
against torch's ZeroRedundancyOptimizer and the plain optimizer, checkpoints,
memory per rank, long runs, and bad input."""

import copy
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

import puredist
from puredist.classic import ZeroRedundancyOptimizer, hook_with_zero_step, hook_with_zero_step_interleaved
from test_zero_overlap import ddp, loss_of, make_net
from workers import run_workers

RTOL, ATOL = 1e-6, 1e-7


def param_groups(model, lrs=(0.05, 0.02)):
    """Two groups with different learning rates: the first and the other layers."""
    params = list(model.parameters())
    return [{"params": params[:2], "lr": lrs[0]}, {"params": params[2:], "lr": lrs[1]}]


def assert_close_params(a, b):
    for x, y in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL)


def _against_torch(rank, world_size, optimizer_name):
    optimizer_class, kwargs = {
        "sgd": (torch.optim.SGD, dict(momentum=0.9, weight_decay=0.01)),
        "adamw": (torch.optim.AdamW, dict(amsgrad=True)),
        "adam_decoupled": (torch.optim.Adam, dict(decoupled_weight_decay=True, weight_decay=0.5, foreach=True)),
    }[optimizer_name]
    models = [DDP(make_net()) for _ in range(3)]
    plain = optimizer_class(param_groups(models[0]), **kwargs)
    theirs = TorchZero(param_groups(models[1]), optimizer_class, **kwargs)
    ours = ZeroRedundancyOptimizer(param_groups(models[2]), optimizer_class, **kwargs)
    for step in range(8):
        if step == 4:  # schedulers change hyper-parameters between steps
            for optimizer in (plain, theirs, ours):
                optimizer.param_groups[1]["lr"] = 0.005
        for model, optimizer in zip(models, (plain, theirs, ours)):
            optimizer.zero_grad()
            loss_of(model, rank, step).backward()
            optimizer.step()
        assert_close_params(models[2], models[0])
        assert_close_params(models[2], models[1])
    owned_bytes = sum(t.numel() * t.element_size() for s in ours.optim.state.values() for t in s.values() if t.dim() > 0)
    full_bytes = sum(t.numel() * t.element_size() for s in plain.state.values() for t in s.values() if t.dim() > 0)
    return owned_bytes / full_bytes


@pytest.mark.parametrize("world_size, optimizer_name", [(2, "sgd"), (2, "adamw"), (2, "adam_decoupled"), (4, "adamw")])
def test_matches_torch_zero_and_the_plain_optimizer_with_two_param_groups(world_size, optimizer_name):
    fractions = run_workers(_against_torch, world_size, optimizer_name)
    assert sum(fractions) == pytest.approx(1.0)  # every state tensor lives on exactly one rank
    # a rank holds ~1/W of the state, up to whole parameters: the plan's balance bound
    sizes = [p.numel() for p in make_net().parameters()]
    bound = (sum(sizes) / world_size + (1 - 1 / world_size) * max(sizes)) / sum(sizes)
    assert max(fractions) <= bound


def _add_param_group(rank, world_size):
    models = [DDP(make_net()) for _ in range(2)]
    params = [list(m.parameters()) for m in models]
    plain = torch.optim.Adam(params[0][:4], lr=0.01)
    ours = ZeroRedundancyOptimizer(params[1][:4], torch.optim.Adam, lr=0.01)
    for step in range(6):
        if step == 3:
            plain.add_param_group({"params": params[0][4:], "lr": 0.02})
            ours.add_param_group({"params": params[1][4:], "lr": 0.02})
        for model, optimizer in zip(models, (plain, ours)):
            optimizer.zero_grad()
            loss_of(model, rank, step).backward()
            optimizer.step()
        assert_close_params(models[1], models[0])
    return True


def test_add_param_group_mid_training():
    assert run_workers(_add_param_group, 2) == [True, True]


def _checkpoint(rank, world_size, overlap):
    def build():
        model = ddp(make_net(), False, False)
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, overlap_with_ddp=overlap, lr=0.01)
        if overlap:
            model.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, model, zero))
        return model, zero

    def train(model, zero, steps):
        for step in steps:
            zero.zero_grad()
            loss_of(model, rank, step).backward()
            zero.step()

    plain_model = DDP(make_net())
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.01)
    uninterrupted = build()
    train(*uninterrupted, range(8))
    first = build()
    train(*first, range(4))
    for step in range(4):
        plain.zero_grad()
        loss_of(plain_model, rank, step).backward()
        plain.step()
    with pytest.raises(RuntimeError, match="has not been consolidated"):
        first[1].state_dict()
    first[1].consolidate_state_dict(to=0)
    blob = [None]
    if rank == 0:
        saved = first[1].state_dict()
        # the consolidated state is the plain optimizer's, in torch's own format
        expected = plain.state_dict()
        assert saved["param_groups"][0]["params"] == expected["param_groups"][0]["params"]
        for index, entry in expected["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(saved["state"][index][key], value, rtol=RTOL, atol=ATOL)
        buffer = io.BytesIO()
        torch.save({"model": first[0].state_dict(), "zero": saved}, buffer)
        blob = [buffer.getvalue()]
    dist.broadcast_object_list(blob, src=0)
    checkpoint = torch.load(io.BytesIO(blob[0]))
    resumed = build()  # loaded before its first iteration
    resumed[0].load_state_dict(checkpoint["model"])
    resumed[1].load_state_dict(checkpoint["zero"])
    # each rank keeps its own share only (torch's also keeps the whole loaded state in its `state`)
    params = list(resumed[0].parameters())
    assert not resumed[1].state
    assert set(resumed[1].optim.state) == {params[i] for i in resumed[1].plan.owned_by(rank)}
    train(*resumed, range(4, 8))
    assert_close_params(resumed[0], uninterrupted[0])
    return True


@pytest.mark.parametrize("overlap", [False, True])
def test_a_consolidated_checkpoint_resumes_the_same_trajectory(overlap):
    assert run_workers(_checkpoint, 2, overlap) == [True, True]


def _long_run(rank, world_size):
    model = ddp(make_net(), False, True)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.01, momentum=0.9)
    model.register_comm_hook(None, hook_with_zero_step(allreduce_hook, model, zero, shard_buckets=True))
    for step in range(60):
        loss_of(model, rank, step).backward()
        zero.zero_grad()
    return [p.detach() for p in model.parameters()]


def test_sixty_overlapped_iterations_at_four_ranks_without_a_hang():
    final = run_workers(_long_run, 4, timeout=120)
    assert all(torch.equal(a, b) for r in range(1, 4) for a, b in zip(final[0], final[r]))


def _functional_core(rank, world_size):
    collective = puredist.DistributedCollective()
    params = {n: p.detach().clone() for n, p in make_net().named_parameters()}
    sizes = [p.numel() for p in params.values()]
    optimizer = puredist.adam(lr=0.01)
    zero = puredist.zero(optimizer)
    plan = puredist.plan_zero(sizes, world_size)
    state = zero.init(params, plan=plan, rank=rank)
    pure_params = {k: v.clone() for k, v in params.items()}
    pure_state = zero.init(pure_params, plan=plan, rank=rank)
    reference = {k: v.clone() for k, v in params.items()}
    reference_state = optimizer.init(reference)
    for step in range(5):
        grads = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(step)) for k, v in params.items()}
        state = zero.update_(params, grads, state, collective=collective)
        kept = {k: v.clone() for k, v in pure_params.items()}
        pure_params, pure_state = zero.update(pure_params, grads, pure_state, collective=collective)
        assert all(not torch.equal(kept[k], pure_params[k]) for k in kept)
        reference_state = optimizer.update_(reference, grads, reference_state)
        for k in params:
            assert torch.equal(params[k], reference[k]) and torch.equal(pure_params[k], reference[k])
    assert state.step == pure_state.step == 5 and len(state.owned) == len(plan.owned_by(rank))
    return True


def test_the_functional_core_equals_the_unsharded_optimizer():
    assert run_workers(_functional_core, 2) == [True, True]


def _mismatched_plans(rank, world_size):
    params = [torch.ones(4), torch.ones(6)]
    plan = puredist.ZeroPlan(2, (0, 1) if rank == 0 else (1, 0))
    zero = puredist.zero(puredist.sgd(lr=0.1))
    state = zero.init(params, plan=plan, rank=rank)
    with pytest.raises(puredist.RankMismatchError, match="one ZeRO step"):
        zero.update_(params, [torch.ones(4), torch.ones(6)], state, collective=puredist.DistributedCollective())
    assert all(torch.equal(p, torch.ones_like(p)) for p in params)  # nothing updated
    return True


def test_mismatched_plans_raise_on_every_rank_and_update_nothing():
    assert run_workers(_mismatched_plans, 2) == [True, True]


def _consolidate_out_of_step(rank, world_size, case):
    model = make_net()
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    model.zero_grad()
    loss_of(model, rank, 0).backward()
    optimizer.step()
    with pytest.raises(puredist.RankMismatchError, match="consolidate"):
        if rank == 1 and case == "a step against a consolidation":  # (an extra step on rank 1)
            optimizer.step()
        else:
            optimizer.consolidate_state_dict(to=rank if case == "different destinations" else 0)
    return True


@pytest.mark.parametrize("case", ["a step against a consolidation", "different destinations"])
def test_consolidating_ranks_out_of_step_raise_on_every_rank_instead_of_aborting(case):
    # the gathered states would differ in size, or go to different ranks: Gloo aborted the process ("Received
    # data size doesn't match expected size") or waited for the timeout
    assert run_workers(_consolidate_out_of_step, 2, case, timeout=60, gloo_timeout=20) == [True, True]


def _a_peer_dies_in_the_broadcasts(rank, world_size, api):
    from faults import fault_at_collective

    torch.manual_seed(0)
    params = [torch.randn(n) for n in (40, 30, 20, 10, 5, 3)]
    grads = [torch.full_like(p, 0.5) for p in params]
    before = [p.clone() for p in params]
    stepped = [p.clone() for p in params]  # the oracle: torch's SGD over every parameter
    for p, g in zip(stepped, grads):
        p.sub_(0.1 * g)
    if rank == 1:
        fault_at_collective(0, how="die", when="before")  # never sends its own parameters
    with pytest.raises(puredist.CollectiveError) as error:
        if api == "classic":
            leaves = [torch.nn.Parameter(p) for p in params]
            for leaf, g in zip(leaves, grads):
                leaf.grad = g
            optimizer = ZeroRedundancyOptimizer(leaves, optimizer_class=torch.optim.SGD, lr=0.1)
            owners = optimizer._plan.owners
            params = leaves
            optimizer.step()
        else:
            zero = puredist.zero(puredist.sgd(lr=0.1))
            plan = puredist.plan_zero([p.numel() for p in params], world_size)
            owners = plan.owners
            zero.update_(params, grads, zero.init(params, plan=plan, rank=rank), collective=puredist.DistributedCollective())
    # its own parameters stepped, the others' old (nothing received), and the error says exactly that
    mine = [owner == rank for owner in owners]
    assert error.value.completed_elements == tuple(p.numel() if m else 0 for p, m in zip(params, mine))
    assert "restore the parameters and the optimizer state" in str(error.value)
    for p, m, old, new in zip(params, mine, before, stepped):
        assert torch.equal(p.detach(), new if m else old)
    return sorted(set(owners)) == [0, 1] and any(mine)


@pytest.mark.parametrize("api", ["classic", "functional"])
def test_a_peer_dying_in_the_broadcasts_is_reported_per_parameter(api):
    # rank 0 stepped its own parameters; rank 1 died before broadcasting its own: rank 0 received nothing
    assert run_workers(_a_peer_dies_in_the_broadcasts, 2, api, victims=(1,), timeout=60, gloo_timeout=20) == [True, None]


def _state_dict_hooks(rank, world_size):
    calls = {}
    for name, cls in (("torch", TorchZero), ("puredist", ZeroRedundancyOptimizer)):
        model = make_net()
        optimizer = cls(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
        model.zero_grad()
        loss_of(model, rank, 0).backward()
        optimizer.step()
        seen = calls[name] = []
        optimizer.register_state_dict_pre_hook(lambda opt: seen.append("pre"))
        optimizer.register_state_dict_post_hook(lambda opt, sd: seen.append("post") or {**sd, "mark": 1})
        optimizer.register_load_state_dict_pre_hook(lambda opt, sd: seen.append("load pre"))
        optimizer.register_load_state_dict_post_hook(lambda opt: seen.append("load post"))
        optimizer.consolidate_state_dict(to=0)
        if rank == 0:
            saved = optimizer.state_dict()
            seen.append(saved.get("mark"))
            optimizer.load_state_dict(saved)
    return calls


def test_state_dict_hooks_run_as_in_torchs_class():
    on_rank_0, on_rank_1 = run_workers(_state_dict_hooks, 2)
    assert on_rank_0["torch"] == ["pre", "post", 1, "load pre", "load post"]  # the post hook's dict returned
    assert on_rank_0["puredist"] == on_rank_0["torch"] and on_rank_1["puredist"] == on_rank_1["torch"] == []


def _torchs_attributes_and_live_param_groups(rank, world_size):
    group = dist.new_group([1, 2])  # a subgroup whose ranks are not the global ones
    if rank == 0:
        return None
    seen = {}
    for name, cls in (("torch", TorchZero), ("puredist", ZeroRedundancyOptimizer)):
        model = make_net()
        optimizer = cls(model.parameters(), optimizer_class=torch.optim.SGD, process_group=group, lr=0.1, momentum=0.9)
        attributes = [optimizer.rank, optimizer.world_size, optimizer.global_rank, optimizer.initialized]
        try:
            optimizer.state_dict()
        except RuntimeError as error:
            unconsolidated = str(error)
        loss_of(model, rank, 0).backward()
        optimizer.step()
        optimizer.consolidate_state_dict(to=1)  # group rank 1: global rank 2
        optimizer.param_groups[0]["lr"] = 0.5  # e.g. a scheduler's step between the two calls
        saved = [group["lr"] for group in optimizer.state_dict()["param_groups"]] if rank == 2 else None
        seen[name] = (attributes, unconsolidated, saved)
    return seen


def test_zero_has_torchs_attributes_and_saves_its_param_groups_as_they_are_at_state_dict():
    per_rank = run_workers(_torchs_attributes_and_live_param_groups, 3)
    for global_rank, seen in enumerate(per_rank[1:], start=1):
        assert seen["puredist"] == seen["torch"], (seen["puredist"], seen["torch"])
        assert seen["torch"][0] == [global_rank - 1, 2, global_rank, True]
    assert per_rank[2]["torch"][2] == [0.5]


def _bad_input(rank, world_size):
    model = DDP(make_net())
    errors = {}

    def record(name, fn):
        try:
            fn()
        except Exception as error:  # noqa: BLE001 - the error is the result
            errors[name] = (type(error).__name__, str(error))

    record("not an optimizer", lambda: ZeroRedundancyOptimizer(model.parameters(), dict, lr=0.1))
    record("overlap without a per-parameter step", lambda: ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.NAdam, overlap_with_ddp=True, lr=0.1))
    record("sparse", lambda: ZeroRedundancyOptimizer([torch.sparse_coo_tensor(size=(2, 3))], torch.optim.SGD, lr=0.1))
    plain_zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    record("hook without overlap", lambda: hook_with_zero_step(allreduce_hook, model, plain_zero))
    record("mixed devices", lambda: ZeroRedundancyOptimizer(
        [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, device="meta"))], torch.optim.SGD, lr=0.1))
    record("unknown keyword", lambda: ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, colour=1))
    unused = DDP(make_net(), find_unused_parameters=True)
    overlap_zero = ZeroRedundancyOptimizer(unused.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    record("find_unused_parameters", lambda: hook_with_zero_step(allreduce_hook, unused, overlap_zero))
    record("two groups with overlap", lambda: ZeroRedundancyOptimizer(param_groups(model), torch.optim.SGD, overlap_with_ddp=True, lr=0.1))
    return errors


def test_bad_input_gets_clear_errors():
    errors = run_workers(_bad_input, 2)[0]
    assert errors["not an optimizer"][0] == "TypeError" and "optimizer_class" in errors["not an optimizer"][1]
    kind, message = errors["overlap without a per-parameter step"]
    assert kind == "ValueError" and "NAdam" in message and "torch.optim.Adagrad" in message
    assert errors["sparse"][0] == "ValueError" and "sparse_coo" in errors["sparse"][1]
    assert errors["hook without overlap"] == ("ValueError", "ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp=True` to use this hook properly")
    assert errors["mixed devices"][0] == "ValueError" and "meta" in errors["mixed devices"][1]
    assert errors["unknown keyword"][0] == "TypeError" and "colour" in errors["unknown keyword"][1]
    assert errors["find_unused_parameters"][0] == "ValueError" and "find_unused_parameters" in errors["find_unused_parameters"][1]
    assert errors["two groups with overlap"][0] == "ValueError"


def _bad_loads(rank, world_size):
    model = torch.nn.Linear(4, 3)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    sgd.step()
    with pytest.raises(ValueError, match=r"parameter 0 has \['momentum_buffer'\].*Adam does not keep"):
        zero.load_state_dict(sgd.state_dict())
    adam = torch.optim.Adam(model.parameters(), lr=0.5)
    adam.step()
    wrong = copy.deepcopy(adam.state_dict())
    wrong["state"][1]["exp_avg"] = torch.zeros(7)
    with pytest.raises(ValueError, match=r"exp_avg.*parameter 1 has shape \(7,\), the parameter \(3,\)"):
        zero.load_state_dict(wrong)
    # a field missing: the owner raised KeyError at the next step while its peer waited out the timeout
    missing = copy.deepcopy(adam.state_dict())  # (torch's state_dict holds the optimizer's own entries)
    del missing["state"][1]["exp_avg_sq"]
    with pytest.raises(ValueError, match=r"parameter 1 lacks \['exp_avg_sq'\], which Adam keeps for every parameter"):
        zero.load_state_dict(missing)
    amsgrad = torch.optim.Adam(model.parameters(), lr=0.5, amsgrad=True)
    amsgrad.step()
    missing = copy.deepcopy(amsgrad.state_dict())
    del missing["state"][0]["max_exp_avg_sq"]  # kept with amsgrad only: without it, the same entry loads
    with pytest.raises(ValueError, match=r"parameter 0 lacks \['max_exp_avg_sq'\]"):
        zero.load_state_dict(missing)
    missing["param_groups"][0]["amsgrad"] = False
    ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.1).load_state_dict(missing)
    # nothing changed: the learning rate is still this optimizer's, the state still fresh
    assert zero.param_groups[0]["lr"] == 0.1
    assert not zero.optim.state
    return True


def test_loads_are_checked_on_every_rank_before_anything_changes():
    assert run_workers(_bad_loads, 2) == [True, True]


def _mixed_dtypes_and_bucket_view(rank, world_size):
    # the README's claims: parameters of several dtypes are taken (torch refuses them), and
    # parameters_as_bucket_view is accepted with no effect (storage unchanged, the same steps)
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(6, 4, generator=gen), torch.randn(4, generator=gen).double(),
             torch.randn(3, 3, generator=gen).bfloat16()]
    runs = {}
    for view in (False, True):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        pointers = [p.data_ptr() for p in params]
        zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1, momentum=0.9, parameters_as_bucket_view=view)
        for step in range(3):
            for p in params:  # the same on every rank, as DDP hands them over
                p.grad = torch.full_like(p, 0.1 * (1 + step))
            zero.step()
        assert [p.data_ptr() for p in params] == pointers
        runs[view] = params
    # oracle: the plain optimizer with the same gradients
    reference = [torch.nn.Parameter(t.clone()) for t in start]
    plain = torch.optim.SGD(reference, lr=0.1, momentum=0.9)
    for step in range(3):
        for p in reference:
            p.grad = torch.full_like(p, 0.1 * (1 + step))
        plain.step()
    for view in (False, True):
        for ours, theirs in zip(runs[view], reference):
            assert ours.dtype == theirs.dtype
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    return True


def test_parameters_of_several_dtypes_step_and_the_bucket_view_changes_nothing():
    assert run_workers(_mixed_dtypes_and_bucket_view, 2) == [True, True]


def _bad_additions_and_targets(rank, world_size):
    dense = torch.nn.Parameter(torch.ones(4))
    zero = ZeroRedundancyOptimizer([dense], torch.optim.SGD, lr=0.1)
    groups = len(zero.param_groups)
    sparse = torch.nn.Parameter(torch.ones(5).to_sparse())
    with pytest.raises(ValueError, match=r"Arg ``param_group``: .*dense.*sparse_coo at parameter 1"):
        zero.add_param_group({"params": [sparse]})
    assert len(zero.param_groups) == groups  # nothing added: the next step runs as before
    dense.grad = torch.ones(4)
    zero.step()
    for to in (world_size, -1):  # refused before any collective, on every rank
        with pytest.raises(ValueError, match=rf"Arg ``to`` must be an int in \[0, 2\) \(a rank of the group\), got {to}"):
            zero.consolidate_state_dict(to=to)
    zero.consolidate_state_dict(to=0)
    overlapped = ZeroRedundancyOptimizer([torch.nn.Parameter(torch.ones(2))], torch.optim.SGD, lr=0.1,
                                         overlap_with_ddp=True)
    with pytest.raises(RuntimeError, match="only supports a single parameter group"):  # torch's type
        overlapped.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    return dense.detach().clone()


def test_add_param_group_and_consolidate_state_dict_refuse_bad_input_before_anything_changes():
    first, second = run_workers(_bad_additions_and_targets, 2)
    assert torch.equal(first, second) and torch.equal(first, torch.full((4,), 0.9))
