"""Functional optimizers against torch.optim's classes, step for step; purity."""

from typing import NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import puredist
from puredist.tree import tree_leaves, tree_map

CASES = [
    (torch.optim.SGD, puredist.sgd, st.fixed_dictionaries({
        "lr": st.floats(0.001, 0.5), "momentum": st.sampled_from([0.0, 0.5, 0.9]),
        "weight_decay": st.sampled_from([0.0, 0.01]), "maximize": st.booleans(),
        "dampening": st.sampled_from([0.0, 0.3]), "foreach": st.sampled_from([None, True, False]),
        "fused": st.sampled_from([None, True]),
    })),
    (torch.optim.Adam, puredist.adam, st.fixed_dictionaries({
        "lr": st.floats(0.001, 0.1), "weight_decay": st.sampled_from([0.0, 0.1]),
        "amsgrad": st.booleans(), "maximize": st.booleans(), "foreach": st.sampled_from([None, True, False]),
        "decoupled_weight_decay": st.booleans(), "fused": st.sampled_from([None, True]),
    })),
    (torch.optim.AdamW, puredist.adamw, st.fixed_dictionaries({
        "lr": st.floats(0.001, 0.1), "weight_decay": st.sampled_from([0.0, 0.01]),
        "amsgrad": st.booleans(), "maximize": st.booleans(), "foreach": st.sampled_from([None, True, False]),
        "fused": st.sampled_from([None, True]),
    })),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("torch_class, functional, hyperparams", CASES, ids=["sgd", "adam", "adamw"])
@given(data=st.data())
def test_matches_torch_optim_bitwise(dtype, torch_class, functional, hyperparams, data):
    kwargs = data.draw(hyperparams)
    if kwargs["fused"]:  # torch's fused kernel (CPU here, CUDA on GPUs) excludes foreach
        kwargs["foreach"] = None
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(3, 4, generator=gen, dtype=dtype), "b": [torch.randn(5, generator=gen, dtype=dtype)]}
    reference = [p.clone().requires_grad_() for p in tree_leaves(params)]
    torch_optimizer = torch_class(reference, **kwargs)
    optimizer = functional(**kwargs)
    in_place = tree_map(torch.clone, params)
    state_in_place = optimizer.init(in_place)
    pure, state_pure = params, optimizer.init(params)
    for _ in range(4):
        grads = tree_map(lambda p: torch.randn(p.shape, generator=gen, dtype=dtype), params)
        for r, g in zip(reference, tree_leaves(grads)):
            r.grad = g.clone()
        torch_optimizer.step()
        state_in_place = optimizer.update_(in_place, grads, state_in_place)
        pure, state_pure = optimizer.update(pure, grads, state_pure)
        for ours_a, ours_b, theirs in zip(tree_leaves(in_place), tree_leaves(pure), reference):
            assert torch.equal(ours_a, theirs.detach()) and torch.equal(ours_b, theirs.detach())


# foreach=True: the out-of-place multi-tensor step (puredist._out_of_place); None on a CPU: a copy, stepped in place
@pytest.mark.parametrize("make", [lambda: puredist.adam(lr=0.1), lambda: puredist.adamw(lr=0.1, foreach=True),
                                  lambda: puredist.adamw(lr=0.1, amsgrad=True, maximize=True, foreach=True),
                                  lambda: puredist.sgd(0.1, momentum=0.9, nesterov=True, foreach=True),
                                  lambda: puredist.sgd(0.1, weight_decay=0.1, maximize=True, foreach=True),
                                  # a schedule: a copy stepped in place by torch's kernel, which adds into the grads
                                  lambda: puredist.sgd(lambda count: 0.1, momentum=0.9, nesterov=True, foreach=True)],
                         ids=["adam", "adamw-foreach", "adamw-amsgrad-foreach", "sgd-nesterov-foreach", "sgd-foreach",
                              "sgd-nesterov-scheduled"])
def test_pure_update_does_not_touch_its_inputs_and_equals_the_in_place_step(make):
    optimizer = make()
    params = [torch.randn(4), torch.randn(2, 3)]
    state = optimizer.init(params)
    grads = [torch.randn(4), torch.randn(2, 3)]
    kept_params, kept_state = [p.clone() for p in params], [[t.clone() for t in s] for s in state]
    kept_grads = [g.clone() for g in grads]
    new_params, new_state = optimizer.update(params, grads, state)
    assert all(torch.equal(p, k) for p, k in zip(params, kept_params))
    assert all(torch.equal(g, k) for g, k in zip(grads, kept_grads))
    assert all(torch.equal(a, b) for s, k in zip(state, kept_state) for a, b in zip(s, k))
    in_place_state = optimizer.update_(params, grads, state)  # the reference: torch's kernel, in place
    assert all(torch.equal(a, b) for a, b in zip(new_params, params))
    assert all(torch.equal(a, b) for s, t in zip(new_state, in_place_state) for a, b in zip(s, t))
    fresh = {t.data_ptr() for s in new_state for t in s} | {p.data_ptr() for p in new_params}
    assert not fresh & ({t.data_ptr() for s in state for t in s} | {p.data_ptr() for p in params})
    assert not isinstance(new_state[0], puredist.optim.AdamParamState) or new_state[0].step.item() == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("torch_class, make", [
    (torch.optim.SGD, lambda: dict(lr=0.1, momentum=0.9, foreach=True)),
    (torch.optim.Adam, lambda: dict(lr=0.1, betas=(0.9, 0.99), foreach=True)),
    (torch.optim.AdamW, lambda: dict(lr=0.1, weight_decay=0.1, foreach=True)),
], ids=["sgd", "adam", "adamw"])
def test_a_16_bit_pure_update_equals_torch_bitwise(dtype, torch_class, make):
    # where torch's in-place 16-bit multiply rounds its scalar first, the pure update keeps to torch's kernel
    functional = {torch.optim.SGD: puredist.sgd, torch.optim.Adam: puredist.adam, torch.optim.AdamW: puredist.adamw}
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(256, generator=gen).to(dtype)]
    reference = [p.clone().requires_grad_() for p in params]
    torch_optimizer, optimizer = torch_class(reference, **make()), functional[torch_class](**make())
    state = optimizer.init(params)
    for _ in range(5):
        grads = [torch.randn(256, generator=gen).to(dtype)]
        reference[0].grad = grads[0].clone()
        torch_optimizer.step()
        params, state = optimizer.update(params, grads, state)
        assert torch.equal(params[0], reference[0].detach())


def test_the_state_is_shaped_like_the_params_tree():
    optimizer = puredist.adam(lr=0.1)
    params = {"w": torch.ones(2, 3), "bias": None, "layers": [torch.ones(4)]}
    state = optimizer.init(params)
    assert set(state) == {"w", "bias", "layers"} and state["bias"] is None
    assert state["w"].exp_avg.shape == (2, 3) and state["layers"][0].exp_avg.shape == (4,)
    grads = {"w": torch.ones(2, 3), "bias": None, "layers": [torch.ones(4)]}
    new_params, new_state = optimizer.update(params, grads, state)
    assert set(new_state) == set(state) and new_state["layers"][0].step.item() == 1.0
    flat = optimizer.update_(params, grads, (state["w"], state["layers"][0]))  # a flat sequence of states, as ZeRO passes
    assert set(flat) == set(state) and all(torch.equal(params[k] if k == "w" else params[k][0],
                                                       new_params[k] if k == "w" else new_params[k][0]) for k in ("w", "layers"))
    with pytest.raises(ValueError, match="``state`` must be shaped like ``params``"):
        optimizer.update_(params, grads, {"w": state["w"]})


class Linear(NamedTuple):
    weight: torch.Tensor
    bias: torch.Tensor


def test_params_made_of_named_tuples_get_a_state_of_the_same_shape():
    optimizer = puredist.sgd(lr=0.1, momentum=0.9)
    params = [Linear(torch.ones(2, 3), torch.ones(3)), torch.ones(1)]
    state = optimizer.init(params)
    assert isinstance(state[0], Linear) and state[0].bias.momentum_buffer.shape == (3,)
    grads = [Linear(torch.ones(2, 3), torch.ones(3)), torch.ones(1)]
    new_params, new_state = optimizer.update(params, grads, state)
    assert isinstance(new_state[0], Linear) and torch.equal(new_params[0].bias, torch.full((3,), 0.9))


def test_a_missing_gradient_leaves_parameter_and_state_alone():
    optimizer = puredist.sgd(lr=0.1, momentum=0.9)
    params = [torch.ones(2), torch.ones(3)]
    initial = optimizer.init(params)
    state = optimizer.update_(params, [torch.ones(2), None], initial)
    assert torch.equal(params[1], torch.ones(3)) and state[1] is initial[1]
    assert torch.equal(state[1].momentum_buffer, torch.zeros(3))
    assert not torch.equal(state[0].momentum_buffer, torch.zeros(2)) and not torch.equal(params[0], torch.ones(2))


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: puredist.sgd(lr=-1.0), "lr.*-1.0"),
        (lambda: puredist.sgd(lr=0.1, nesterov=True), "Nesterov"),
        (lambda: puredist.sgd(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "Nesterov"),
        (lambda: puredist.adam(betas=(0.9, 1.0)), "betas.*1.0"),
        (lambda: puredist.adamw(foreach=True, fused=True), "foreach.*fused.*cannot both"),
        (lambda: puredist.adamw(eps=-1e-8), "eps"),
    ],
)
def test_bad_hyperparameters_are_rejected(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize("torch_class, functional, kwargs", [
    (torch.optim.SGD, puredist.sgd, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (torch.optim.Adam, puredist.adam, {"lr": 0.01, "amsgrad": True}),
    (torch.optim.AdamW, puredist.adamw, {"lr": 0.01, "weight_decay": 0.1}),
], ids=["sgd", "adam", "adamw"])
def test_fused_kernels_match_torch_bitwise(torch_class, functional, kwargs):
    """torch's fused kernel (here on CPU; the same call takes CUDA tensors), state included
    (1000-element tensors: there the fused kernels' results differ from the others')."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(1000, generator=gen), torch.randn(5, generator=gen)]
    reference = [p.clone().requires_grad_() for p in params]
    torch_optimizer = torch_class(reference, fused=True, **kwargs)
    optimizer = functional(fused=True, **kwargs)
    state = optimizer.init(params)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for r, g in zip(reference, grads):
            r.grad = g.clone()
        torch_optimizer.step()
        state = optimizer.update_(params, grads, state)
    assert all(torch.equal(p, r.detach()) for p, r in zip(params, reference))
    theirs = [torch_optimizer.state[r] for r in reference]
    for ours, their in zip(state, theirs):
        for field, value in ours._asdict().items():
            if value is not None:
                assert torch.equal(value, their[field]) and value.device == their[field].device, field


@pytest.mark.parametrize("pure", [False, True], ids=["update_", "update"])
@pytest.mark.parametrize("torch_class, functional, kwargs", [
    (torch.optim.SGD, puredist.sgd, {"lr": 0.5, "momentum": 0.9}),
    (torch.optim.Adam, puredist.adam, {"lr": 0.01}),
], ids=["sgd", "adam"])
def test_fused_kernels_step_a_transposed_parameter_with_a_contiguous_gradient(torch_class, functional, kwargs, pure):
    # torch's fused kernels pair elements by their place in memory; torch.optim's gradients are laid out like
    # their parameters by autograd, a pseudo-gradient or a torch.func gradient need not be
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(3, 40, generator=gen).t(), torch.randn(7, generator=gen)]
    reference = [p.clone().requires_grad_() for p in params]
    assert reference[0].stride() == params[0].stride() == (1, 40)
    torch_optimizer = torch_class(reference, fused=True, **kwargs)
    optimizer = functional(fused=True, **kwargs)
    state = optimizer.init(params)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in params]  # contiguous
        for r, g in zip(reference, grads):
            r.grad = torch.empty_like(r).copy_(g)  # laid out like the parameter, as autograd does
        torch_optimizer.step()
        if pure:
            params, state = optimizer.update(params, grads, state)
        else:
            state = optimizer.update_(params, grads, state)
    assert all(torch.equal(p, r.detach()) for p, r in zip(params, reference))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_sgd_refuses_16_bit_cpu_parameters_where_torchs_kernel_steps_them_wrongly(dtype):
    # the oracle: torch's own multi-tensor kernel on the same tensor (torch 2.13's fused one is off by units)
    gen = torch.Generator().manual_seed(0)
    start, grad = torch.randn(64, generator=gen).to(dtype), torch.randn(64, generator=gen).to(dtype)
    fused, multi = (torch.nn.Parameter(start.clone()) for _ in range(2))
    for param, kernel in ((fused, dict(fused=True)), (multi, dict(foreach=True))):
        param.grad = grad.clone()
        torch.optim.SGD([param], lr=0.5, **kernel).step()
    torch_is_wrong = not torch.allclose(fused.double(), multi.double(), rtol=4 * torch.finfo(dtype).eps, atol=0)
    optimizer = puredist.sgd(0.5, fused=True)
    params = [start.clone(), torch.randn(3)]
    state = optimizer.init(params)
    if torch_is_wrong:
        with pytest.raises(ValueError, match=r"fused.*wrongly.*parameter 0.*nothing was stepped"):
            optimizer.update_(params, [grad, torch.randn(3)], state)
        assert torch.equal(params[0], start)
    else:  # a torch whose kernel is right: stepped as torch steps
        optimizer.update_(params, [grad, torch.randn(3)], state)
        assert torch.equal(params[0], fused.detach())


@pytest.mark.parametrize("functional", [puredist.sgd, puredist.adam, puredist.adamw])
def test_a_fused_kernel_refuses_complex_parameters_before_stepping_any(functional):
    optimizer = functional(lr=0.1, fused=True)
    params = [torch.ones(4), torch.ones(3, dtype=torch.complex64)]
    state = optimizer.init(params)
    with pytest.raises(TypeError, match=r"``fused``.*parameter 1 is torch.complex64.*nothing was stepped"):
        optimizer.update_(params, [torch.ones(4), torch.ones(3, dtype=torch.complex64)], state)
    assert torch.equal(params[0], torch.ones(4)) and torch.equal(params[1], torch.ones(3, dtype=torch.complex64))


@pytest.mark.parametrize("torch_class, functional, kwargs", [
    (torch.optim.Adam, puredist.adam, {}), (torch.optim.AdamW, puredist.adamw, {}),
    (torch.optim.SGD, puredist.sgd, dict(momentum=0.9, nesterov=True)), (torch.optim.SGD, puredist.sgd, dict(fused=True)),
], ids=["adam", "adamw", "sgd_nesterov", "sgd_fused"])
def test_a_learning_rate_schedule_equals_torchs_lambda_lr_bitwise(torch_class, functional, kwargs):
    base, decay = 0.01, (lambda count: 0.5 ** count)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(50, generator=gen), torch.randn(3, generator=gen)]
    reference = [p.clone().requires_grad_() for p in params]
    torch_optimizer = torch_class(reference, lr=base, **kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch_optimizer, decay)
    optimizer, constant = functional(lr=lambda count: base * decay(count), **kwargs), functional(lr=base, **kwargs)
    unscheduled = [p.clone() for p in params]
    state, constant_state = optimizer.init(params), constant.init(unscheduled)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for r, g in zip(reference, grads):
            r.grad = g.clone()
        torch_optimizer.step()
        scheduler.step()
        state = optimizer.update_(params, grads, state)
        constant_state = constant.update_(unscheduled, grads, constant_state)
        assert all(torch.equal(p, r.detach()) for p, r in zip(params, reference))
    assert not torch.equal(params[0], unscheduled[0])  # the schedule mattered: a constant rate ends elsewhere


@pytest.mark.parametrize("kernel", [dict(foreach=False), dict(foreach=True), dict(fused=True)], ids=["for", "foreach", "fused"])
def test_sgd_momentum_keeps_signed_zeros_as_torch_does(kernel):
    # torch's first step copies the gradient into the buffer; puredist's starts from a zero buffer
    values = torch.tensor([-0.0, 0.0, -0.0, 0.0])
    reference = values.clone().requires_grad_()
    reference.grad = torch.tensor([-0.0, -0.0, 0.0, 0.0])
    torch_optimizer = torch.optim.SGD([reference], lr=0.1, momentum=0.9, **kernel)
    optimizer = puredist.sgd(lr=0.1, momentum=0.9, **kernel)
    params = [values.clone()]
    state = optimizer.update_(params, [reference.grad.clone()], optimizer.init(params))
    torch_optimizer.step()
    assert torch.equal(torch.signbit(params[0]), torch.signbit(reference.detach()))
    assert torch.equal(torch.signbit(state[0].momentum_buffer), torch.signbit(torch_optimizer.state[reference]["momentum_buffer"]))


def test_every_state_keeps_its_structure_from_init_dampened_sgd_too():
    from puredist.tree import vmap_axes

    for optimizer in (puredist.sgd(lr=0.1, momentum=0.9, dampening=0.5), puredist.sgd(lr=0.1), puredist.adam()):
        params = {"w": torch.ones(3)}
        state = optimizer.init(params)
        axes = vmap_axes(state)
        for _ in range(2):
            state = optimizer.update_(params, {"w": torch.ones(3)}, state)
            assert vmap_axes(state) == axes


def test_a_schedule_refuses_a_state_that_counts_no_steps():
    params = [torch.ones(2)]
    unscheduled = puredist.sgd(lr=0.1, momentum=0.9).init(params)
    with pytest.raises(TypeError, match="``state``: parameter 0's state counts no steps"):
        puredist.sgd(lr=lambda count: 0.1, momentum=0.9).update_(params, [torch.ones(2)], unscheduled)
    assert torch.equal(params[0], torch.ones(2))


@pytest.mark.parametrize("torch_class, functional, kwargs", [
    (torch.optim.SGD, puredist.sgd, dict(momentum=0.9)), (torch.optim.AdamW, puredist.adamw, {}),
    (torch.optim.Adam, puredist.adam, dict(fused=True)),
], ids=["sgd", "adamw", "adam_fused"])
def test_learning_rate_and_weight_decay_schedules_equal_torch_with_its_group_set_each_step(torch_class, functional, kwargs):
    lr, decay = (lambda count: 0.05 / (1 + count)), (lambda count: 0.1 * 0.5 ** count)
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(40, generator=gen), torch.randn(3, generator=gen)]
    reference = [p.clone().requires_grad_() for p in params]
    torch_optimizer = torch_class(reference, lr=lr(0), weight_decay=decay(0), **kwargs)
    optimizer = functional(lr=lr, weight_decay=decay, **kwargs)
    state = optimizer.init(params)
    for count in range(4):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for r, g in zip(reference, grads):
            r.grad = g.clone()
        torch_optimizer.param_groups[0].update(lr=lr(count), weight_decay=decay(count))
        torch_optimizer.step()
        state = optimizer.update_(params, grads, state)
        assert all(torch.equal(p, r.detach()) for p, r in zip(params, reference)), count


@pytest.mark.parametrize("torch_class, functional, schedules, fixed", [
    (torch.optim.SGD, puredist.sgd, dict(momentum=lambda count: min(0.9, 0.3 * count)), dict(lr=0.05, nesterov=False)),
    (torch.optim.SGD, puredist.sgd, dict(momentum=lambda count: 0.5 + 0.1 * count), dict(lr=0.05, nesterov=True)),
    (torch.optim.Adam, puredist.adam, dict(betas=lambda count: (0.8 + 0.05 * count, 0.99)), dict(lr=0.01)),
], ids=["sgd_momentum_from_zero", "sgd_nesterov", "adam_betas"])
def test_momentum_and_beta_schedules_equal_torch_with_its_group_set_each_step(torch_class, functional, schedules, fixed):
    (name, schedule), = schedules.items()
    gen = torch.Generator().manual_seed(2)
    params = [torch.randn(30, generator=gen), torch.randn(3, generator=gen)]
    reference = [p.clone().requires_grad_() for p in params]
    torch_optimizer = torch_class(reference, **fixed, **{name: schedule(0) if name == "betas" else 0.5})
    optimizer = functional(**fixed, **schedules)
    state = optimizer.init(params)
    for count in range(4):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for r, g in zip(reference, grads):
            r.grad = g.clone()
        torch_optimizer.param_groups[0][name] = schedule(count)
        torch_optimizer.step()
        state = optimizer.update_(params, grads, state)
        assert all(torch.equal(p, r.detach()) for p, r in zip(params, reference)), count


def test_a_schedule_value_out_of_range_is_refused_before_anything_is_stepped():
    params = [torch.ones(2)]
    for optimizer, match in [
        (puredist.sgd(lr=0.1, momentum=lambda count: -1.0), "``momentum`` must be a non-negative number, got -1.0"),
        (puredist.adam(betas=lambda count: (0.9, 1.5)), r"``betas`` must be two numbers in \[0, 1\), got \(0.9, 1.5\)"),
        (puredist.adamw(lr=lambda count: float("-inf")), "``lr`` must be a non-negative number"),
    ]:
        with pytest.raises(ValueError, match=match):
            optimizer.update_(params, [torch.ones(2)], optimizer.init(params))
        assert torch.equal(params[0], torch.ones(2))
    with pytest.raises(ValueError, match="``momentum`` \\(a schedule\\) and ``dampening``"):
        puredist.sgd(lr=0.1, momentum=lambda count: 0.9, dampening=0.1)


def test_a_parameter_skipped_by_a_scheduled_sgd_keeps_its_own_count():
    optimizer = puredist.sgd(lr=lambda count: 0.5 ** (count + 1))  # 0.5, 0.25, ...: every step exact
    params = [torch.ones(2), torch.ones(3)]
    state = optimizer.init(params)
    state = optimizer.update_(params, [torch.ones(2), None], state)  # the second has no gradient yet
    state = optimizer.update_(params, [torch.ones(2), torch.ones(3)], state)
    assert torch.equal(params[0], torch.full((2,), 1 - 0.5 - 0.25)) and torch.equal(params[1], torch.full((3,), 0.5))
    assert [s.step.item() for s in state] == [2.0, 1.0]


def test_a_schedule_is_checked_count_by_count_in_order_before_it_is_read_at_the_next():
    """At counts 1 and 2 (a parameter skipped once), a schedule out of range at 1 is
    refused before it is read at 2, where it would raise its own error: the values of
    each count are checked as they are made, lowest count first."""
    calls, bad = [], []

    def lr(count):
        calls.append(count)
        return (-1.0 if count == 1 else 1 / 0) if bad else 0.1

    optimizer = puredist.sgd(lr=lr)
    params = [torch.ones(2), torch.ones(2)]
    state = optimizer.update_(params, [torch.ones(2), torch.ones(2)], optimizer.init(params))  # counts 1, 1
    state = optimizer.update_(params, [torch.ones(2), None], state)  # counts 2, 1
    before = [p.clone() for p in params]
    bad.append(True)
    for refused in (lambda: optimizer.check(state), lambda: optimizer.update_(params, [torch.ones(2)] * 2, state)):
        with pytest.raises(ValueError, match="``lr`` must be a non-negative number, got -1.0"):
            refused()
        assert calls[-1] == 1  # (the schedule was not read at count 2)
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_a_schedule_under_a_transform_says_why_it_cannot_run():
    optimizer = puredist.adam(lr=lambda count: 0.01)
    params = torch.randn(2, 3)
    state = optimizer.init([params[0]])
    stacked = tuple(type(s)(*(None if t is None else torch.stack([t] * 2) for t in s)) for s in state)
    from puredist.tree import vmap_axes

    with pytest.raises(NotImplementedError, match="``lr`` is a schedule.*map the counts with in_dims=None"):
        torch.func.vmap(optimizer.update, in_dims=(0, 0, vmap_axes(stacked)))([params], [torch.randn(2, 3)], stacked)


@pytest.mark.parametrize("functional, kwargs, tolerance", [
    (puredist.adamw, {}, 1e-6), (puredist.sgd, dict(momentum=0.9), 0.0),
], ids=["adamw", "sgd"])
def test_a_schedule_runs_under_vmap_with_the_counts_unmapped(functional, kwargs, tolerance):
    from puredist.tree import vmap_axes

    optimizer = functional(lr=lambda count: 0.05 * 0.5 ** count, **kwargs)
    replicas, gen = 3, torch.Generator().manual_seed(0)
    stacked = [torch.randn(replicas, 4, generator=gen)]
    eager = [[stacked[0][r].clone()] for r in range(replicas)]
    eager_states = [optimizer.init(p) for p in eager]
    one = optimizer.init(eager[0])
    state = [s._replace(**{f: torch.stack([t] * replicas) for f, t in s._asdict().items()
                           if t is not None and f != "step"}) for s in one]  # shaped like the params (a list)
    axes = [a._replace(step=None) for a in vmap_axes(state)]  # one count for every replica
    for _ in range(3):
        grads = [torch.randn(replicas, 4, generator=gen)]
        for r in range(replicas):
            eager[r], eager_states[r] = optimizer.update(eager[r], [grads[0][r]], eager_states[r])
        stacked, state = torch.func.vmap(optimizer.update, in_dims=(0, 0, axes), out_dims=(0, axes))(stacked, grads, state)
    assert state[0].step.item() == 3.0
    for r in range(replicas):  # (Adam's differentiable kernel takes the step's powers in float32)
        torch.testing.assert_close(stacked[0][r], eager[r][0], rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("nesterov", [False, True])
def test_a_recorded_first_momentum_step_equals_torchs_from_a_state_without_buffers(nesterov):
    # a state without momentum buffers (torch's first step, or a checkpoint that kept none) takes the recorded
    # path's own first step (torch's buf = grad, kept differentiable): its values must be torch's
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(3, 2, generator=gen), torch.randn(4, generator=gen)]
    grads = [[torch.randn(t.shape, generator=gen) for t in start] for _ in range(3)]
    options = dict(lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=0.01)
    eager, recorded = puredist.sgd(**options), puredist.sgd(**options, differentiable=True)
    no_buffers = [puredist.optim.SGDParamState(None) for _ in start]
    reference = [torch.nn.Parameter(t.clone()) for t in start]
    torch_sgd = torch.optim.SGD(reference, **options)
    ours_eager, state_eager = [t.clone() for t in start], list(no_buffers)
    ours_recorded, state_recorded = [t.clone().requires_grad_() for t in start], list(no_buffers)
    for g in grads:
        for p, gi in zip(reference, g):
            p.grad = gi
        torch_sgd.step()
        ours_eager, state_eager = eager.update(ours_eager, g, state_eager)
        ours_recorded, state_recorded = recorded.update(ours_recorded, g, state_recorded)
        assert ours_recorded[0].grad_fn is not None  # recorded
    for torch_p, e, r in zip(reference, ours_eager, ours_recorded):
        assert torch.equal(e, torch_p.detach())
        torch.testing.assert_close(r.detach(), torch_p.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("make", [lambda: puredist.sgd(0.1, momentum=0.9), lambda: puredist.adam()])
def test_arguments_in_optax_order_are_named_as_such(make):
    opt = make()
    params = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    state = opt.init(params)
    for update in (opt.update, opt.update_):
        with pytest.raises(ValueError, match=r"optax's order, update\(grads, state, params\)"):
            update(grads, state, params)
    assert torch.equal(params["w"], torch.ones(2, 3))


def test_a_state_type_declares_every_field_and_the_factory_takes_only_declared_ones():
    from typing import NamedTuple

    from puredist.optim import Count, Shaped, make_optimizer, param_state

    class Undeclared(NamedTuple):
        buffer: torch.Tensor

    with pytest.raises(TypeError, match=r"Field ``buffer`` of Undeclared must be annotated Shaped or Count"):
        param_state(elementwise=True)(Undeclared)
    with pytest.raises(TypeError, match=r"param_state declares NamedTuple classes, got <class 'dict'>"):
        param_state(elementwise=True)(dict)
    with pytest.raises(TypeError, match=r"Arg ``state_type`` .*Undeclared.* must be declared with"):
        make_optimizer(Undeclared, lambda p: Undeclared(p), lambda *args: args[2])

    @param_state(elementwise=False)
    class Declared(NamedTuple):
        count: Count
        buffer: Shaped

    declared = puredist.optim.declaration(Declared)
    assert (declared.elementwise, declared.shaped, declared.counts) == (False, ("buffer",), ("count",))
    assert puredist.optim.declaration(Undeclared) is None
    # a state whose shaped field was made for other parameters is refused before anything is stepped
    opt = make_optimizer(Declared, lambda p: Declared(torch.zeros(()), torch.zeros_like(p)),
                         lambda params, grads, states, traced: list(states))
    assert not opt.elementwise
    with pytest.raises(ValueError, match=r"parameter 0 has shape \(3,\), its state's buffers \(2,\)"):
        opt.update_([torch.ones(3)], [torch.ones(3)], opt.init([torch.ones(2)]))


def test_an_optimizer_made_with_make_optimizer_has_its_plain_hyper_parameters_checked_when_made():
    """As its docstring says: a number is checked when the optimizer is made (by
    ``validate``, default a non-negative number, ``betas`` in [0, 1)), a schedule's
    values at the update; nothing is stepped with a refused value."""
    from puredist.optim import Count, Shaped, make_optimizer, param_state

    @param_state(elementwise=True)
    class Plain(NamedTuple):
        count: Count
        buffer: Shaped

    def make(**hypers):
        return make_optimizer(Plain, lambda p: Plain(torch.zeros(()), torch.zeros_like(p)),
                              lambda params, grads, states, traced, **values: list(states), hypers=hypers)

    with pytest.raises(ValueError, match=r"``lr``.*-1"):
        make(lr=-1)
    with pytest.raises(ValueError, match="betas"):
        make(betas=(0.9, 1.5))
    make(lr=0.1, betas=(0.9, 0.99))
    opt = make(lr=lambda count: -1.0)  # a schedule: its value is checked at the update, before any step
    param = torch.ones(2)
    with pytest.raises(ValueError, match=r"``lr``.*-1"):
        opt.update_([param], [torch.ones(2)], opt.init([param]))


def test_the_optim_package_imports_no_distribution_and_its_modules_form_no_cycle():
    """Its contract ("must not communicate"), checked on the imports themselves (those
    under ``TYPE_CHECKING`` included): nothing of the collectives, ZeRO or DiLoCo, and
    no module of the package imports one that imports it back."""
    import pathlib

    from import_rules import cycles, package_imports

    graph = package_imports(pathlib.Path(puredist.optim.__file__).parent, "puredist.optim")
    allowed = {"puredist._docs", "puredist._dtensors", "puredist._inputs", "puredist._seq", "puredist._transforms",
               "puredist._validation", "puredist.tree"}
    for name, imported in graph.items():
        ours = {m for m in imported if m.split(".")[0] == "puredist"}
        outside = ours - allowed - {m for m in ours if m.startswith("puredist.optim")}
        assert not outside, f"{name} imports {sorted(outside)}"
        assert not any(m.startswith("torch.distributed") for m in imported), name
    within = {name: {m for m in imported if m.startswith("puredist.optim.")} for name, imported in graph.items()}
    assert not cycles(within), f"import cycles through {cycles(within)}"
    assert len(graph) >= 8  # every module was read
