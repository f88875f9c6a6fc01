"""DDP + puredist's ZeRO overlap hooks against DDP + the plain torch optimizer, from
iteration 0, on Gloo; every combination of hook, shard_buckets, static_graph and
gradient_as_bucket_view, for SGD (momentum, weight decay) and Adam."""

import itertools

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.optim.functional_adam import _FunctionalAdam
from torch.nn.parallel import DistributedDataParallel as DDP

from puredist.classic import ZeroRedundancyOptimizer, hook_with_zero_step, hook_with_zero_step_interleaved
from puredist.zero_plan import reverse_order_buckets
from workers import run_workers

HOOKS = {"plain": hook_with_zero_step, "interleaved": hook_with_zero_step_interleaved}
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "adam": (torch.optim.Adam, dict(lr=0.01)),
}
FUNCTIONAL = {"functional adam": (torch.optim.Adam, _FunctionalAdam, dict(lr=0.01))}
"""torch's functional form of an optimizer (what torch's overlap runs, and takes): the reference steps its
torch.optim class."""
ITERATIONS = 10
# float32, same kernels on the same reduced gradients: equal up to the order in which
# Gloo sums; 1e-6 relative is far below one training step's change (checked below).
RTOL, ATOL = 1e-6, 1e-7


def make_net(seed=0):
    torch.manual_seed(seed)
    # ~2.6k parameters over 6 tensors, with 1 KiB buckets: several DDP buckets
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(rank, step, accumulation=0, device="cpu"):
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + accumulation)
    return torch.randn(16, 8, generator=gen).to(device), torch.randn(16, 4, generator=gen).to(device)


def loss_of(model, rank, step, accumulation=0, device="cpu"):
    x, y = batch(rank, step, accumulation, device)
    return nn.functional.mse_loss(model(x), y)


def ddp(module, static_graph, bucket_view):
    return DDP(module, bucket_cap_mb=1024 / 2**20, static_graph=static_graph, gradient_as_bucket_view=bucket_view)


def _parity(rank, world_size, combos, accumulate, device="cpu"):
    for hook_name, shard, static_graph, bucket_view, opt_name in combos:
        if opt_name in OPTIMIZERS:
            (optimizer_class, kwargs), zero_class = OPTIMIZERS[opt_name], OPTIMIZERS[opt_name][0]
        else:
            optimizer_class, zero_class, kwargs = FUNCTIONAL[opt_name]
        reference = ddp(make_net().to(device), static_graph, bucket_view)
        reference_opt = optimizer_class(reference.parameters(), **kwargs)
        model = ddp(make_net().to(device), static_graph, bucket_view)
        zero = ZeroRedundancyOptimizer(model.parameters(), zero_class, overlap_with_ddp=True, **kwargs)
        model.register_comm_hook(None, HOOKS[hook_name](allreduce_hook, model, zero, shard_buckets=shard))
        initial = [p.detach().clone() for p in model.parameters()]
        for step in range(ITERATIONS):
            for net in (reference, model):
                for micro in range(accumulate):
                    with net.no_sync():
                        loss_of(net, rank, step, micro + 1, device).backward()
                loss_of(net, rank, step, device=device).backward()
            reference_opt.step()
            reference_opt.zero_grad()
            zero.zero_grad()
            for ours, theirs in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL, msg=lambda m: f"{hook_name} {shard} {static_graph} {bucket_view} {opt_name} step {step}: {m}")
        moved = min((a - b).abs().max().item() for a, b in zip(model.parameters(), initial))
        assert moved > 100 * ATOL, f"parameters barely moved ({moved})"  # the comparison is not vacuous
        assert zero._iteration == ITERATIONS  # every backward ended one ZeRO iteration
    return [p.detach().cpu() for p in model.parameters()]


ALL_COMBOS = list(itertools.product(HOOKS, [False, True], [False, True], [False, True], OPTIMIZERS))


def test_every_combination_matches_ddp_with_the_plain_optimizer_at_two_ranks():
    final = run_workers(_parity, 2, ALL_COMBOS, 0, timeout=240)
    assert all(torch.equal(a, b) for a, b in zip(final[0], final[1]))  # same on all ranks


def test_torchs_functional_optimizer_is_taken_with_the_overlap_and_steps_as_its_torch_optim_class():
    run_workers(_parity, 2, [("plain", False, False, False, "functional adam")], 0, timeout=120)


def _functional_without_the_overlap(rank, world_size):
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    refusals = []
    for cls in (ZeroRedundancyOptimizer, TorchZero):
        with pytest.raises(ValueError) as error:
            cls(make_net().parameters(), _FunctionalAdam, lr=0.01)
        refusals.append(str(error.value))
    return refusals


def _functional_defaults(rank, world_size):
    from torch.distributed.optim.functional_adagrad import _FunctionalAdagrad
    from torch.distributed.optim.functional_sgd import _FunctionalSGD

    zero = ZeroRedundancyOptimizer(make_net().parameters(), _FunctionalSGD, overlap_with_ddp=True, momentum=0.9)
    settings = {k: zero.optim.defaults[k] for k in ("lr", "momentum", "foreach", "fused")}
    with pytest.raises(ValueError, match="warmup_num_iters"):
        ZeroRedundancyOptimizer(make_net().parameters(), _FunctionalAdagrad, overlap_with_ddp=True, warmup_num_iters=5)
    return type(zero.optim), settings


def test_torchs_functional_optimizer_steps_with_its_own_defaults_and_refuses_arguments_its_class_lacks():
    # torch's overlap builds _FunctionalSGD(params, **kwargs): lr 0.01 (torch.optim.SGD's is 0.001), one
    # tensor at a time; Adagrad's functional warm-up arguments have no counterpart in torch.optim.Adagrad
    cls, settings = run_workers(_functional_defaults, 1)[0]
    assert cls is torch.optim.SGD and settings == {"lr": 0.01, "momentum": 0.9, "foreach": False, "fused": False}


def test_torchs_functional_optimizer_is_refused_without_the_overlap_as_by_torch():
    ours, torchs = run_workers(_functional_without_the_overlap, 1)[0]
    assert ours == torchs and "functional optimizer" in torchs


@pytest.mark.parametrize("hook_name", list(HOOKS))
def test_four_ranks_with_gradient_accumulation(hook_name):
    # (DDP itself refuses no_sync() before the first synced backward with static_graph=True)
    combos = [(hook_name, True, False, True, "adam"), (hook_name, False, False, False, "sgd")]
    final = run_workers(_parity, 4, combos, 2, timeout=120)
    assert all(torch.equal(a, b) for r in range(1, 4) for a, b in zip(final[0], final[r]))


def _settled_buckets(rank, world_size):
    model = ddp(make_net(), False, False)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.01)
    params = list(model.parameters())
    index_of = {id(p): i for i, p in enumerate(params)}
    seen = []

    def recording_hook(state, bucket):
        seen[-1].append(sorted(index_of[id(p)] for p in bucket.parameters()))
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook_with_zero_step(recording_hook, model, zero, shard_buckets=False))
    for step in range(3):
        seen.append([])
        loss_of(model, rank, step).backward()
        zero.zero_grad()
    predicted = reverse_order_buckets([p.numel() * 4 for p in params], model.bucket_bytes_cap, model.bucket_bytes_cap)
    return seen, [sorted(b) for b in predicted], zero.plan.owners


def test_whole_buckets_are_owned_by_one_rank_once_ddp_settles_its_buckets():
    seen, predicted, owners = run_workers(_settled_buckets, 2)[0]
    assert len(seen[0]) == 1  # DDP's first iteration: one bucket for everything
    assert seen[1] == seen[2] == predicted and len(predicted) > 1  # then the predicted layout
    assert all(len({owners[i] for i in bucket}) == 1 for bucket in seen[2])
    assert len(set(owners)) == 2  # and both ranks own some


def _frozen_parameter(rank, world_size):
    outcomes = []
    for hook_name, shard in itertools.product(HOOKS, [False, True]):
        nets = [make_net(), make_net()]
        for net in nets:
            net[0].weight.requires_grad_(False)  # frozen: outside DDP's buckets, but in model.parameters()
        reference, model = (ddp(net, False, False) for net in nets)
        reference_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.05, momentum=0.9)
        model.register_comm_hook(None, HOOKS[hook_name](allreduce_hook, model, zero, shard_buckets=shard))
        frozen = model.module[0].weight.detach().clone()
        for step in range(ITERATIONS):
            for net in (reference, model):
                loss_of(net, rank, step).backward()
            reference_opt.step()
            reference_opt.zero_grad()
            zero.zero_grad()
        outcomes.append(torch.equal(model.module[0].weight, frozen) and all(
            torch.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in zip(model.parameters(), reference.parameters())))
    # still refused: a trainable parameter of DDP's left out, or one that DDP does not hold
    model = ddp(make_net(), False, False)
    extra = nn.Parameter(torch.ones(3))
    for params in (list(model.parameters())[1:], [*model.parameters(), extra]):
        zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, overlap_with_ddp=True, lr=0.05)
        with pytest.raises(ValueError, match="must optimize the parameters of ``ddp`` that require grad"):
            hook_with_zero_step(allreduce_hook, model, zero)
    return outcomes


def test_a_frozen_parameter_given_to_zero_is_left_alone_as_in_torch():
    # ZeroRedundancyOptimizer(model.parameters(), ...): torch's overlap skips the parameters that need no grad
    assert run_workers(_frozen_parameter, 2, timeout=120) == [[True] * 4] * 2


class _SomeRanksOnly(nn.Module):
    """``b`` is used on rank 1 only, at every iteration (a static graph per rank)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, rank):
        return self.a(x) + self.b(x) if rank == 1 else self.a(x)


def _used_on_some_ranks_only(rank, world_size):
    gaps = {}
    for (hook_name, hook), bucket_view in itertools.product(HOOKS.items(), [False, True]):
        nets = [DDP(_SomeRanksOnly(), static_graph=True, gradient_as_bucket_view=bucket_view, bucket_cap_mb=1e-4)
                for _ in range(2)]
        reference, model = nets
        reference_opt = torch.optim.Adam(reference.parameters(), lr=0.1)
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=0.1)
        model.register_comm_hook(None, hook(allreduce_hook, model, zero))
        for step in range(4):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + step))
            reference(x, rank).sum().backward()
            reference_opt.step()
            reference_opt.zero_grad()
            model(x, rank).sum().backward()
            zero.zero_grad()
        gaps[(hook_name, bucket_view)] = max((p - q).abs().max().item()
                                             for p, q in zip(model.parameters(), reference.parameters()))
    return gaps


def test_a_parameter_used_on_some_ranks_only_is_stepped_as_by_ddp_with_the_plain_optimizer():
    # with static_graph DDP gives a locally unused parameter its averaged gradient after the hooks ran
    for gaps in run_workers(_used_on_some_ranks_only, 2, timeout=120):
        assert all(gap <= 1e-6 for gap in gaps.values()), gaps


def _ignored_by_ddp(rank, world_size):
    def ignoring():
        net = make_net()
        DDP._set_params_and_buffers_to_ignore_for_model(net, ["0.bias"])
        model = ddp(net, False, False)
        return model, [p for name, p in model.module.named_parameters() if name != "0.bias"]

    model, rest = ignoring()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.05)
    with pytest.raises(ValueError, match=r"parameters DDP ignores \(0\.bias\)"):
        hook_with_zero_step(allreduce_hook, model, zero)
    # without it, the rest trains as DDP with the plain optimizer over the same parameters
    zero = ZeroRedundancyOptimizer(rest, torch.optim.SGD, overlap_with_ddp=True, lr=0.05)
    model.register_comm_hook(None, hook_with_zero_step(allreduce_hook, model, zero))
    reference, reference_rest = ignoring()
    reference_opt = torch.optim.SGD(reference_rest, lr=0.05)
    for step in range(3):
        loss_of(model, rank, step).backward()
        loss_of(reference, rank, step).backward()
        reference_opt.step()
        reference_opt.zero_grad()
        zero.zero_grad()
    return all(torch.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in zip(rest, reference_rest))


def test_parameters_ddp_ignores_are_refused_by_the_hooks():
    assert run_workers(_ignored_by_ddp, 2) == [True, True]


def _hook_registered_again_after_training(rank, world_size):
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)  # one parameter: rank 1 owns nothing
    first = DDP(model)
    zero = ZeroRedundancyOptimizer(first.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    first.register_comm_hook(None, hook_with_zero_step(allreduce_hook, first, zero))
    for _ in range(2):
        first(torch.randn(2, 4)).sum().backward()
    assert zero.plan.owned_by(rank) == ((0,) if rank == 0 else ())
    with pytest.raises(RuntimeError, match="plan can only change before the first step"):  # on every rank
        hook_with_zero_step(allreduce_hook, DDP(model), zero)
    return True


def test_a_trained_zero_refuses_a_new_plan_on_every_rank_also_one_owning_nothing():
    assert run_workers(_hook_registered_again_after_training, 2, timeout=60, gloo_timeout=20) == [True, True]


def _local_steps_per_iteration(rank, world_size):
    counts = {}
    for hook_name in HOOKS:
        torch.manual_seed(0)
        model = ddp(nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)]), False, False)  # a bucket per layer
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=0.01)
        model.register_comm_hook(None, HOOKS[hook_name](allreduce_hook, model, zero))
        calls = []
        step = zero.optim.step
        zero.optim.step = lambda *args, **kwargs: calls.append(1) or step(*args, **kwargs)
        for iteration in range(3):
            calls.clear()
            model(torch.randn(4, 16)).sum().backward()
            zero.zero_grad()
        counts[hook_name] = len(calls)
    return counts


def test_the_plain_hook_calls_the_local_optimizer_once_per_iteration():
    # each call of a torch optimizer has a fixed host cost: the plain hook, which steps at the end of the
    # backward, steps every bucket in one call (it called it once per DDP bucket this rank owns)
    for counts in run_workers(_local_steps_per_iteration, 2):
        assert counts["plain"] == 1 and counts["interleaved"] > 2, counts  # (interleaved: per bucket, in backward)
