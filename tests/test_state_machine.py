"""A classic averager and the pure core stay equal step by step, through checkpoint
round trips, on real Gloo ranks; both against a brute-force oracle (the mean of all
ranks' parameters, gathered, whenever the brute-force schedule says so).

Hypothesis drives the same derandomized program on every rank, so the ranks issue the
same collectives; shrinking is off, since a shrinking rank would desynchronize.
"""

import io

import torch
import torch.distributed as dist
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

import puredist
from puredist import classic
from models import drift_, make_model
from workers import run_workers


def brute_force_group_size(config, step, world_size):
    kind, period, warmup = config
    if kind == "periodic":
        due = step >= warmup and (step - warmup) % period == 0
        return world_size if due else None
    hierarchy = {period: 1, 2 * period: world_size}
    matching = [p for p in hierarchy if step >= warmup and step % p == 0]
    return hierarchy[max(matching)] if matching else None


def gathered_block_mean(tensor, group_size):
    world_size, rank = dist.get_world_size(), dist.get_rank()
    gathered = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(gathered, tensor)
    start = rank - rank % group_size
    return torch.stack(gathered[start : start + group_size]).double().mean(0).to(tensor.dtype)


class ClassicEqualsCore(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.model = make_model(seed=self.rank)
        for p in self.model.parameters():  # torch's filter averages parameters with a .grad
            p.grad = torch.zeros_like(p)
        self.core_params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.drifts = 0

    def build_classic(self):
        kind, period, warmup = self.config
        if kind == "periodic":
            return classic.PeriodicModelAverager(period=period, warmup_steps=warmup)
        return classic.HierarchicalModelAverager({period: 1, 2 * period: self.world_size}, warmup_steps=warmup)

    @initialize(kind=st.sampled_from(["periodic", "hierarchical"]), period=st.integers(2, 4), warmup=st.integers(0, 4))
    def configure(self, kind, period, warmup):
        self.config = (kind, period, warmup)
        self.classic = self.build_classic()
        if kind == "periodic":
            self.core = puredist.periodic_averager(period, warmup)
            self.collective = puredist.DistributedCollective()
        else:
            hierarchy = {period: 1, 2 * period: self.world_size}
            self.core = puredist.hierarchical_averager(hierarchy, warmup)
            self.collective = puredist.DistributedCollective.with_subgroups(list(hierarchy.values()))
        self.state = self.core.init(self.core_params)

    @rule()
    def local_step(self):
        self.drifts += 1
        drift_(self.model.parameters(), self.rank, self.drifts)
        drift_(self.core_params.values(), self.rank, self.drifts)

    @rule()
    def average(self):
        group_size = brute_force_group_size(self.config, self.state.step, self.world_size)
        before = [p.detach().clone() for p in self.model.parameters()]
        expected = [p if group_size is None else gathered_block_mean(p, group_size) for p in before]
        self.classic.average_parameters(self.model.parameters())
        self.state = self.core.update_(self.core_params, self.state, collective=self.collective)
        for ours, core, oracle in zip(self.model.parameters(), self.core_params.values(), expected):
            assert torch.equal(ours.detach(), core)
            torch.testing.assert_close(core, oracle, rtol=1e-6, atol=1e-6)

    @rule()
    def checkpoint_round_trip(self):
        buffer = io.BytesIO()
        torch.save({"classic": self.classic.state_dict(), "core": self.state._asdict()}, buffer)
        buffer.seek(0)
        saved = torch.load(buffer)
        self.classic = self.build_classic()
        self.classic.load_state_dict(saved["classic"])
        self.state = puredist.AveragerState(**saved["core"])

    @invariant()
    def steps_agree(self):
        if hasattr(self, "classic"):
            assert self.classic.step == self.state.step


def _run_machine(rank, world_size):
    run_state_machine_as_test(
        ClassicEqualsCore,
        settings=settings(
            settings(),
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            max_examples=12,
            stateful_step_count=15,
        ),
    )
    return True


def test_classic_and_core_stay_equal_through_checkpoints():
    assert run_workers(_run_machine, 2, timeout=150) == [True, True]
