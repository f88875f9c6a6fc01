"""The functional optimizers under ``torch.compile(fullgraph=True)``: their pure
``update`` alone and inside a whole functional training step (``functional_call`` +
``torch.func.grad`` + ``update``), as optax users compile theirs.

The oracle is the eager ``update`` (itself equal to ``torch.optim``, see
test_optim.py): SGD bit for bit; Adam within 1e-6 (the compiled step takes the bias
corrections from the step count on the device, as torch's compiled optimizers do; 1e-5 after
three steps). A fused optimizer compiles the single-tensor form (the fused kernel is
opaque to the compiler): a compiled step is recorded, in the form that runs under
``vmap`` too (the compiled code cannot see a ``vmap``). Inductor (torch 2.13, CPU)
miscompiles ``add(..., alpha=...)`` after a matmul in a step that also takes
``torch.func.grad`` (plain SGD: 13.0 off after three steps): SGD's recorded step writes
it as a ``sub`` and compiled Adam gets its L2 term outside the kernel, hence the
plain, weight-decayed and maximizing variants here. ``fullgraph=True`` fails on any
graph break, and a step must not recompile.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch.func import functional_call, grad

import puredist

OPTIMIZERS = {
    "sgd_nesterov": (lambda: puredist.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=1e-3), 0.0),
    "sgd_plain": (lambda: puredist.sgd(0.1), 0.0),
    "adamw": (lambda: puredist.adamw(1e-2), 1e-5),
    "adamw_fused": (lambda: puredist.adamw(1e-2, fused=True), 1e-5),
    "adam_amsgrad": (lambda: puredist.adam(1e-2, amsgrad=True, weight_decay=1e-2), 1e-5),
    "adam_maximize": (lambda: puredist.adam(1e-2, weight_decay=1e-2, maximize=True), 1e-5),
    "sgd_maximize": (lambda: puredist.sgd(0.1, momentum=0.5, weight_decay=1e-2, maximize=True), 0.0),
}


def _model() -> tuple[torch.nn.Module, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return model, params, torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen)


def _assert_trees_close(actual, expected, atol: float) -> None:
    for a, e in zip(puredist.tree.tree_leaves(actual), puredist.tree.tree_leaves(expected)):
        if atol == 0.0:
            assert torch.equal(a, e), (a - e).abs().max()
        else:
            torch.testing.assert_close(a, e, rtol=0.0, atol=atol)


@pytest.fixture(autouse=True)
def _fresh_compiler():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_pure_update_compiles_without_graph_breaks_and_equals_eager(name):
    make, atol = OPTIMIZERS[name]
    opt = make()
    _, params, _, _ = _model()
    gen = torch.Generator().manual_seed(1)
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(4)]
    compiled = torch.compile(opt.update, fullgraph=True, backend="aot_eager")
    eager_params, eager_state = params, opt.init(params)
    compiled_params, compiled_state = params, opt.init(params)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for g in grads:
            eager_params, eager_state = opt.update(eager_params, g, eager_state)
            compiled_params, compiled_state = compiled(compiled_params, g, compiled_state)
    _assert_trees_close(compiled_params, eager_params, atol)
    _assert_trees_close(compiled_state, eager_state, atol)
    assert all(torch.equal(v, _model()[1][k]) for k, v in params.items())  # the inputs untouched


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_whole_functional_step_compiles_with_inductor_and_equals_eager(name):
    make, atol = OPTIMIZERS[name]
    opt = make()
    model, params, x, y = _model()

    def loss(p):
        return torch.nn.functional.mse_loss(functional_call(model, p, (x,)), y)

    def step(p, state):
        return opt.update(p, grad(loss)(p), state)

    compiled = torch.compile(step, fullgraph=True)
    eager, compiled_run = (params, opt.init(params)), (params, opt.init(params))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            eager = step(*eager)
            compiled_run = compiled(*compiled_run)
    _assert_trees_close(compiled_run, eager, max(atol, 1e-6))  # inductor fuses: rounding differs (1e-7)
    moved = loss(compiled_run[0]) - loss(params)
    assert moved > 0 if "maximize" in name else moved < 0


@pytest.mark.parametrize("make, atol", [(lambda: puredist.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=1e-2), 0.0),
                                        (lambda: puredist.adamw(1e-2, foreach=True), 1e-6)],
                         ids=["sgd_nesterov", "adamw_foreach"])
def test_the_update_of_stacked_replicas_compiles_under_vmap_and_equals_eager(make, atol):
    # the compiled code cannot see the vmap (dynamo traces it): torch's in-place multi-tensor kernels, which
    # eagerly run outside transforms, would meet batched tensors, which take no multi-tensor op
    opt, (model, params, x, y), replicas = make(), _model(), 3
    stacked = {k: v.expand(replicas, *v.shape).clone() for k, v in params.items()}
    axes = puredist.tree.vmap_axes(opt.init(params))
    state = torch.func.vmap(opt.init, out_dims=axes)(stacked)
    xs = x.expand(replicas, *x.shape) * torch.arange(1.0, replicas + 1).view(-1, 1, 1)  # each replica its batch

    def step(p, s, x):
        return opt.update(p, grad(lambda q: torch.nn.functional.mse_loss(functional_call(model, q, (x,)), y))(p), s)

    vmapped = torch.func.vmap(step, in_dims=(0, axes, 0), out_dims=(0, axes))
    compiled = torch.compile(vmapped, fullgraph=True, backend="aot_eager")
    eager, compiled_run = (stacked, state), (stacked, state)
    for _ in range(2):
        eager, compiled_run = vmapped(*eager, xs), compiled(*compiled_run, xs)
    _assert_trees_close(compiled_run, eager, atol)  # (aot_eager's decompositions round Adam's step: 4e-9)
    assert not torch.equal(eager[0]["0.weight"][0], eager[0]["0.weight"][1])  # the replicas stepped apart


def _chain(error: BaseException) -> str:
    """The messages of ``error`` and its causes (dynamo wraps what the traced code raised)."""
    messages = []
    while error is not None:
        messages.append(str(error))
        error = error.__cause__ or error.__context__
    return "\n".join(messages)


def test_tree_map_refuses_a_value_where_the_first_tree_has_none_compiled_as_eagerly():
    # eagerly optree raises ("Expected None"); compiled, None was a leaf of torch's spec and the other tree's tensor
    # there was dropped without a word
    first, other = [torch.ones(1), None], [torch.ones(1), torch.ones(1)]
    add = lambda a, b: puredist.tree.tree_map(torch.add, a, b)  # noqa: E731
    with pytest.raises(ValueError, match="Expected None"):
        add(first, other)
    with pytest.raises(ValueError, match="a value where it has None"):
        torch.compile(add)(first, other)
    with pytest.raises(Exception) as error:  # fullgraph: dynamo raises its own error, ours as the cause
        torch.compile(add, fullgraph=True)(first, other)
    assert "a value where it has None" in _chain(error.value)
