"""The extension point: an optimizer that is not elementwise (LARS-like, a per-tensor
trust ratio), defined in this file through the public API alone, runs under ZeRO,
DiLoCo (flat fragments refused for it: its norms stay per tensor), ``vmap`` over
stacked replicas and a checkpoint round trip, each against a hand-written per-tensor
loop. Its state type's declaration (:func:`puredist.optim.param_state`) is all the
library reads of it."""

from typing import NamedTuple

import pytest
import torch
from torch.func import vmap

import puredist
from puredist.optim import Count, Shaped, make_optimizer, param_state, state_axes
from workers import run_workers

MU, ETA = 0.9, 0.5


def lr_at(count: int) -> float:
    return 0.3 / (1 + count)


@param_state(elementwise=False)
class LarsState(NamedTuple):
    """LARS state of one parameter.

    Attributes:
        momentum: the momentum of the trust-scaled gradient.
        updates: the updates taken (the learning rate is a schedule of it).
    """

    momentum: Shaped
    updates: Count  # any name: the schedule, vmap's axes and the checkpoint read the declaration


def trust_scaled(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` times ``ETA * |param| / |grad|`` (1 where a norm is 0): one ratio per tensor."""
    p_norm, g_norm = param.norm(), grad.norm()
    ratio = torch.where((p_norm > 0) & (g_norm > 0), ETA * p_norm / g_norm.clamp_min(1e-30), torch.ones_like(p_norm))
    return grad * ratio


def lars(state_type=LarsState) -> puredist.Optimizer:
    def init_leaf(param):
        fields = {"momentum": torch.zeros_like(param), "updates": torch.zeros((), dtype=torch.float32)}
        return state_type(**{name: fields[name] for name in state_type._fields})

    def run(params, grads, states, traced, lr):
        for param, grad, state in zip(params, grads, states):
            state.momentum.mul_(MU).add_(trust_scaled(param, grad))
            param.sub_(state.momentum * lr)
            if "updates" in state._fields:
                state.updates.add_(1)
        return list(states)

    return make_optimizer(state_type, init_leaf, run, hypers={"lr": lr_at if state_type is LarsState else 0.1},
                          kind="lars")


def oracle_step(param, grad, momentum, count, lr=None):
    """The hand-written step of one tensor, out of place: ``(param, momentum)``."""
    ratio = ETA * param.norm() / grad.norm() if param.norm() > 0 and grad.norm() > 0 else 1.0
    momentum = MU * momentum + ratio * grad
    return param - (lr_at(count) if lr is None else lr) * momentum, momentum


def tensors(seed, shapes=((3, 4), (5,), (2, 2))):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for shape in shapes]


def test_the_declaration_says_per_tensor_and_the_steps_follow_the_per_tensor_loop():
    optimizer = lars()
    assert not optimizer.elementwise and optimizer.config == "lars(lr='<schedule>')"
    params = tensors(0)
    state = optimizer.init(params)
    expected, moments = [p.clone() for p in params], [torch.zeros_like(p) for p in params]
    for step in range(3):
        grads = tensors(10 + step)
        new_params, new_state = optimizer.update(params, grads, state)  # pure
        state = optimizer.update_(params, grads, state)  # in place: the same values
        for k, grad in enumerate(grads):
            expected[k], moments[k] = oracle_step(expected[k], grad, moments[k], step)
        for ours, pure, theirs in zip(params, new_params, expected):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(pure, ours, rtol=0, atol=0)
    assert [s.updates.item() for s in state] == [3.0] * 3


def test_under_zero_each_owner_steps_its_whole_tensors_as_the_loop_does():
    replicas, owners = 3, (2, 0, 1)
    optimizer = lars()
    sharded = puredist.zero(optimizer)
    params = [torch.stack([p] * replicas) for p in tensors(1)]
    state = sharded.init(params, plan=puredist.ZeroPlan(replicas, owners), rank=None)
    expected, moments = [p[0].clone() for p in params], [torch.zeros_like(p[0]) for p in params]
    for step in range(3):
        grads = [torch.stack([g * (r + 1) for r in range(replicas)]) for g in tensors(20 + step)]  # the owner's counts
        state = sharded.update_(params, grads, state, collective=puredist.SimulatedCollective(replicas))
        for k, owner in enumerate(owners):
            expected[k], moments[k] = oracle_step(expected[k], grads[k][owner], moments[k], step)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p, e.expand_as(p), rtol=1e-6, atol=1e-6)


def test_vmap_over_stacked_replicas_steps_each_replica_as_the_loop_does():
    replicas, optimizer = 3, lars()
    params = [torch.stack([p * (r + 1) for r in range(replicas)]) for p in tensors(2)]
    one = optimizer.init([p[0] for p in params])
    state = [s._replace(momentum=torch.stack([s.momentum] * replicas)) for s in one]  # one count for every replica
    axes = state_axes(state)
    assert [a.updates for a in axes] == [None] * 3 and [a.momentum for a in axes] == [0] * 3
    mapped = vmap(optimizer.update, in_dims=(0, 0, axes), out_dims=(0, axes))
    expected = [[p[r].clone() for p in params] for r in range(replicas)]
    moments = [[torch.zeros_like(p[0]) for p in params] for _ in range(replicas)]
    for step in range(3):
        grads = [torch.stack([g * (r - 1) for r in range(replicas)]) for g in tensors(30 + step)]  # a zero row too
        params, state = mapped(params, grads, state)
        for r in range(replicas):
            for k, grad in enumerate(grads):
                expected[r][k], moments[r][k] = oracle_step(expected[r][k], grad[r], moments[r][k], step)
    for k, p in enumerate(params):
        torch.testing.assert_close(p, torch.stack([expected[r][k] for r in range(replicas)]), rtol=1e-6, atol=1e-6)


class LarsClaimedElementwise(NamedTuple):  # the same step, its state (wrongly) declared elementwise below
    momentum: Shaped


param_state(elementwise=True)(LarsClaimedElementwise)
SYNC_EVERY, STEPS = 2, 8


def drift(rank: int, step: int, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(*shape, generator=gen) * (rank + 1)


def _diloco(rank, world_size, claimed_elementwise):
    from puredist.outer.storage.flat_layout import flat_base

    optimizer = lars(LarsClaimedElementwise) if claimed_elementwise else lars()
    transform = puredist.outer_optimizer(optimizer, sync_every=SYNC_EVERY)
    params = tensors(3)
    state = transform.init(params)
    collective = puredist.DistributedCollective()
    resumed = None
    for step in range(STEPS):
        for p in params:
            p.add_(drift(rank, step, p.shape))
        state = transform.update_(params, state, collective=collective)
        if step == STEPS // 2:  # a checkpoint round trip: saved, loaded into a fresh state, stepped alongside
            saved = transform.state_dict(state, rank=rank)
            resumed_params = [p.clone() for p in params]
            resumed = transform.load_state_dict(transform.init(resumed_params), saved, rank=rank)
        elif resumed is not None:
            for p in resumed_params:
                p.add_(drift(rank, step, p.shape))
            resumed = transform.update_(resumed_params, resumed, collective=collective)
    return params, resumed_params, flat_base(state.global_params) is not None


def diloco_oracle(world_size: int, elementwise_lr: float | None = None):
    """DiLoCo (Algorithm 1) by hand on every rank at once: after every ``SYNC_EVERY``
    inner steps, the global copy (the initial parameters at first) takes one step per
    tensor with the pseudo-gradient ``global - mean`` of the ranks' parameters, and
    every rank takes the global copy."""
    start = tensors(3)
    globals_, moments = [p.clone() for p in start], [torch.zeros_like(p) for p in start]
    local = [[p.clone() for p in start] for _ in range(world_size)]
    syncs = 0
    for step in range(STEPS):
        for rank in range(world_size):
            local[rank] = [p + drift(rank, step, p.shape) for p in local[rank]]
        if (step + 1) % SYNC_EVERY:
            continue
        means = [sum(local[r][k] for r in range(world_size)) / world_size for k in range(len(start))]
        for k, mean in enumerate(means):
            globals_[k], moments[k] = oracle_step(globals_[k], globals_[k] - mean, moments[k], syncs, elementwise_lr)
        syncs += 1
        local = [[g.clone() for g in globals_] for _ in range(world_size)]
    return local


def test_diloco_keeps_its_norms_per_tensor_and_a_checkpoint_resumes_it():
    results = run_workers(_diloco, 2, False)
    expected = diloco_oracle(2)
    for rank, (params, resumed, laid_flat) in enumerate(results):
        assert not laid_flat  # declared per tensor: the flat fragment path is not taken
        for ours, again, theirs in zip(params, resumed, expected[rank]):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(again, ours, rtol=0, atol=0)  # the round trip changed nothing


def test_the_declaration_is_what_decides_a_state_declared_elementwise_is_laid_flat():
    # the same per-tensor step under a declaration that claims elementwise: the fragment is laid flat and
    # its norms are taken over the whole fragment, so it leaves the per-tensor oracle (the check above can fail)
    results = run_workers(_diloco, 2, True)
    expected = diloco_oracle(2, elementwise_lr=0.1)
    params, _, laid_flat = results[0]
    assert laid_flat
    assert any(not torch.allclose(ours, theirs, rtol=1e-3, atol=1e-3) for ours, theirs in zip(params, expected[0]))


@param_state(elementwise=False)
class NormalizedState(NamedTuple):
    """Normalized SGD keeps no state: each step is ``lr * grad / |grad|``, per tensor."""


def normalized_sgd(lr: float = 0.5) -> puredist.Optimizer:
    def run(params, grads, states, traced, lr):
        for param, grad in zip(params, grads):
            param.sub_(grad * (lr / grad.norm().clamp_min(1e-30)))
        return list(states)

    return make_optimizer(NormalizedState, lambda param: NormalizedState(), run, hypers={"lr": lr}, kind="nsgd")


class HandCount(NamedTuple):  # a state declaring nothing: the library assumes nothing of it
    count: torch.Tensor


def normalized_sgd_by_hand(lr: float = 0.5, pure: bool = True) -> puredist.Optimizer:
    """The same step, an optimizer built by hand (no declaration; ``pure=False``: no ``update``)."""
    def update(params, grads, states):
        return [p - lr * g / g.norm() for p, g in zip(params, grads)], [HandCount(s.count + 1) for s in states]

    def update_(params, grads, states):
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(lr * g / g.norm())
        return [HandCount(s.count + 1) for s in states]

    return puredist.Optimizer(lambda params: [HandCount(torch.zeros(())) for _ in params], update if pure else None,
                              update_)


@pytest.mark.parametrize("make", [normalized_sgd, normalized_sgd_by_hand], ids=["declared", "built by hand"])
def test_on_simulated_ranks_diloco_steps_each_replicas_global_copy_per_tensor(make):
    # the stacked [R, ...] global copy is stepped replica by replica: a norm over the stack would be taken across
    # the replicas (each step sqrt(R) too small), where every real rank takes its own tensor's; a state declaring
    # nothing has its tensors shaped like the stacked parameter per replica, the others (a count) shared. Oracle:
    # the algorithm by hand, per tensor
    replicas, lr = 3, 0.5
    transform = puredist.outer_optimizer(make(lr), sync_every=SYNC_EVERY)
    start = tensors(3)
    params = [torch.stack([p] * replicas) for p in start]
    state = transform.init(params)
    globals_, local = [p.clone() for p in start], [[p.clone() for p in start] for _ in range(replicas)]
    for step in range(STEPS):
        for p in params:
            p.add_(torch.stack([drift(rank, step, p.shape[1:]) for rank in range(replicas)]))
        state = transform.update_(params, state, collective=puredist.SimulatedCollective(replicas))
        local = [[p + drift(rank, step, p.shape) for p in local[rank]] for rank in range(replicas)]
        if (step + 1) % SYNC_EVERY == 0:
            for k, g in enumerate(globals_):
                pseudo = g - sum(local[r][k] for r in range(replicas)) / replicas
                globals_[k] = g - lr * pseudo / pseudo.norm()
            local = [[g.clone() for g in globals_] for _ in range(replicas)]
        for k, p in enumerate(params):
            torch.testing.assert_close(p, torch.stack([local[r][k] for r in range(replicas)]), rtol=1e-5, atol=1e-5)


def test_on_simulated_ranks_a_per_tensor_optimizer_built_without_a_pure_update_is_refused_by_name():
    transform = puredist.outer_optimizer(normalized_sgd_by_hand(pure=False), sync_every=1)
    params = [torch.stack([p] * 2) for p in tensors(3)]
    state, before = transform.init(params), [p.clone() for p in params]
    for p in params:
        p.add_(1.0)
    with pytest.raises(TypeError, match=r"Arg ``outer``: on simulated ranks .*update=None"):
        transform.update_(params, state, collective=puredist.SimulatedCollective(2))
    assert all(torch.equal(p, b + 1.0) for p, b in zip(params, before)) and state.step == 0  # nothing changed
