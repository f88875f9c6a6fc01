"""puredist's classic averagers against torch's own, run side by side on the same
ranks, seeds and drift; the functional API and the simulated backend must agree.

Bitwise where the arithmetic is the same: for fp32/fp64 the whole small model fits
one bucket laid out like torch's flat buffer, and a power-of-two world size makes
torch's divide-then-sum equal to our sum-then-divide. The mixed bf16/fp32 model is
compared within bf16's error bound (torch averages bf16 in fp32 then rounds once; we
sum in bf16, as we must to avoid the fp32 copy): W-1 roundings of partial sums of at
most W*m, m the largest magnitude on any rank, each off by at most 2^-8 of it, then
divided by W, give |ours - exact| <= (W-1) 2^-8 m; torch adds one rounding of the
mean. ``W * 2^-8 * m`` bounds the difference of the two.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
from torch.distributed.algorithms.model_averaging import hierarchical_model_averager as torch_hierarchical

import puredist
from puredist import classic
from models import drift_, make_model
from workers import run_workers

STEPS = 12


def bf16_bounds(params):
    """Per tensor, ``W * 2^-8 * m`` with ``m`` the largest magnitude on any rank."""
    magnitudes = torch.stack([p.detach().abs().max().double() for p in params])
    dist.all_reduce(magnitudes, op=dist.ReduceOp.MAX)
    return (dist.get_world_size() * 2**-8 * magnitudes).tolist()


def assert_same(ours, reference, kind, bounds=None):
    for index, (a, b) in enumerate(zip(ours, reference)):
        if kind == "mixed" and a.dtype == torch.bfloat16:
            torch.testing.assert_close(a, b, rtol=0, atol=bounds[index])
        elif kind == "mixed":  # fp32 tensors: different bucket layout, same values up to order
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def _periodic_side_by_side(rank, world_size, kind, period, warmup, inputs):
    reference_model = make_model(seed=rank, kind=kind)
    models = {name: copy.deepcopy(reference_model) for name in ("classic", "functional", "pure")}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.1) for name, m in models.items()}
    reference_optimizer = torch.optim.SGD(reference_model.parameters(), lr=0.1)

    reference = torch_averagers.PeriodicModelAverager(period=period, warmup_steps=warmup)
    ours = classic.PeriodicModelAverager(period=period, warmup_steps=warmup)
    functional = puredist.periodic_averager(period, warmup)
    collective = puredist.DistributedCollective()
    functional_state = functional.init(None)
    pure_params = {n: p.detach().clone() for n, p in models["pure"].named_parameters()}
    pure_state = functional.init(pure_params)
    pointers = [p.data_ptr() for p in models["classic"].parameters()]

    averaged_steps = 0
    for step in range(STEPS):
        for model in [reference_model, *models.values()]:
            drift_(model.parameters(), rank, step)
        pure_params = {n: p.detach().clone() for n, p in models["pure"].named_parameters()}
        before = [p.detach().clone() for p in reference_model.parameters()]
        bounds = bf16_bounds(before)
        if inputs == "param_groups":
            reference.average_parameters(reference_optimizer.param_groups)
            ours.average_parameters(optimizers["classic"].param_groups)
        else:
            reference.average_parameters(reference_model.parameters())
            ours.average_parameters(models["classic"].parameters())
        functional_state = functional.update_(
            dict(models["functional"].named_parameters()), functional_state, collective=collective
        )
        new_pure, pure_state = functional.update(pure_params, pure_state, collective=collective)
        expected = [p.detach() for p in reference_model.parameters()]
        averaged_steps += any(not torch.equal(a, b) for a, b in zip(before, expected))
        assert_same([p.detach() for p in models["classic"].parameters()], expected, kind, bounds)
        assert_same([p.detach() for p in models["functional"].parameters()], expected, kind, bounds)
        assert_same(list(new_pure.values()), expected, kind, bounds)
        with torch.no_grad():
            for p, q in zip(models["pure"].parameters(), new_pure.values()):
                p.copy_(q)
        assert ours.step == reference.step == functional_state.step == pure_state.step == step + 1
    assert [p.data_ptr() for p in models["classic"].parameters()] == pointers
    return averaged_steps


def expected_averagings(period, warmup):
    return sum(1 for k in range(STEPS) if k >= warmup and (k - warmup) % period == 0)


@pytest.mark.parametrize(
    "world_size, kind, period, warmup, inputs",
    [
        (2, "fp32", 3, 2, "parameters"),
        (2, "fp64", 2, 0, "param_groups"),
        (2, "mixed", 4, 1, "parameters"),
        (4, "fp32", 2, 3, "param_groups"),
        (4, "mixed", 3, 0, "param_groups"),
    ],
)
def test_periodic_matches_torch(world_size, kind, period, warmup, inputs):
    averaged = run_workers(_periodic_side_by_side, world_size, kind, period, warmup, inputs)
    assert averaged == [expected_averagings(period, warmup)] * world_size


def _hierarchical_side_by_side(rank, world_size, hierarchy, warmup):
    reference_model = make_model(seed=rank)
    model = copy.deepcopy(reference_model)
    reference = torch_hierarchical.HierarchicalModelAverager(hierarchy, warmup_steps=warmup)
    ours = classic.HierarchicalModelAverager(hierarchy, warmup_steps=warmup)
    functional = puredist.hierarchical_averager(hierarchy, warmup)
    collective = puredist.DistributedCollective.with_subgroups(list(hierarchy.values()))
    functional_params = [p.detach().clone() for p in model.parameters()]
    state = functional.init(functional_params)
    levels_seen = set()
    for step in range(STEPS):
        for params in (reference_model.parameters(), model.parameters(), functional_params):
            drift_(params, rank, step)
        before = [p.detach().clone() for p in reference_model.parameters()]
        reference.average_parameters(reference_model.parameters())
        ours.average_parameters(model.parameters())
        state = functional.update_(functional_params, state, collective=collective)
        after = [p.detach() for p in reference_model.parameters()]
        if any(not torch.equal(a, b) for a, b in zip(before, after)):
            # which ranks now agree tells which level averaged
            gathered = [torch.empty_like(after[0]) for _ in range(world_size)]
            dist.all_gather(gathered, after[0])
            levels_seen.add(sum(torch.equal(g, after[0]) for g in gathered))
        assert_same([p.detach() for p in model.parameters()], after, "fp32")
        assert_same(functional_params, after, "fp32")
    return sorted(levels_seen)


def test_hierarchical_matches_torch_at_every_level():
    levels = run_workers(_hierarchical_side_by_side, 4, {2: 2, 4: 4}, 1)
    assert levels == [[2, 4]] * 4  # both the pair level and the global level ran


def _outside_group_untouched(rank, world_size):
    group = dist.new_group([0, 1])
    reference_model = make_model(seed=rank)
    model = copy.deepcopy(reference_model)
    reference = torch_averagers.PeriodicModelAverager(period=2, process_group=group)
    ours = classic.PeriodicModelAverager(period=2, process_group=group)
    for step in range(5):  # ends on an averaging step (0, 2, 4)
        drift_(reference_model.parameters(), rank, step)
        drift_(model.parameters(), rank, step)
        before = [p.detach().clone() for p in model.parameters()]
        reference.average_parameters(reference_model.parameters())
        ours.average_parameters(model.parameters())
        if rank >= 2:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert_same([p.detach() for p in model.parameters()], [p.detach() for p in reference_model.parameters()], "fp32")
    return [p.detach() for p in model.parameters()]


def test_a_non_default_group_averages_its_members_only():
    final = run_workers(_outside_group_untouched, 4)
    assert all(torch.equal(a, b) for a, b in zip(final[0], final[1]))  # members agree
    assert not torch.equal(final[2][0], final[0][0]) and not torch.equal(final[2][0], final[3][0])


def _real_equals_simulated(rank, world_size, kind):
    params = [p.detach() for p in make_model(seed=rank, kind=kind).parameters()]
    stacked = []
    for p in params:
        gathered = [torch.empty_like(p) for _ in range(world_size)]
        dist.all_gather(gathered, p)
        stacked.append(torch.stack(gathered))
    puredist.average_(params, collective=puredist.DistributedCollective())
    puredist.average_(stacked, collective=puredist.SimulatedCollective(world_size))
    for real, simulated in zip(params, stacked):
        torch.testing.assert_close(real, simulated[rank], rtol=0, atol=0)
    return True


@pytest.mark.parametrize("kind", ["fp32", "mixed"])
def test_real_and_simulated_backends_agree(kind):
    assert run_workers(_real_equals_simulated, 2, kind) == [True, True]


def _rank_mismatch(rank, world_size):
    model = make_model(seed=rank)
    drift_(model.parameters(), rank, 0)
    if rank == 1:
        model[2].bias.grad = None  # a parameter without .grad on one rank only
    before = [p.detach().clone() for p in model.parameters()]
    averager = classic.PeriodicModelAverager(period=2)
    with pytest.raises(puredist.RankMismatchError) as raised:
        averager.average_parameters(model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing averaged
    return str(raised.value)


def test_a_rank_mismatch_raises_on_every_rank():
    messages = run_workers(_rank_mismatch, 2)
    for message in messages:
        assert "rank 0: 6 tensors, 147 elements" in message
        assert "rank 1: 5 tensors, 144 elements" in message


def _contiguity_mismatch(rank, world_size):
    big = torch.full((512, 512), float(rank))  # 1 MiB: reduced in place when contiguous
    if rank == 1:
        big = big.t().contiguous().t()  # same shape, dtype and device; not contiguous
    small = torch.full((4,), float(rank))
    with pytest.raises(puredist.RankMismatchError):
        puredist.average_([big, small], collective=puredist.DistributedCollective())
    assert torch.equal(big, torch.full((512, 512), float(rank))) and torch.equal(small, torch.full((4,), float(rank)))
    return True


def test_a_contiguity_mismatch_raises_instead_of_desynchronizing_the_buckets():
    assert run_workers(_contiguity_mismatch, 2, timeout=60) == [True, True]


def _bucketed_in_place(rank, world_size, cap, async_op):
    # the last tensor spans many buckets at every cap (at 64 bytes, 2**18 elements would be 33k collectives: 40 s)
    last = 2**18 + 5 if cap >= 1000 else 2**10 + 5
    params = [torch.randn(n, generator=torch.Generator().manual_seed(rank * 7 + n)) for n in (3, 500, 7, 40, 1, 300, last)]
    params.append(torch.randn(20, 20, generator=torch.Generator().manual_seed(rank)).t())  # non-contiguous
    expected = []
    for p in params:
        total = p.clone()
        dist.all_reduce(total)
        expected.append(total / world_size)
    pointers = [p.data_ptr() for p in params]
    collective = puredist.DistributedCollective(bucket_cap_bytes=cap)
    handle = puredist.average_(params, collective=collective, async_op=async_op)
    if async_op:
        handle.wait()
        assert handle.is_completed()
    assert [p.data_ptr() for p in params] == pointers
    for p, e in zip(params, expected):
        torch.testing.assert_close(p, e, rtol=0, atol=0)
    return True


@pytest.mark.parametrize("async_op", [True, False])
@pytest.mark.parametrize("cap", [64, 1000, 2**20])  # 2**20: buckets of 512 KiB, divided into their targets
def test_bucketing_and_async_handle_give_the_exact_mean_in_place(cap, async_op):
    assert run_workers(_bucketed_in_place, 2, cap, async_op) == [True, True]


def _averaging_nothing(rank, world_size):
    outcomes = {}
    for name, cls in (("torch", torch_averagers.PeriodicModelAverager), ("puredist", classic.PeriodicModelAverager)):
        model = make_model(seed=0)  # no parameter has a .grad yet: nothing to average
        before = [p.detach().clone() for p in model.parameters()]
        averager = cls(period=2, warmup_steps=0)
        try:
            averager.average_parameters(model.parameters())
            outcomes[name] = ("counted", averager.step)
        except ValueError as error:
            outcomes[name] = ("raised", str(error))
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    return outcomes


def test_averaging_nothing_counts_the_step_where_torchs_raises():
    # README, "Behaviours that differ from torch on purpose"
    for outcomes in run_workers(_averaging_nothing, 2):
        assert outcomes["torch"][0] == "raised" and "non-empty" in outcomes["torch"][1]
        assert outcomes["puredist"] == ("counted", 1)
