"""ZeroRedundancyOptimizer with any torch optimizer, `.optim`, step arguments and Join,
on Gloo: against the plain optimizer and torch's own ZeroRedundancyOptimizer."""

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

from puredist.classic import ZeroRedundancyOptimizer, hook_with_zero_step, hook_with_zero_step_interleaved
from puredist.classic.zero_redundancy_optimizer import OVERLAP_OPTIMIZERS
from test_zero_overlap import ddp, loss_of, make_net
from workers import run_workers

STEPS = 4


class SGDWithExtras(torch.optim.SGD):
    """A user's subclass: an extra param-group key, and a step keyword."""

    def __init__(self, params, lr, trust=1.0, **kwargs):
        super().__init__(params, lr=lr, **kwargs)
        for group in self.param_groups:
            group.setdefault("trust", trust)

    def step(self, closure=None, scale=1.0):
        configured = [group["lr"] for group in self.param_groups]
        for group in self.param_groups:
            group["lr_seen"] = group["lr"] = group["lr"] * scale * group["trust"]
        super().step(closure)
        for group, lr in zip(self.param_groups, configured):
            group["lr"] = lr


NOT_OVERLAPPED = {
    "adagrad": (torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=0.01, momentum=0.9, centered=True)),
    "rprop": (torch.optim.Rprop, dict(lr=0.01)),
    "adamax": (torch.optim.Adamax, dict(lr=0.01, weight_decay=0.1)),
    "adadelta": (torch.optim.Adadelta, dict(lr=0.5)),
    "nadam": (torch.optim.NAdam, dict(lr=0.01)),
    "radam": (torch.optim.RAdam, dict(lr=0.01, decoupled_weight_decay=True, weight_decay=0.1)),
    "asgd": (torch.optim.ASGD, dict(lr=0.01)),
    "subclass": (SGDWithExtras, dict(lr=0.05, momentum=0.9, trust=0.5)),
}


def two_groups(model):
    params = list(model.parameters())
    return [{"params": params[:2]}, {"params": params[2:], "lr": 0.003}]


def _any_optimizer(rank, world_size, names):
    report = {}
    for name in names:
        optimizer_class, kwargs = NOT_OVERLAPPED[name]
        models = [DDP(make_net()) for _ in range(3)]
        plain = optimizer_class(two_groups(models[0]), **kwargs)
        theirs = TorchZero(two_groups(models[1]), optimizer_class, **kwargs)
        ours = ZeroRedundancyOptimizer(two_groups(models[2]), optimizer_class, **kwargs)
        step_kwargs = {"scale": 2.0} if name == "subclass" else {}
        for step in range(STEPS):
            for model, optimizer in zip(models, (plain, theirs, ours)):
                optimizer.zero_grad()
                loss_of(model, rank, step).backward()
                optimizer.step(**step_kwargs)
            for a, b, c in zip(*(m.parameters() for m in models)):
                assert torch.equal(c, a), f"{name} step {step}: differs from the plain optimizer"
                assert torch.equal(c, b), f"{name} step {step}: differs from torch's ZeRO"
        # `.optim` is the local optimizer over the owned parameters, in torch's layout
        assert type(ours.optim) is optimizer_class and len(ours.optim.param_groups) == 2
        owned = {id(p) for g in ours.optim.param_groups for p in g["params"]}
        assert owned == {id(p) for i, p in enumerate(models[2].parameters()) if ours.plan.owners[i] == rank}
        assert {id(p) for p in ours.optim.state} == owned
        # settings the local step changed come back to the exposed groups
        if name == "subclass":
            assert ours.param_groups[1]["lr_seen"] == pytest.approx(0.003 * 2.0 * 0.5)
        # the consolidated checkpoint is the plain optimizer's, state for state
        ours.consolidate_state_dict(to=0)
        if rank == 0:
            saved, expected = ours.state_dict(), plain.state_dict()
            assert saved["param_groups"] == expected["param_groups"]
            assert saved["state"].keys() == expected["state"].keys()
            for index, entry in expected["state"].items():
                assert saved["state"][index].keys() == entry.keys()
                for key, value in entry.items():
                    assert torch.equal(torch.as_tensor(saved["state"][index][key]), torch.as_tensor(value)), (name, key)
        report[name] = len(ours.optim.state)
    return report


@pytest.mark.parametrize("names", [["adagrad", "rmsprop", "rprop", "adamax", "adadelta"], ["nadam", "radam", "asgd", "subclass"]])
def test_any_torch_optimizer_matches_the_plain_one_and_torchs_zero_bit_for_bit(names):
    reports = run_workers(_any_optimizer, 2, names, timeout=180)
    for name in names:  # every parameter's state lives on exactly one rank
        assert sum(report[name] for report in reports) == len(list(make_net().parameters()))


def _overlap_every_optimizer(rank, world_size, dtype):
    kwargs = {
        torch.optim.SGD: dict(lr=0.05, momentum=0.9, weight_decay=0.01),
        torch.optim.Adam: dict(lr=0.01, amsgrad=True),
        torch.optim.AdamW: dict(lr=0.01),
        torch.optim.Adagrad: dict(lr=0.05),
        torch.optim.Adadelta: dict(lr=0.5),
        torch.optim.RMSprop: dict(lr=0.01, momentum=0.5),
        torch.optim.Rprop: dict(lr=0.01),
        torch.optim.Adamax: dict(lr=0.01),
    }
    assert set(kwargs) == set(OVERLAP_OPTIMIZERS)
    for index, (optimizer_class, options) in enumerate(kwargs.items()):
        hook = (hook_with_zero_step, hook_with_zero_step_interleaved)[index % 2]
        reference = ddp(make_net().to(dtype), False, False)
        reference_opt = optimizer_class(reference.parameters(), **options)
        model = ddp(make_net().to(dtype), False, False)
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class, overlap_with_ddp=True, **options)
        model.register_comm_hook(None, hook(allreduce_hook, model, zero, shard_buckets=bool(index % 3)))
        for step in range(STEPS):
            for net in (reference, model):
                x, y = (t.to(dtype) for t in _batch(rank, step))
                nn.functional.mse_loss(net(x), y).backward()
            reference_opt.step()
            reference_opt.zero_grad()
            zero.zero_grad()
            for ours, theirs in zip(model.parameters(), reference.parameters()):
                assert torch.equal(ours, theirs), f"{optimizer_class.__name__} {dtype} step {step}"
    return True


def _batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_overlap_supports_torchs_list_bitwise_equal_to_torch_optim(dtype):
    assert run_workers(_overlap_every_optimizer, 2, dtype, timeout=180) == [True, True]


def _join_uneven_inputs(rank, world_size):
    """Rank r has 2 + r batches; both ZeROs in a Join with their DDP model."""
    finals = []
    for zero_class in (TorchZero, ZeroRedundancyOptimizer):
        model = DDP(make_net())
        zero = zero_class(model.parameters(), torch.optim.Adam, lr=0.01)
        with Join([model, zero]):
            for step in range(2 + rank):
                zero.zero_grad()
                loss_of(model, rank, step).backward()
                zero.step()
        finals.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals)), "puredist's Join differs from torch's"
    return finals[1]


def test_join_trains_uneven_inputs_like_torchs_zero():
    finals = run_workers(_join_uneven_inputs, 3, timeout=120)
    assert all(torch.equal(a, b) for r in (1, 2) for a, b in zip(finals[0], finals[r]))  # ranks agree
    assert not all(torch.equal(a, b) for a, b in zip(finals[0], make_net().parameters()))  # it trained


def _step_arguments(rank, world_size):
    model = DDP(make_net())
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    loss_of(model, rank, 0).backward()
    with pytest.raises(TypeError, match="scale"):
        zero.step(scale=2.0)  # SGD.step takes no `scale`: a typo is not dropped silently
    before = [p.detach().clone() for p in model.parameters()]

    def closure():
        zero.zero_grad()
        loss = loss_of(model, rank, 1)
        loss.backward()
        return loss

    loss = zero.step(closure)
    assert loss is not None and loss.requires_grad
    return all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_step_passes_closure_and_keywords_to_the_local_optimizer():
    assert run_workers(_step_arguments, 2) == [True, True]


def _adagrad_checkpoint(rank, world_size):
    """A consolidated Adagrad checkpoint loads into a fresh ZeRO (before its first
    step) and into the plain optimizer, and both continue the same trajectory. Both
    load the same dict: ZeRO must copy it (the plain optimizer keeps its tensors, so
    a shared tensor would be stepped twice)."""
    kwargs = dict(lr=0.05, initial_accumulator_value=0.1)
    first_model, plain_model = DDP(make_net()), DDP(make_net())
    first = ZeroRedundancyOptimizer(first_model.parameters(), torch.optim.Adagrad, **kwargs)
    for step in range(3):
        first.zero_grad()
        loss_of(first_model, rank, step).backward()
        first.step()
    first.consolidate_state_dict(to=0)
    blob = [None]
    if rank == 0:
        buffer = io.BytesIO()
        torch.save({"model": first_model.state_dict(), "optim": first.state_dict()}, buffer)
        blob = [buffer.getvalue()]
    dist.broadcast_object_list(blob, src=0)
    checkpoint = torch.load(io.BytesIO(blob[0]))
    resumed_model = DDP(make_net())
    resumed_model.load_state_dict(checkpoint["model"])
    resumed = ZeroRedundancyOptimizer(resumed_model.parameters(), torch.optim.Adagrad, lr=1.0)
    resumed.load_state_dict(checkpoint["optim"])
    assert resumed.param_groups[0]["lr"] == 0.05
    plain_model.load_state_dict(checkpoint["model"])
    plain = torch.optim.Adagrad(plain_model.parameters(), lr=1.0)
    plain.load_state_dict(checkpoint["optim"])
    for step in range(3, 6):
        for model, optimizer in ((resumed_model, resumed), (plain_model, plain), (first_model, first)):
            optimizer.zero_grad()
            loss_of(model, rank, step).backward()
            optimizer.step()
    for a, b, c in zip(resumed_model.parameters(), plain_model.parameters(), first_model.parameters()):
        assert torch.equal(a, c), f"ZeRO resumed: {(a - c).abs().max()}"
        assert torch.equal(b, c), f"plain resumed: {(b - c).abs().max()}"
    return True


def test_a_consolidated_adagrad_checkpoint_resumes_in_zero_and_in_the_plain_optimizer():
    assert run_workers(_adagrad_checkpoint, 2) == [True, True]


class _Awkward(nn.Module):
    """A transposed (non-contiguous) weight, and a layer the forward never uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.transposed = nn.Parameter(torch.randn(4, 8).t())
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(8, 4)

    def forward(self, x):
        return self.used(x @ self.transposed)


def _awkward_parameters(rank, world_size):
    """Overlap with a non-contiguous parameter (its bucket slot is in its own
    strides) and, with static_graph, an unused one (no .grad: not stepped)."""
    for hook in (hook_with_zero_step, hook_with_zero_step_interleaved):
        for bucket_view in (False, True):
            options = dict(static_graph=True, gradient_as_bucket_view=bucket_view)
            reference = DDP(_Awkward(), **options)
            reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
            model = DDP(_Awkward(), **options)
            zero = ZeroRedundancyOptimizer(
                model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1, momentum=0.9, weight_decay=0.1)
            model.register_comm_hook(None, hook(allreduce_hook, model, zero))
            for step in range(3):
                x, y = _batch(rank, step)
                for net in (reference, model):
                    nn.functional.mse_loss(net(x), y[:, :4]).backward()
                reference_opt.step()
                reference_opt.zero_grad()
                zero.zero_grad()
            for (name, ours), theirs in zip(model.module.named_parameters(), reference.parameters()):
                assert torch.equal(ours, theirs), f"{hook.__name__} bucket_view={bucket_view}: {name}"
            assert torch.equal(model.module.unused.weight, _Awkward().unused.weight)  # never stepped
    return True


def test_overlap_steps_non_contiguous_and_unused_parameters_as_ddp_with_the_plain_optimizer():
    assert run_workers(_awkward_parameters, 2, timeout=120) == [True, True]


def _join_edge_cases(rank, world_size):
    # the optimizer alone in a Join (torch's hangs: its joined rank notifies again)
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    zero = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    with Join([zero]):
        for step in range(1 + 2 * rank):
            for p in net.parameters():
                p.grad = torch.full_like(p, float(step + 1))
            zero.step()
    # the overlap cannot shadow DDP's join hook: refused when the Join is built
    model = DDP(make_net())
    overlapped = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    model.register_comm_hook(None, hook_with_zero_step(allreduce_hook, model, overlapped))
    with pytest.raises(ValueError, match="Join is not supported with `overlap_with_ddp=True`"):
        Join([model, overlapped])
    return [p.detach().clone() for p in net.parameters()]


def test_join_with_the_optimizer_alone_and_a_clear_refusal_with_the_overlap():
    finals = run_workers(_join_edge_cases, 2, timeout=60, gloo_timeout=20)
    assert all(torch.equal(a, b) for a, b in zip(*finals))


def test_load_state_dict_shares_nothing_with_its_argument():
    from workers import run_workers as run

    def check(rank, world_size):
        net = nn.Linear(4, 3)
        zero = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
        saved = torch.optim.SGD(nn.Linear(4, 3).parameters(), lr=torch.tensor(0.01), momentum=0.9).state_dict()
        zero.load_state_dict(saved)
        zero.param_groups[0]["lr"].fill_(0.5)  # e.g. a scheduler working on a tensor lr
        return float(saved["param_groups"][0]["lr"])

    assert run(check, 2) == [pytest.approx(0.01), pytest.approx(0.01)]


def _broadcasts_written_back_at_wait(rank, world_size):
    """Gloo broadcasts a CUDA tensor through a host copy and copies the result back into
    every input, the source's too, when the caller waits, in the caller's grad mode.
    Emulated here on CPU tensors: each broadcast's ``wait`` writes its buffer in place."""
    original = dist.broadcast

    class WrittenBackAtWait:
        def __init__(self, work, tensor):
            self._work, self._tensor = work, tensor

        def wait(self, *args):
            done = self._work.wait(*args)
            self._tensor.copy_(self._tensor.detach().clone())
            return done

    def broadcast(tensor, *args, **kwargs):
        work = original(tensor, *args, **kwargs)
        return WrittenBackAtWait(work, tensor) if kwargs.get("async_op") else work

    dist.broadcast = broadcast
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    plain = torch.optim.Adam(reference, lr=0.01)
    for step in range(STEPS):
        for p, r in zip(model.parameters(), reference):
            p.grad = torch.full_like(p, 0.1 * (step + 1))
            r.grad = p.grad.clone()
        zero.step()
        plain.step()
    for p, r in zip(model.parameters(), reference):
        assert torch.equal(p, r)


def test_zero_steps_parameters_that_a_backend_writes_back_into_at_wait():
    run_workers(_broadcasts_written_back_at_wait, 2)
