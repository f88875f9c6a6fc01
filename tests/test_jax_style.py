"""A JAX user's whole step: one training step written for one replica, ``torch.func.vmap``
over R simulated replicas with a VmapCollective, puredist's AdamW inside, then DiLoCo
(puredist's Nesterov SGD outside) or a periodic averager, eager and under
``torch.compile(fullgraph=True)``.

Oracles: per-replica ``torch.optim.AdamW`` with an outer ``torch.optim.SGD`` (Nesterov)
on the mean pseudo-gradient, written out by hand (the fragments and their schedule
too); compiled, the same vmapped function run eagerly (``aot_eager``: the graph
itself; Adam's step rounds within 1e-7 of it)."""

import warnings

import pytest
import torch
from torch.func import functional_call, grad, vmap

import puredist
from puredist import SimulatedCollective, VmapCollective
from puredist.tree import tree_leaves, vmap_axes

R = 4


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(dtype)


def _batches(steps, dtype):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(R, 6, 4, generator=gen, dtype=dtype), torch.randn(R, 6, 2, generator=gen, dtype=dtype))
            for _ in range(steps)]


def _oracle(model, batches, lr, sync_every, fragments):
    """Per-replica torch.optim.AdamW, then DiLoCo by hand (Algorithm 1, Streaming
    DiLoCo's fragments in torchft's order): after inner step ``c``, fragment f (leaves
    ``fragments[f]``) synchronizes when ``c - (f + 1) * H // F mod H`` is a
    non-negative multiple of H: an outer Nesterov SGD step on the mean of ``global -
    local`` (the global copy starts as the initial parameters), written into every
    replica."""
    initial = [p.detach() for p in model.parameters()]
    local = [[p.clone().requires_grad_() for p in initial] for _ in range(R)]
    inner = [torch.optim.AdamW(ps, lr=lr) for ps in local]
    global_ = [p.clone() for p in initial]
    outer = torch.optim.SGD(global_, lr=0.7, momentum=0.9, nesterov=True)
    names = [n for n, _ in model.named_parameters()]
    for k, (x, y) in enumerate(batches):
        for r in range(R):
            inner[r].zero_grad()
            out = functional_call(model, dict(zip(names, local[r])), (x[r],))
            torch.nn.functional.mse_loss(out, y[r]).backward()
            inner[r].step()
        count = k + 1
        for f, leaves in enumerate(fragments):
            since = count - (f + 1) * sync_every // len(fragments) % sync_every
            if since < 0 or since % sync_every:
                continue
            with torch.no_grad():
                for i in leaves:
                    global_[i].grad = sum(global_[i] - local[r][i] for r in range(R)) / R
                outer.step()  # (the other fragments' leaves have no gradient: not stepped)
                for i in leaves:
                    global_[i].grad = None
                    for r in range(R):
                        local[r][i].copy_(global_[i])
    return [torch.stack([local[r][i].detach() for r in range(R)]) for i in range(len(initial))], global_


def test_one_vmapped_diloco_step_for_every_step_equals_per_replica_adamw_and_an_outer_nesterov_sgd():
    dtype, steps, lr = torch.float64, 7, 1e-2
    model = _model(dtype)
    params = {n: p.detach() for n, p in model.named_parameters()}
    inner = puredist.adamw(lr)
    diloco = puredist.outer_optimizer(_NESTEROV(), sync_every=2, fragments=2)
    axes = (vmap_axes(inner.init(params)), vmap_axes(diloco.init(params)))  # the step (an int) unmapped
    stacked = {n: p.expand(R, *p.shape).clone() for n, p in params.items()}
    state = vmap(lambda p: (inner.init(p), diloco.init(p)), out_dims=axes)(stacked)  # one state per replica
    assert vmap_axes(state) == axes

    def step(p, s, x, y):  # written for one replica
        g = grad(lambda q: torch.nn.functional.mse_loss(functional_call(model, q, (x,)), y))(p)
        p, inner_state = inner.update(p, g, s[0])
        p, outer_state = diloco.update(p, s[1], collective=VmapCollective(R))
        return p, (inner_state, outer_state)

    vmapped = vmap(step, in_dims=(0, axes, 0, 0), out_dims=(0, axes))  # one function for every step
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*performance drop.*")
        for x, y in _batches(steps, dtype):
            stacked, state = vmapped(stacked, state, x, y)
            assert vmap_axes(state) == axes
    # the model's leaves [w0 (32), b0 (8), w1 (16), b1 (2)]: fragment 0 is w0, fragment 1 the rest
    expected, expected_global = _oracle(model, _batches(steps, dtype), lr, 2, [(0,), (1, 2, 3)])
    assert state[1].step == steps
    # under vmap Adam's bias corrections are taken from its fp32 step count: about 1e-5 of lr a step
    for ours, theirs in zip(tree_leaves(stacked), expected):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 * lr * steps)
    for ours, theirs in zip(state[1].global_params, expected_global):
        torch.testing.assert_close(ours, theirs.expand_as(ours), rtol=0, atol=1e-5 * lr * steps)
    assert not torch.allclose(stacked["0.weight"], params["0.weight"].expand(R, 8, 4))  # it trained


def _compiled_and_eager(transform, steps):
    """``(compiled, eager)`` runs of one vmapped step (puredist's AdamW, then
    ``transform.update`` on a VmapCollective) from states made by ``vmap(init)``:
    each ``(params, (adamw state, transform state))``."""
    model, inner = _model(), puredist.adamw(1e-2)
    params = {n: p.detach() for n, p in model.named_parameters()}
    axes = (vmap_axes(inner.init(params)), vmap_axes(transform.init(params)))
    stacked = {n: p.expand(R, *p.shape).clone() for n, p in params.items()}
    state = vmap(lambda p: (inner.init(p), transform.init(p)), out_dims=axes)(stacked)

    def step(p, s, x, y):
        g = grad(lambda q: torch.nn.functional.mse_loss(functional_call(model, q, (x,)), y))(p)
        p, inner_state = inner.update(p, g, s[0])
        p, outer_state = transform.update(p, s[1], collective=VmapCollective(R))
        return p, (inner_state, outer_state)

    vmapped = vmap(step, in_dims=(0, axes, 0, 0), out_dims=(0, axes))
    compiled = torch.compile(vmapped, fullgraph=True, backend="aot_eager")
    runs = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*performance drop.*")
        for function in (compiled, vmapped):
            run = (stacked, state)
            for x, y in _batches(steps, torch.float32):
                run = function(*run, x, y)
            runs.append(run)
    return runs


def _NESTEROV():
    return puredist.sgd(0.7, momentum=0.9, nesterov=True)


def _max_error(ours, theirs) -> float:
    """The largest difference between two runs' tensors (their other leaves equal)."""
    pairs = list(zip(tree_leaves(ours), tree_leaves(theirs), strict=True))
    assert [a for a, _ in pairs if not isinstance(a, torch.Tensor)] == [b for _, b in pairs if not isinstance(b, torch.Tensor)]
    return max((a - b).abs().max().item() for a, b in pairs if isinstance(a, torch.Tensor))


@pytest.fixture(autouse=True)
def _fresh_compiler():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def test_the_whole_compiled_diloco_step_with_fragments_and_bf16_pseudo_gradients_equals_eager():
    diloco = puredist.outer_optimizer(_NESTEROV(), sync_every=2, fragments=2, comm_dtype=torch.bfloat16)
    compiled, eager = _compiled_and_eager(diloco, 5)
    assert compiled[1][1].step == eager[1][1].step == 5
    assert _max_error(compiled, eager) < 1e-6  # (the step counts too: Adam's, the outer SGD's none)
    assert any(b.abs().sum() > 0 for b in tree_leaves(compiled[1][1].outer_state))  # the outer step ran


def test_the_whole_compiled_periodic_averaging_step_equals_eager():
    compiled, eager = _compiled_and_eager(puredist.periodic_averager(2, warmup_steps=1), 4)
    assert compiled[1][1] == eager[1][1] == puredist.AveragerState(step=4)
    assert _max_error(compiled, eager) < 1e-6
    assert torch.equal(compiled[0]["2.bias"], compiled[0]["2.bias"][:1].expand(R, 2))  # averaged at step 3


def test_the_vmap_collectives_exchange_rows_as_real_ranks_would():
    rows = torch.arange(R * R * 2.0).view(R, R, 2)  # replica r's rows rows[r]: row c for replica c
    collective = VmapCollective(R)
    received, gathered, index = vmap(
        lambda x: (collective.all_to_all([x])[0], collective.all_gather([x[0]])[0], collective.replica_index(x)))(rows)
    for r in range(R):  # what replica r holds: from each q, q's row r; every replica's row 0; its index
        assert torch.equal(received[r], torch.stack([rows[q, r] for q in range(R)]))
        assert torch.equal(gathered[r], rows[:, 0]) and index[r] == r
    with pytest.raises(RuntimeError, match=r"outside torch.func.vmap.*use SimulatedCollective\(4\)"):
        collective.all_gather([rows[0]])
    with pytest.raises(ValueError, match=r"element 0 has shape \(3, 2\); an all-to-all over 4 replicas"):
        vmap(lambda x: collective.all_to_all([x[1:]]))(rows)


def test_the_vmap_exchanges_read_the_replica_axis_where_vmap_maps_it():
    # the stack transposed, mapped at dim 1: each replica holds the same rows as mapped at dim 0
    rows = torch.arange(R * R * 2.0).view(R, R, 2)
    collective = VmapCollective(R)
    exchanges = lambda x: (collective.all_to_all([x])[0], collective.all_gather([x])[0])  # noqa: E731
    at_0 = vmap(exchanges, in_dims=0)(rows)
    at_1 = vmap(exchanges, in_dims=1)(rows.transpose(0, 1).contiguous())
    assert [torch.equal(got, expected) for got, expected in zip(at_1, at_0)] == [True, True]  # all-to-all, all-gather


CODECS = {"int8": lambda: puredist.compression.int8_blocks(8), "int4": lambda: puredist.compression.int4_blocks(8),
          "int2": lambda: puredist.compression.int2_blocks(8), "top_k": lambda: puredist.compression.top_k(0.3),
          "chunked_top_k": lambda: puredist.compression.chunked_top_k(2, 8)}


def _codec_runs(codec, steps, *, compiled):
    """DiLoCo with ``codec`` over R replicas that each drift their own way between
    steps: ``(vmapped on a VmapCollective, eagerly or compiled, on stacked tensors on
    a SimulatedCollective)``, each ``(params, state)``."""
    diloco = puredist.outer_optimizer(_NESTEROV(), sync_every=2, fragments=2, compressor=codec)
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(5, 3, generator=gen), "b": torch.randn(7, generator=gen)}
    stacked = {k: v.expand(R, *v.shape).clone() for k, v in params.items()}
    drifts = [{k: 0.1 * torch.randn(R, *v.shape, generator=gen) for k, v in params.items()} for _ in range(steps)]
    axes = vmap_axes(diloco.init(params))
    vmapped = vmap(lambda p, s, d: diloco.update({k: p[k] + d[k] for k in p}, s, collective=VmapCollective(R)),
                   in_dims=(0, axes, 0), out_dims=(0, axes))
    if compiled:
        vmapped = torch.compile(vmapped, fullgraph=True, backend="aot_eager")
    ours, simulated = (stacked, vmap(diloco.init, out_dims=axes)(stacked)), (stacked, diloco.init(stacked))
    for d in drifts:
        ours = vmapped(*ours, d)
        simulated = diloco.update({k: simulated[0][k] + d[k] for k in d}, simulated[1], collective=SimulatedCollective(R))
    assert any(r.abs().max() > 0 for r in simulated[1].residuals)  # the codec lost something: error feedback ran
    return ours, simulated


@pytest.mark.parametrize("codec", CODECS)
def test_diloco_with_a_codec_under_vmap_equals_the_same_codec_on_a_simulated_collective(codec):
    # the VmapCollective's all-to-all and all-gather against the simulated two phases on the stacked rows
    ours, simulated = _codec_runs(CODECS[codec](), 5, compiled=False)
    assert _max_error(ours, simulated) == 0.0


@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("chunk", [1, 2], ids=["own chunk", "another's chunk"])
@pytest.mark.parametrize("codec", CODECS)
def test_a_non_finite_value_under_vmap_makes_every_replicas_mean_non_finite(codec, chunk, value):
    # replica 1's value in a chunk it owns (sent exact, then in phase 2's payload) or another's (phase 1's payload):
    # where the other backends refuse it, under vmap it must reach every replica's mean (an int8 or 4-bit block
    # scale clamped finite made it a finite 1.1e38); the same step on a SimulatedCollective refuses it
    compressor = CODECS[codec]()
    x = torch.randn(R, 4 * R, generator=torch.Generator().manual_seed(0))
    x[1, 4 * chunk + 1] = value  # (chunk c: elements [4c, 4c + 4))
    residuals = torch.zeros(R, 4 * R)
    step = vmap(lambda a, e: tuple(t[0] for t in puredist.compression.compressed_mean(
        [a], (e,), compressor, VmapCollective(R), context="step 0")))
    mean, left = step(x, residuals)
    assert [bool(torch.isfinite(m).all()) for m in mean] == [False] * R, mean
    assert not torch.isfinite(left).all()
    with pytest.raises(ValueError, match=r"holds inf or NaN \(this rank: inf or NaN in leaf 0\)"):
        puredist.compression.compressed_mean([x], (residuals,), compressor, SimulatedCollective(R), context="step 0")


@pytest.mark.parametrize("codec", ["int4", "chunked_top_k"])
def test_the_compiled_diloco_step_with_a_codec_equals_the_simulated_one(codec):
    ours, simulated = _codec_runs(CODECS[codec](), 4, compiled=True)
    assert _max_error(ours, simulated) == 0.0


def test_the_replicas_initial_copies_are_checked_through_the_vmap():
    diloco = puredist.outer_optimizer(puredist.sgd(0.7), sync_every=2)
    stacked = [torch.randn(R, 3)]
    state = vmap(diloco.init, out_dims=vmap_axes(diloco.init([stacked[0][0]])))(stacked)
    update = vmap(lambda p, s: diloco.update(p, s, collective=VmapCollective(R)),
                  in_dims=(0, vmap_axes(state)), out_dims=(0, vmap_axes(state)))
    with pytest.raises(puredist.RankMismatchError, match=r"Tensors \[0\] \(of 1\) differ between replicas"):
        update(stacked, state)
    same = [stacked[0][:1].expand(R, 3).clone()]
    new, _ = update(same, vmap(diloco.init, out_dims=vmap_axes(state))(same))
    assert torch.equal(new[0], same[0])  # the first synchronization of equal replicas: their mean


def test_errors_name_the_fix():
    diloco = puredist.outer_optimizer(puredist.sgd(0.7), sync_every=2)
    stacked = [torch.ones(R, 3)]
    with pytest.raises(RuntimeError, match=r"used outside torch.func.vmap.*use SimulatedCollective\(4\)"):
        diloco.update(stacked, diloco.init(stacked), collective=VmapCollective(R))
    with pytest.raises(ValueError, match=r"tensor 0 has shape \(4, 3\); simulated, every tensor is stacked \[3, "):
        diloco.update(stacked, diloco.init(stacked), collective=SimulatedCollective(3))
    for entry in (diloco.update, diloco.update_):  # each entry point checks the state once
        with pytest.raises(TypeError, match="Arg ``state`` is a AveragerState, not an OuterState"):
            entry(stacked, puredist.AveragerState(step=0), collective=SimulatedCollective(R))
    compressed = puredist.outer_optimizer(puredist.sgd(0.7), sync_every=2,
                                          compressor=puredist.compression.int8_blocks())
    with pytest.raises(ValueError, match="made by init of a transform with a compressor; this one has none"):
        diloco.update(stacked, compressed.init(stacked), collective=SimulatedCollective(R))


def test_replica_worlds_draw_named_tuples_printed_with_their_values():
    from hypothesis import given, settings

    from puredist.testing import ReplicaWorld, replica_worlds, shown

    assert shown({"w": torch.tensor([0.5, -1.0])}) == "{'w': tensor(shape=(2,), torch.float32, [0.5, -1.0])}"
    drawn = []

    @settings(max_examples=3, database=None)
    @given(replica_worlds(dtypes=(torch.float64,)))
    def collect(world):
        drawn.append(world)

    collect()
    for world in drawn:
        replicas, group_size, tree = world
        assert isinstance(world, ReplicaWorld) and (world.replicas, world.group_size) == (replicas, group_size)
        assert repr(world) == f"ReplicaWorld(replicas={replicas}, group_size={group_size}, tree={shown(tree)})"


def test_a_state_or_parameters_passed_to_vmap_with_the_wrong_dims_are_named():
    diloco = puredist.outer_optimizer(puredist.sgd(0.7), sync_every=2)
    stacked = [torch.ones(R, 3)]
    axes = vmap_axes(diloco.init([stacked[0][0]]))
    state = vmap(diloco.init, out_dims=axes)(stacked)
    update = lambda p, s: diloco.update(p, s, collective=VmapCollective(R))  # noqa: E731
    with pytest.raises(ValueError, match=r"a state stacked per replica passed unmapped\? Map it with in_dims="):
        vmap(update, in_dims=(0, None), out_dims=(0, axes))(stacked, state)
    with pytest.raises(ValueError, match=r"stacked parameters passed unmapped\? Map them \(in_dims=0\)"):
        vmap(update, in_dims=(None, axes), out_dims=(0, axes))(stacked, state)


def test_adams_state_made_under_vmap_gives_the_compiled_steps_fused_multiply_add_a_batching_rule():
    # compiled, Adam's addcmul_(value=)/addcdiv_(value=) become prims::fma, which torch 2.13 cannot batch: vmap
    # would run it replica by replica and warn; after vmap(adam.init), one op on the broadcast operands, same values
    vmap(puredist.adamw().init)({"w": torch.zeros(R, 3)})
    from torch._inductor.inductor_prims import fma

    a, b, c = torch.randn(R, 3), torch.randn(3), torch.randn(3, R)
    fallback = torch._C._functorch._is_vmap_fallback_enabled()
    torch._C._functorch._set_vmap_fallback_enabled(False)  # no replica-by-replica loop: a missing rule raises
    try:
        cases = [
            (vmap(fma, in_dims=(0, None, 1))(a, b, c), fma(a, b, c.T)),
            (vmap(lambda x, z: fma(x, 0.5, z), in_dims=(0, 1))(a, c), fma(a, 0.5, c.T)),
            (vmap(fma, in_dims=(None, 0, None))(b, a, b[:1]), fma(b, a, b[:1])),  # a rank-0 row of a rank-1 op
            (vmap(fma, in_dims=(0, 0, None))(a[:, :1], a, torch.tensor(2.0)), fma(a[:, :1], a, torch.tensor(2.0))),
        ]
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(fallback)
    for batched, expected in cases:
        assert torch.equal(batched, expected)
