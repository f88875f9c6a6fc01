"""Outer optimization (DiLoCo) on the simulated backend against a float64
brute-force loop written from the definition; its special cases; buffers."""

import math
import warnings
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import puredist
from puredist.outer import split_fragments


def fragments_by_definition(sizes, count):
    """The documented cut, recomputed for the oracles: leaf ``i`` ends fragment ``f``
    once the running total through it reaches ``(f + 1) / count`` of the total, or when
    only as many leaves are left as fragments still to fill; the last takes the rest."""
    total, running, ends = sum(sizes), 0, []
    for i, size in enumerate(sizes):
        running += size
        filling = len(ends)
        if filling < count - 1 and (running * count >= (filling + 1) * total or len(sizes) - 1 - i == count - 1 - filling):
            ends.append(i + 1)
    bounds = [0, *ends, len(sizes)]
    return tuple(tuple(range(a, b)) for a, b in zip(bounds, bounds[1:]))


def sgd_step(param, grad, buf, lr, momentum, nesterov):
    """torch.optim.SGD's update, by hand (dampening 0)."""
    if momentum:
        buf = grad.clone() if buf is None else momentum * buf + grad
        grad = grad + momentum * buf if nesterov else buf
    return param - lr * grad, buf


def offsets_by_definition(sync_every, fragments):
    """Inner steps into each period at which fragment f synchronizes: (f + 1) / F of
    the period, rounded down, the last fragment at the period's end (torchft's order)."""
    return [(f + 1) * sync_every // fragments % sync_every for f in range(fragments)]


def brute_force(initial, drifts, *, lr, momentum, nesterov, sync_every, warmup, delay, fragments, lower):
    """Replicas on the leading axis; everything recomputed from the definition. The
    drift ``k`` is inner step ``c = k + 1``; after it, fragment f synchronizes when
    ``c - warmup - offset(f)`` is a non-negative multiple of H (c >= 1); with a
    warm-up, its first synchronization only establishes the global copy."""
    leaves = [t.clone() for t in initial]
    glob = [t[0].clone() for t in initial]  # the ranks start equal
    bufs = [None] * len(leaves)
    parts = fragments_by_definition([t[0].numel() for t in initial], fragments)
    offsets = offsets_by_definition(sync_every, fragments)
    pending = {}  # inner step applied after -> (fragment, establishes?, mean pseudo-gradient, snapshot)
    for k, drift in enumerate(drifts):
        c = k + 1
        leaves = [l + d for l, d in zip(leaves, drift)]
        due = [f for f in range(fragments) if c - warmup - offsets[f] >= 0 and (c - warmup - offsets[f]) % sync_every == 0]
        for f in due:
            establishes = warmup > 0 and c == warmup + offsets[f]
            pending[c + delay] = (f, establishes, [(glob[i] - leaves[i]).mean(0) for i in parts[f]],
                                  [leaves[i].clone() for i in parts[f]])
        if c in pending:
            f, establishes, pseudo, snapshot = pending.pop(c)
            for j, i in enumerate(parts[f]):
                if establishes:  # the warm-up's end: plain averaging
                    glob[i] = glob[i] - pseudo[j]
                else:
                    glob[i], bufs[i] = sgd_step(glob[i], pseudo[j], bufs[i], lr, momentum, nesterov)
                leaves[i] = glob[i].expand_as(leaves[i]) + (leaves[i] - snapshot[j]) if delay else glob[i].expand_as(leaves[i]).clone()
        busy = set(due) | {f for f, *_ in pending.values()}
        levels = [p for p in (lower or {}) if c >= warmup and c % p == 0]
        if levels:
            g = lower[max(levels)]
            for f, part in enumerate(parts):
                if f not in busy:
                    for i in part:
                        l = leaves[i]
                        leaves[i] = l.unflatten(0, (-1, g)).mean(1, keepdim=True).expand(-1, g, *l.shape[1:]).flatten(0, 1)
    return leaves


@st.composite
def configs(draw):
    replicas = draw(st.sampled_from([1, 2, 4]))
    sync_every = draw(st.integers(1, 5))
    momentum = draw(st.sampled_from([0.0, 0.9]))
    return dict(
        replicas=replicas,
        lr=draw(st.sampled_from([1.0, 0.7])),
        momentum=momentum,
        nesterov=momentum > 0 and draw(st.booleans()),
        sync_every=sync_every,
        warmup=draw(st.integers(0, 4)),
        delay=draw(st.integers(0, sync_every - 1)),
        fragments=draw(st.integers(1, min(sync_every, 3))),
        lower={2: 2} if replicas == 4 and draw(st.booleans()) else None,
        seed=draw(st.integers(0, 2**16)),
    )


@given(configs())
def test_matches_a_brute_force_loop(config):
    gen = torch.Generator().manual_seed(config["seed"])
    r = config["replicas"]
    initial = [torch.randn(1, *shape, generator=gen, dtype=torch.float64).repeat(r, *[1] * len(shape)) for shape in [(3,), (2, 2), (5,)]]
    drifts = [[torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in initial] for _ in range(14)]
    transform = puredist.outer_optimizer(
        puredist.sgd(lr=config["lr"], momentum=config["momentum"], nesterov=config["nesterov"]),
        sync_every=config["sync_every"], warmup_steps=config["warmup"], delay=config["delay"],
        fragments=config["fragments"], lower_levels=config["lower"],
    )
    params = [t.clone() for t in initial]
    state = transform.init(params)
    collective = puredist.SimulatedCollective(r)
    for drift in drifts:
        for p, d in zip(params, drift):
            p.add_(d)
        state = transform.update_(params, state, collective=collective)
    expected = brute_force(initial, drifts, **{k: v for k, v in config.items() if k not in ("replicas", "seed")})
    for ours, theirs in zip(params, expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)


PLACEMENTS = {  # (leaf dtypes, options): each off the fast path of one device and dtype but the last
    "cpu global copy": ((torch.float64,) * 3, dict(global_device="cpu")),
    "fp64 copy of fp32 leaves": ((torch.float32,) * 3, dict(global_dtype=torch.float64)),
    "fp64 copy of mixed leaves": ((torch.float64, torch.float32, torch.float64), dict(global_dtype=torch.float64)),
    "mixed leaves": ((torch.float64, torch.float32, torch.float64), {}),
}


@pytest.mark.parametrize("delay", [1, 2])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_delayed_synchronization_off_the_default_placement_matches_the_brute_force_loop(placement, delay):
    # the write-back with a delay keeps the progress made since the snapshot: local <- global + (local - snapshot),
    # on each path that writes back (per leaf converted, or one flat converted buffer); the oracle is fp64
    dtypes, options = PLACEMENTS[placement]
    gen = torch.Generator().manual_seed(delay)
    initial = [torch.randn(1, *shape, generator=gen, dtype=dtype).repeat(2, *[1] * len(shape))
               for shape, dtype in zip([(3,), (2, 2), (5,)], dtypes)]
    drifts = [[torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in initial] for _ in range(14)]
    transform = puredist.outer_optimizer(puredist.sgd(lr=0.7, momentum=0.9, nesterov=True), sync_every=3,
                                         warmup_steps=1, delay=delay, fragments=2, **options)
    params = [t.clone() for t in initial]
    state = transform.init(params)
    for drift in drifts:
        for p, d in zip(params, drift):
            p.add_(d)
        state = transform.update_(params, state, collective=puredist.SimulatedCollective(2))
    expected = brute_force([t.double() for t in initial], [[d.double() for d in drift] for drift in drifts], lr=0.7,
                           momentum=0.9, nesterov=True, sync_every=3, warmup=1, delay=delay, fragments=2, lower=None)
    for ours, theirs in zip(params, expected):
        torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-5)


@given(st.integers(1, 4), st.integers(0, 3), st.integers(0, 2**16))
def test_outer_sgd_with_lr_one_is_exactly_periodic_averaging(sync_every, warmup, seed):
    # torch's periodic averager counts its calls from 0 (it averages after inner step warmup + 1); DiLoCo counts
    # completed inner steps (after inner step warmup, or H without a warm-up): the same averagings, one warm-up apart
    gen = torch.Generator().manual_seed(seed)
    start = (torch.randint(-64, 64, (1, 6), generator=gen).double() / 8).repeat(4, 1)  # dyadic: exact arithmetic
    outer_params, averaged = [start.clone()], [start.clone()]
    transform = puredist.outer_optimizer(puredist.sgd(lr=1.0), sync_every=sync_every, warmup_steps=warmup)
    with warnings.catch_warnings():  # period 1: torch's averager warns (DDP alone is cheaper); compared all the same
        warnings.simplefilter("ignore", UserWarning)
        averager = puredist.periodic_averager(sync_every, warmup - 1 if warmup else sync_every - 1)
    outer_state, average_state = transform.init(outer_params), averager.init(averaged)
    collective = puredist.SimulatedCollective(4)
    for _ in range(12):
        drift = torch.randint(-8, 8, (4, 6), generator=gen).double() / 4
        outer_params[0].add_(drift)
        averaged[0].add_(drift)
        outer_state = transform.update_(outer_params, outer_state, collective=collective)
        average_state = averager.update_(averaged, average_state, collective=collective)
        assert torch.equal(outer_params[0], averaged[0])


@given(st.integers(0, 2**16))
def test_delay_zero_is_the_synchronous_update_and_pure_update_leaves_inputs_alone(seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(1, 4, generator=gen).repeat(2, 1)]
    transform = puredist.outer_optimizer(puredist.sgd(lr=0.7, momentum=0.9, nesterov=True), sync_every=2, delay=0)
    state = transform.init(params)
    collective = puredist.SimulatedCollective(2)
    for _ in range(5):
        params = [params[0] + torch.randn(2, 4, generator=gen)]
        kept = params[0].clone()
        new_params, new_state = transform.update(params, state, collective=collective)
        assert torch.equal(params[0], kept) and new_state.step == state.step + 1
        if new_state.step % 2 == 0:  # synchronized after an even inner step: every rank holds the global parameters
            assert torch.equal(new_params[0], new_state.global_params[0].expand_as(new_params[0]))
        params, state = new_params, new_state


def test_bf16_pseudo_gradients_and_a_cpu_global_copy():
    params = [torch.randn(1, 64).repeat(4, 1)]
    transform = puredist.outer_optimizer(puredist.sgd(lr=1.0), sync_every=1, comm_dtype=torch.bfloat16, global_device="cpu")
    state = transform.init(params)
    drift = torch.randn(4, 64)
    params[0].add_(drift)
    start = state.global_params[0].clone()
    state = transform.update_(params, state, collective=puredist.SimulatedCollective(4))
    assert state.global_params[0].dtype == torch.float32  # the outer step runs in the parameter dtype
    exact = start - (start - (start + drift)).mean(0)
    # the pseudo-gradient went through bf16: off by at most bf16's resolution of it
    torch.testing.assert_close(state.global_params[0], exact, rtol=0, atol=2**-7 * drift.abs().max().item())
    assert not torch.equal(state.global_params[0], exact)


def test_a_synchronized_warm_up_is_not_taken_as_one_outer_step():
    # DDP-like warm-up: every rank takes the same steps, so the first sync has nothing to average
    params = [torch.zeros(2, 3)]
    transform = puredist.outer_optimizer(puredist.sgd(lr=0.7, momentum=0.9, nesterov=True), sync_every=4, warmup_steps=10)
    state = transform.init(params)
    for _ in range(11):
        params[0].add_(1.0)
        state = transform.update_(params, state, collective=puredist.SimulatedCollective(2))
    assert torch.equal(params[0], torch.full((2, 3), 11.0))  # not the 14.6 of an outer step on all of it
    assert not state.outer_state[0].momentum_buffer.any()  # the outer optimizer has not stepped yet


@given(st.lists(st.integers(0, 50), min_size=1, max_size=20), st.integers(1, 6))
def test_fragments_are_contiguous_nonempty_and_cover_every_leaf(sizes, count):
    count = min(count, len(sizes))
    parts = split_fragments(sizes, count)
    assert parts == fragments_by_definition(sizes, count)
    assert len(parts) == count and all(parts)
    assert [i for part in parts for i in part] == list(range(len(sizes)))
    # about equal: a fragment exceeds its share by at most its last leaf
    for part in parts[:-1]:
        assert sum(sizes[i] for i in part[:-1]) <= sum(sizes) / count


@given(st.integers(1, 8), st.integers(0, 5), st.data())
def test_the_timeline_alone_syncs_each_fragment_every_sync_every_inner_steps_staggered_by_its_share(sync_every, warmup, data):
    """``puredist.outer.timeline`` without tensors, against the documented timeline
    enumerated forwards, inner step by inner step: fragment f first synchronizes after
    inner step warmup + floor((f + 1) * H / F) mod H (H where that is 0: no
    synchronization before the first inner step), then every H inner steps; with a
    warm-up the first only establishes the global copy, every other one takes an
    outer step; the lower level averages the fragments neither starting nor in flight."""
    from puredist.outer.config import OuterConfig
    from puredist.outer.timeline import SyncKind, due_fragments, lower_level_fragments, sync_kind

    fragments = data.draw(st.integers(1, sync_every))
    config = OuterConfig(puredist.sgd(0.7), sync_every, warmup, 0, fragments, lower_levels={1: 1})
    counts = 3 * sync_every + warmup + 2
    next_sync = [warmup + math.floor(Fraction(f + 1, fragments) * sync_every) % sync_every for f in range(fragments)]
    next_sync = [c if c > 0 else sync_every for c in next_sync]
    done = [0] * fragments  # synchronizations so far, per fragment
    for count in range(1, counts):
        expected = {}
        for f in range(fragments):
            if count == next_sync[f]:
                expected[f] = SyncKind.ESTABLISH if warmup and not done[f] else SyncKind.OUTER_STEP
                done[f], next_sync[f] = done[f] + 1, count + sync_every
        assert {f: sync_kind(config, f, count) for f in range(fragments)} == {f: expected.get(f) for f in range(fragments)}
        assert due_fragments(config, count) == sorted(expected) and len(expected) <= 1
    level, idle = lower_level_fragments(config, warmup + 1, busy={0})
    assert level == 0 and idle == list(range(1, fragments))


def test_without_warm_up_the_first_synchronization_is_an_outer_step_after_inner_step_h():
    # Algorithm 1 by hand, two replicas, H = 2: after inner step 2 the Nesterov step from the initial parameters
    params = [torch.zeros(2, 3)]
    transform = puredist.outer_optimizer(puredist.sgd(lr=0.7, momentum=0.9, nesterov=True), sync_every=2)
    state = transform.init(params)
    drifts = [torch.tensor([[1.0], [3.0]]), torch.tensor([[1.0], [1.0]])]
    for k, drift in enumerate(drifts):
        params[0].add_(drift)
        state = transform.update_(params, state, collective=puredist.SimulatedCollective(2))
        if k == 0:  # after inner step 1: nothing synchronized
            assert torch.equal(params[0], torch.tensor([[1.0] * 3, [3.0] * 3]))
    delta = 0.0 - 3.0  # global - mean(local): the locals are 2 and 4
    expected = 0.0 - 0.7 * (delta + 0.9 * delta)  # Nesterov's first step: the momentum is delta itself
    torch.testing.assert_close(params[0], torch.full((2, 3), expected), rtol=0, atol=1e-6)
    torch.testing.assert_close(state.outer_state[0].momentum_buffer, torch.full((2, 3), delta), rtol=0, atol=0)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(sync_every=0), "``sync_every`` must be a positive"),
        (dict(sync_every=4, delay=4), "delay.*\\[0, 3\\].*got 4"),
        (dict(sync_every=4, fragments=5), "fragments.*\\[1, 4\\].*got 5"),
        (dict(sync_every=4, lower_levels={4: 2, 2: 2}), "strictly increasing"),
    ],
)
def test_bad_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        puredist.outer_optimizer(puredist.sgd(lr=1.0), **options)


@pytest.mark.parametrize("arg", ["comm_dtype", "global_dtype"])
@pytest.mark.parametrize("dtype", [torch.int32, "bf16"])
def test_a_bad_dtype_is_refused_when_the_transform_is_built(arg, dtype):
    with pytest.raises(TypeError, match=f"``{arg}``.*{dtype}"):
        puredist.outer_optimizer(puredist.sgd(lr=1.0), sync_every=2, **{arg: dtype})


def _bf16_diloco(global_dtype, param_dtype=torch.bfloat16, replicas=2, size=4096, steps=400):
    """Final global copy (as fp64) of DiLoCo on parameters of ``param_dtype`` drifting by a
    slow common trend plus noise, per replica."""
    transform = puredist.outer_optimizer(
        puredist.sgd(lr=0.7, momentum=0.9, nesterov=True), sync_every=4, global_dtype=global_dtype
    )
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(size, generator=gen).repeat(replicas, 1).to(param_dtype)]
    state = transform.init(params)
    for _ in range(steps):
        params[0].add_((torch.randn(replicas, size, generator=gen) * 1e-2 + 5e-3).to(param_dtype))
        state = transform.update_(params, state, collective=puredist.SimulatedCollective(replicas))
    assert params[0].dtype == param_dtype  # the parameters keep their dtype
    return state


def test_an_fp32_master_copy_for_bf16_parameters_accumulates_less_error():
    exact = _bf16_diloco(None, param_dtype=torch.float64).global_params[0][0]
    bf16 = _bf16_diloco(None)  # torchft's choice: the global copy in the parameters' dtype
    master = _bf16_diloco(torch.float32)  # INTELLECT-1's: an fp32 master copy
    assert bf16.global_params[0].dtype == torch.bfloat16
    assert master.global_params[0].dtype == master.outer_state[0].momentum_buffer.dtype == torch.float32
    error = {name: (s.global_params[0][0].double() - exact).abs().mean().item() for name, s in
             (("bf16", bf16), ("fp32 master", master))}
    # both lose the local steps bf16 parameters cannot hold; the master copy also keeps every outer step
    assert error["fp32 master"] < 0.7 * error["bf16"], error


def test_buffers_are_averaged_only_when_asked_and_integers_never_as_floats():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    assert set(puredist.averaged_tensors(model)) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    with_buffers = puredist.averaged_tensors(model, buffers=True)
    assert {"1.running_mean", "1.running_var"} <= set(with_buffers) and "1.num_batches_tracked" not in with_buffers
    assert with_buffers["1.running_mean"] is model[1].running_mean  # averaging it updates the module
    with pytest.raises(ValueError, match="num_batches_tracked.*int64"):
        puredist.averaged_tensors(model, buffers=True, integer_buffers="error")


def test_a_checkpoint_without_step_counts_is_refused_by_an_outer_optimizer_that_needs_them():
    params = [torch.zeros(3), torch.zeros(2)]
    plain = puredist.outer_optimizer(puredist.sgd(lr=0.7, momentum=0.9, dampening=0.0), sync_every=2)
    saved = plain.state_dict(plain.init(params), rank=0)
    scheduled = puredist.outer_optimizer(puredist.sgd(lr=lambda count: 0.7, momentum=0.9), sync_every=2)
    saved["config"] = scheduled.state_dict(scheduled.init(params), rank=0)["config"]  # the same schedule string
    with pytest.raises(ValueError, match="no step count for parameter 0's outer state"):
        scheduled.load_state_dict(scheduled.init(params), saved, rank=0)


@pytest.mark.parametrize("options", [
    dict(global_dtype=torch.float64),
    dict(global_device="cpu", compressor=puredist.int8_blocks(16)),
], ids=["fp64 global copy", "compressed"])
@pytest.mark.parametrize("fused, plain", [
    (puredist.adam(0.01, fused=True), puredist.adam(0.01)),
    (puredist.sgd(0.5, momentum=0.9, fused=True), puredist.sgd(0.5, momentum=0.9)),
], ids=["adam", "sgd"])
def test_a_fused_outer_optimizer_steps_a_transposed_leaf_as_the_unfused_one(fused, plain, options):
    # the global copy keeps the leaf's strides, the averaged pseudo-gradient arrives contiguous: torch's
    # fused kernels pair elements by their place in memory (an independent review found O(lr) errors)
    replicas = 2
    base = torch.randn(6, 16, generator=torch.Generator().manual_seed(0)).expand(replicas, 6, 16)  # replicated

    def run(outer):
        leaf = base.transpose(1, 2).contiguous().transpose(1, 2)  # each replica's [6, 16] with transposed strides
        transform = puredist.outer_optimizer(outer, sync_every=1, **options)
        state = transform.init([leaf])
        collective = puredist.SimulatedCollective(replicas)
        for step in range(4):
            with torch.no_grad():
                leaf.add_(torch.randn(leaf.shape, generator=torch.Generator().manual_seed(step)) * 0.1)  # per replica
            state = transform.update_([leaf], state, collective=collective)
        return leaf

    torch.testing.assert_close(run(fused), run(plain), rtol=1e-5, atol=1e-6)


@given(st.integers(1, 4), st.integers(0, 3), st.integers(0, 3), st.integers(0, 2**16))
def test_a_0_1_0_warm_up_of_w_steps_is_a_warm_up_of_w_plus_1_now(sync_every, warmup, delay, seed):
    # CHANGELOG.md's migration rule, against 0.1.0's count written out: it counted updates from 0 (a
    # synchronization at update k >= W with (k - W) % H == 0, the first only averaging, applied at update k + delay)
    delay = min(delay, sync_every - 1)
    gen = torch.Generator().manual_seed(seed)
    start = torch.randn(1, 5, generator=gen, dtype=torch.float64).repeat(3, 1)
    drifts = [torch.randn(3, 5, generator=gen, dtype=torch.float64) for _ in range(12)]
    transform = puredist.outer_optimizer(puredist.sgd(lr=0.7, momentum=0.9, nesterov=True), sync_every=sync_every,
                                         warmup_steps=warmup + 1, delay=delay)
    params = [start.clone()]
    state = transform.init(params)
    local, glob, buf, pending = start.clone(), start[0].clone(), None, {}
    for k, drift in enumerate(drifts):
        params[0].add_(drift)
        state = transform.update_(params, state, collective=puredist.SimulatedCollective(3))
        local = local + drift
        if k >= warmup and (k - warmup) % sync_every == 0:
            pending[k + delay] = (k == warmup, (glob - local).mean(0), local.clone())
        if k in pending:
            first, pseudo, snapshot = pending.pop(k)
            glob, buf = (glob - pseudo, buf) if first else sgd_step(glob, pseudo, buf, 0.7, 0.9, True)
            local = glob.expand_as(local) + (local - snapshot)
        torch.testing.assert_close(params[0], local, rtol=1e-10, atol=1e-10)
