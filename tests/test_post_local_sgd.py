"""Post-local SGD end to end on DDP: puredist's hook + optimizer + averager against
torch's, and restarts (state_dict and torch.distributed.checkpoint) that continue
the uninterrupted trajectory bit for bit."""

import copy
import types

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_hook
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from puredist import classic
from puredist.classic import post_localSGD_hook as our_hook
from models import make_model
from workers import run_workers

TORCH = types.SimpleNamespace(
    PostLocalSGDState=torch_hook.PostLocalSGDState,
    post_localSGD_hook=torch_hook.post_localSGD_hook,
    PostLocalSGDOptimizer=TorchPostLocalSGDOptimizer,
    PeriodicModelAverager=torch_averagers.PeriodicModelAverager,
)
PUREDIST = types.SimpleNamespace(
    PostLocalSGDState=our_hook.PostLocalSGDState,
    post_localSGD_hook=our_hook.post_localSGD_hook,
    PostLocalSGDOptimizer=classic.PostLocalSGDOptimizer,
    PeriodicModelAverager=classic.PeriodicModelAverager,
)
START_LOCAL_SGD = 3
STEPS = 11  # averagings at 3, 5, 7, 9; the last step is local


def build(impl, subgroup, momentum=0.9):
    model = DDP(make_model(seed=0))
    hook_state = impl.PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=START_LOCAL_SGD)
    model.register_comm_hook(hook_state, impl.post_localSGD_hook)
    local = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    averager = impl.PeriodicModelAverager(period=2, warmup_steps=START_LOCAL_SGD)
    return model, impl.PostLocalSGDOptimizer(local, averager), hook_state


def batch(rank, step):
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def train_step(model, optimizer, rank, step):
    inputs, targets = batch(rank, step)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.item()


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def _side_by_side(rank, world_size):
    subgroup, _ = dist.new_subgroups(group_size=2)
    reference = build(TORCH, subgroup)
    ours = build(PUREDIST, subgroup)
    for step in range(STEPS):
        train_step(reference[0], reference[1], rank, step)
        train_step(ours[0], ours[1], rank, step)
        for a, b in zip(params_of(ours[0]), params_of(reference[0])):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert ours[2].iter == reference[2].iter
        assert ours[1].averager.step == reference[1].averager.step == step + 1
    return params_of(ours[0])


def test_post_local_sgd_matches_torch_bitwise():
    final = run_workers(_side_by_side, 4)
    # local SGD really happened: after the last (local) step, the pairs (0, 1) and
    # (2, 3), which all-reduce gradients within themselves only, hold different models
    assert torch.equal(final[0][0], final[1][0]) and torch.equal(final[2][0], final[3][0])
    assert not torch.equal(final[0][0], final[2][0])


def _closure_step(rank, world_size):
    subgroup, _ = dist.new_subgroups(group_size=1)
    model, optimizer, _ = build(PUREDIST, subgroup)
    inputs, targets = batch(rank, 0)

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0
    assert optimizer.averager.step == 1
    return True


def test_step_accepts_a_closure_and_returns_its_loss():
    assert run_workers(_closure_step, 2) == [True, True]


def _resume(rank, world_size, how, momentum):
    subgroup, _ = dist.new_subgroups(group_size=2)
    model, optimizer, hook_state = build(PUREDIST, subgroup, momentum)
    for step in range(STEPS):
        train_step(model, optimizer, rank, step)
    uninterrupted = params_of(model)

    model, optimizer, hook_state = build(PUREDIST, subgroup, momentum)
    for step in range(5):
        train_step(model, optimizer, rank, step)
    optimizer.zero_grad(set_to_none=True)  # as before a checkpoint: no grads left
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    before_save = params_of(model)
    if how == "dcp":
        optimizer_state = get_optimizer_state_dict(model, optimizer)
    else:
        optimizer_state = optimizer.state_dict()
    # saving neither steps the averager nor moves parameters
    assert optimizer.averager.step == 5
    assert all(torch.equal(a, b) for a, b in zip(before_save, params_of(model)))
    hook_checkpoint = hook_state.state_dict()

    model, optimizer, hook_state = build(PUREDIST, subgroup, momentum)
    model.load_state_dict(model_state)
    if how == "dcp":
        set_optimizer_state_dict(model, optimizer, optimizer_state)
    else:
        optimizer.load_state_dict(optimizer_state)
    hook_state.load_state_dict(hook_checkpoint)
    assert optimizer.averager.step == 5 and hook_state.iter == START_LOCAL_SGD
    for step in range(5, STEPS):
        train_step(model, optimizer, rank, step)
    for a, b in zip(params_of(model), uninterrupted):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    return True


@pytest.mark.parametrize("how", ["state_dict", "dcp"])
@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_a_restart_continues_the_same_trajectory(how, momentum):
    assert run_workers(_resume, 4, how, momentum) == [True] * 4


def _missing_step_warns(rank, world_size):
    model, optimizer, _ = build(PUREDIST, None)
    saved = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9).state_dict()
    optimizer.averager.step = 7
    with pytest.warns(UserWarning, match="does not contain a step counter"):
        optimizer.load_state_dict(saved)
    return optimizer.averager.step


def test_loading_a_plain_optimizer_state_warns_and_resets_the_step():
    assert run_workers(_missing_step_warns, 2) == [0, 0]


def _zero_lr_with_rank_local_zero_grads(rank, world_size):
    steps = {}
    for name, impl in (("torch", TORCH), ("puredist", PUREDIST)):
        torch.manual_seed(rank)
        model = torch.nn.Linear(2, 1)
        optimizer = impl.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), impl.PeriodicModelAverager(period=2))
        for p in model.parameters():  # lr 0 (a warm-up's first step); rank 0's grads happen to be 0
            p.grad = torch.zeros_like(p) if rank == 0 else torch.ones_like(p)
        optimizer.step()
        steps[name] = (optimizer.averager.step, [p.detach().clone() for p in model.parameters()])
    assert steps["puredist"][0] == steps["torch"][0] == 1
    for ours, theirs in zip(steps["puredist"][1], steps["torch"][1]):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)  # both averaged
    return True


def test_a_zero_learning_rate_step_averages_like_torch_on_every_rank():
    # deciding from rank-local values whether to average would hang here
    assert run_workers(_zero_lr_with_rank_local_zero_grads, 2, timeout=60) == [True, True]


def _fp16_gradients(rank, world_size):
    grads = {}
    for name, impl in (("torch", TORCH), ("puredist", PUREDIST)):
        module = torch.nn.Linear(1, 1, bias=False).half()
        with torch.no_grad():
            module.weight.fill_(1.0)
        model = DDP(module)
        model.register_comm_hook(impl.PostLocalSGDState(None, None, start_localSGD_iter=10), impl.post_localSGD_hook)
        model(torch.full((1, 1), 40000.0, dtype=torch.half)).sum().backward()
        grads[name] = module.weight.grad.item()
    return grads


def _default_subgroup_without_cuda(rank, world_size):
    raised = {}
    for name, impl in (("torch", TORCH), ("puredist", PUREDIST)):
        model = DDP(torch.nn.Linear(2, 1))
        model.register_comm_hook(impl.PostLocalSGDState(None, None, start_localSGD_iter=1), impl.post_localSGD_hook)
        try:
            for _ in range(2):  # the second iteration is local: the hook makes the intra-machine group
                model(torch.ones(1, 2)).sum().backward()
        except Exception as error:  # (the reducer is left mid-iteration: a new model for the next)
            raised[name] = (type(error), str(error))
    return raised


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the default intra-machine group exists")
def test_without_cuda_a_default_subgroup_raises_torchs_type_saying_what_to_pass():
    for raised in run_workers(_default_subgroup_without_cuda, 2):
        assert raised["puredist"][0] is raised["torch"][0], raised
        assert "Default group size only takes effect when CUDA is available" in raised["torch"][1]
        message = raised["puredist"][1]
        assert "Default group size only takes effect when CUDA is available" in message
        assert "dist.new_subgroups(group_size=N)" in message and "post_local_gradient_allreduce=False" in message


def test_the_hook_divides_before_summing_so_fp16_gradients_do_not_overflow():
    for grads in run_workers(_fp16_gradients, 2):
        assert grads["puredist"] == grads["torch"] == 40000.0  # 2 x 40000 would overflow fp16


def _resume_from_disk(rank, world_size, how, folder, saved_after=5):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    subgroup, _ = dist.new_subgroups(group_size=2)
    model, optimizer, hook_state = build(PUREDIST, subgroup)
    for step in range(STEPS):
        train_step(model, optimizer, rank, step)
    uninterrupted = params_of(model)

    model, optimizer, hook_state = build(PUREDIST, subgroup)
    # saved after 5 steps: between averagings (3 and 5), parameters and momentum differ by rank; after 6: right
    # after the averaging at 5, the parameters are equal on every rank, the momentum differs by pair of ranks
    for step in range(saved_after):
        train_step(model, optimizer, rank, step)
    optimizer.zero_grad(set_to_none=True)
    if how == "dcp":
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    else:
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "hook": hook_state.state_dict()},
                   f"{folder}/rank{rank}.pt")

    model, optimizer, hook_state = build(PUREDIST, subgroup)
    if how == "dcp":
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])  # local
        hook_state.iter = START_LOCAL_SGD
        before = params_of(model)
        try:
            train_step(model, optimizer, rank, saved_after)
        except RuntimeError as error:
            assert "another rank's parameters or optimizer state" in str(error)
            assert all(torch.equal(a, b) for a, b in zip(before, params_of(model)))  # nothing stepped
            with pytest.raises(RuntimeError, match="another rank's"):  # nor at any later step
                optimizer.step()
            return "refused"
        for step in range(saved_after + 1, STEPS):
            train_step(model, optimizer, rank, step)
        assert all(torch.equal(a, b) for a, b in zip(params_of(model), uninterrupted))
        return "resumed"
    else:
        saved = torch.load(f"{folder}/rank{rank}.pt")
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optim"])
        hook_state.load_state_dict(saved["hook"])
    for step in range(saved_after, STEPS):
        train_step(model, optimizer, rank, step)
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), uninterrupted))
    return "resumed"


@pytest.mark.parametrize(
    "how, world_size, expected",
    [
        # at 2 ranks the hook's subgroup of 2 is everybody: ranks never differ, DCP loses nothing
        ("dcp", 2, "resumed"),
        # (at 4 ranks pairs differ: see the test below)
        ("per-rank files", 2, "resumed"),
        ("per-rank files", 4, "resumed"),
    ],
)
def test_checkpoints_on_disk_resume_bit_for_bit_or_refuse_on_every_rank(how, world_size, expected, tmp_path):
    assert run_workers(_resume_from_disk, world_size, how, str(tmp_path)) == [expected] * world_size


def _dcp_saved_between_and_right_after_averagings(rank, world_size, folder):
    return [_resume_from_disk(rank, world_size, "dcp", f"{folder}/after{steps}", steps) for steps in (5, 6)]


def test_dcp_checkpoints_of_rank_local_parameters_or_momentum_are_refused_on_every_rank(tmp_path):
    # at 4 ranks the hook averages gradients within pairs, and DCP keeps one copy of each key (rank 0's). Saved
    # between averagings, the parameters and the momentum differ by pair; right after the averaging at 5, the
    # parameters are every rank's own and only the momentum tells (the optimizer state's digest)
    results = run_workers(_dcp_saved_between_and_right_after_averagings, 4, str(tmp_path))
    assert results == [["refused", "refused"]] * 4


def _adam_and_scalar_parameters_checkpoint(rank, world_size):
    """Adam keeps a 0-dim ``step`` tensor per parameter, and a parameter may be 0-dim:
    the state's digests take them (torch's state_dict does)."""
    model = DDP(torch.nn.ModuleDict({"linear": torch.nn.Linear(3, 2)}))
    model.module.register_parameter("scale", torch.nn.Parameter(torch.tensor(1.5)))
    optimizer = classic.PostLocalSGDOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01), classic.PeriodicModelAverager(period=2, warmup_steps=1))
    for _ in range(3):
        optimizer.zero_grad()
        (model.module["linear"](torch.ones(4, 3)).sum() * model.module.scale).backward()
        optimizer.step()
    saved = optimizer.state_dict()
    restored = classic.PostLocalSGDOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01), classic.PeriodicModelAverager(period=2, warmup_steps=1))
    restored.load_state_dict(saved)
    restored.step()  # its own state and parameters: the check passes
    return saved["step"]


def test_the_state_dict_of_adam_and_of_a_scalar_parameter():
    assert run_workers(_adam_and_scalar_parameters_checkpoint, 2) == [3, 3]


def _a_checkpoint_missing_a_field(rank, world_size):
    """Rank 1's checkpoint lacks Adam's ``exp_avg_sq`` of parameter 1: its step raised
    ``KeyError`` mid-step, the peer waiting in the averaging; the load refuses it."""
    model = torch.nn.Linear(3, 2)
    optimizer = classic.PostLocalSGDOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01), classic.PeriodicModelAverager(period=2, warmup_steps=1))
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    if rank == 1:
        del saved["state"][1]["exp_avg_sq"]
    before = copy.deepcopy(optimizer.optim.state_dict()), optimizer.averager.step
    try:
        optimizer.load_state_dict(saved)
    except ValueError as error:
        after = optimizer.optim.state_dict(), optimizer.averager.step
        unchanged = after[1] == before[1] and all(
            torch.equal(after[0]["state"][i][k], v) for i, entry in before[0]["state"].items() for k, v in entry.items())
        return str(error), unchanged
    return None, None


def test_a_checkpoint_missing_a_field_of_torchs_optimizer_is_refused_at_the_load_with_nothing_changed():
    (loaded, _), (message, unchanged) = run_workers(_a_checkpoint_missing_a_field, 2)
    assert loaded is None and unchanged, message
    assert "parameter 1 lacks ['exp_avg_sq'], which Adam keeps" in message


def _one_rank_saves_every_rank_loads(rank, world_size, momentum, folder):
    """torch's own reload test: DDP keeps the ranks equal; rank 0 saves, every rank loads."""
    model, optimizer, hook_state = build(PUREDIST, None, momentum)
    for step in range(START_LOCAL_SGD):  # DDP's all-reduce: ranks equal
        train_step(model, optimizer, rank, step)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, f"{folder}/rank0.pt")
    dist.barrier()
    saved = torch.load(f"{folder}/rank0.pt")
    model, optimizer, hook_state = build(PUREDIST, None, momentum)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optim"])  # local: no collective
    try:
        train_step(model, optimizer, rank, START_LOCAL_SGD)
    except RuntimeError as error:
        assert "another rank's" in str(error)
        return "refused"
    return "resumed"


@pytest.mark.parametrize("momentum, expected", [(0.0, "resumed"), (0.9, "refused")])
def test_one_rank_saving_for_all_resumes_where_the_state_holds_nothing_rank_local(momentum, expected, tmp_path):
    # with momentum the state is rank-local in general (it is not checked whether the ranks' happened to agree)
    assert run_workers(_one_rank_saves_every_rank_loads, 2, momentum, str(tmp_path)) == [expected] * 2


def _a_load_on_one_rank(rank, world_size):
    """A load is local, as torch's: rank 0 alone loads while rank 1 does nothing."""
    model, optimizer, _ = build(PUREDIST, None)
    saved = optimizer.state_dict()
    if rank == 0:
        optimizer.load_state_dict(saved)
    return optimizer.averager.step


def test_load_state_dict_is_local():
    assert run_workers(_a_load_on_one_rank, 2, timeout=30, gloo_timeout=10) == [0, 0]


def _step_under_an_lr_scheduler_and_dcp(rank, world_size):
    """DCP's zero-lr initialization step reaches ``step`` through the scheduler's wrapper
    (it runs where the optimizer holds no state: SGD without momentum, at every save)."""
    subgroup, _ = dist.new_subgroups(group_size=2)
    model, optimizer, _ = build(PUREDIST, subgroup, momentum=0.0)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    for step in range(4):
        train_step(model, optimizer, rank, step)
    optimizer.zero_grad(set_to_none=True)  # (DCP initializes only where no parameter has a gradient)
    before, step_before = params_of(model), optimizer.averager.step
    get_optimizer_state_dict(model, optimizer)
    get_optimizer_state_dict(model, optimizer)
    return optimizer.averager.step == step_before and all(torch.equal(a, b) for a, b in zip(before, params_of(model)))


def test_a_checkpoint_through_an_lr_schedulers_wrapper_neither_steps_the_averager_nor_averages():
    assert run_workers(_step_under_an_lr_scheduler_and_dcp, 2) == [True, True]


def _scheduled_and_grown_after_a_load(rank, world_size):
    """After a resume, an lr scheduler and ``add_param_group`` act through the wrapper
    on the local optimizer, as on a plain ``torch.optim.SGD`` put through the same
    calls (the oracle); the group added is averaged."""
    model, optimizer, _ = build(PUREDIST, None)
    plain = torch.optim.SGD(make_model(seed=0).parameters(), lr=0.05, momentum=0.9)
    train_step(model, optimizer, rank, 0)
    optimizer.load_state_dict(optimizer.state_dict())
    plain.load_state_dict(plain.state_dict())
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.1) for o in (optimizer, plain)]
    for scheduler in schedulers:
        scheduler.step()
    extra = torch.nn.Parameter(torch.full((3,), float(rank)))
    optimizer.add_param_group({"params": [extra]})
    optimizer.averager.step = optimizer.averager.warmup_steps  # the next step averages
    extra.grad = torch.zeros(3)
    optimizer.step()
    return [g["lr"] for g in optimizer.optim.param_groups], plain.param_groups[0]["lr"], extra.detach().tolist()


def test_an_lr_scheduler_and_a_group_added_after_a_load_reach_the_local_optimizer():
    # torch's wrapper keeps the param_groups list of its construction, which a load replaces: its schedule froze
    # at the saved lr, and a group added after the load was stepped but never averaged
    for lrs, plain_lr, extra in run_workers(_scheduled_and_grown_after_a_load, 2):
        assert lrs[0] == plain_lr == pytest.approx(0.005) and extra == [0.5] * 3
