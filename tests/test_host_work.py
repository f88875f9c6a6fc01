"""Host work per call grows with buckets, not with leaves (counted, not timed).

On a GPU the bytes move at TB/s and what the user waits for is the host: a Python
loop over leaves, a tensor formatted into a string (each one reads values back: a
host synchronization), an exception raised and caught on the way. These tests count
that work on 2 Gloo ranks, at steady state (after a first call, which checks and
plans a layout once):

- operations dispatched to torch (a ``TorchDispatchMode``) and Python function calls
  (``sys.setprofile``: comprehensions and generators count once per resumption) are
  the same for 8 leaves and for 64 leaves that fit the same bucket. The pure
  compressed averager returns a new tensor per leaf: those are views of one buffer,
  cut in C++ (counted apart: a fixed number of views per leaf, and nothing else
  grows); so are DiLoCo's conversions (bf16 pseudo-gradients, an fp64 global copy). The classic wrappers (the periodic averager, post-local SGD's optimizer,
  ZeRO's step) are counted alike;
- the Python calls of the DDP hooks (ZeRO's two, post-local SGD's) during a backward
  pass are the same for 8 and 64 parameters (autograd's own work grows with them);
- no tensor is formatted and no exception is raised inside puredist, over every
  public path that runs per step (the CPU counterpart of the CUDA suite's check for
  host synchronizations).
"""

from __future__ import annotations

import gc
import sys
import types
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import puredist
from puredist import classic
from workers import run_workers

SMALL, LARGE = 8, 64  # leaves of 4 elements: one bucket either way


class _CountingDispatch(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


_FUTURE_CALLBACKS = {
    code for code in classic.post_localSGD_hook._allreduce_mean_future.__code__.co_consts
    if isinstance(code, types.CodeType)
}
"""puredist's callbacks of futures (one per bucket): they run on the thread that
completes the future first, this one or the backend's, whose calls the profile does
not see; not counted, so that the count does not depend on that race."""


def _python_calls(fn) -> int:
    """Python calls made by puredist's code during ``fn()``: into puredist's functions
    or from them (a NamedTuple's constructor, a comprehension, a library function),
    not the ones torch's own kernels make (its optimizers have loops of their own)."""
    calls = 0

    def ours(frame) -> bool:
        return frame is not None and "/puredist/" in frame.f_code.co_filename

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call" and (ours(frame) or ours(frame.f_back)) and frame.f_code not in _FUTURE_CALLBACKS:
            calls += 1

    gc.collect()  # the collector's callbacks (weak references, finalizers of other objects) are not fn's work
    gc.disable()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return calls


def _paths(leaves: int):
    """``{name: call}`` of the per-step paths over ``leaves`` parameters, each a
    closure that keeps its state; every call averages or synchronizes."""
    params = [torch.nn.Parameter(torch.full((4,), float(i))) for i in range(leaves)]
    grads = [torch.ones(4) for _ in range(leaves)]
    collective = puredist.DistributedCollective()
    averager = puredist.hierarchical_averager({1: 2})
    diloco = puredist.outer_optimizer(puredist.sgd(0.7, momentum=0.9, nesterov=True, foreach=True), sync_every=1)
    streaming = puredist.outer_optimizer(puredist.sgd(0.7, momentum=0.9, foreach=True), sync_every=2, fragments=2)
    delayed = puredist.outer_optimizer(puredist.sgd(0.7, momentum=0.9, foreach=True), sync_every=2, delay=1)
    compressed = puredist.outer_optimizer(puredist.sgd(0.7, momentum=0.9, foreach=True), sync_every=1,
                                          compressor=puredist.int8_blocks())
    # the global copy on the parameters' device in another dtype, or sent in another (the README's DiLoCo)
    bf16 = puredist.outer_optimizer(puredist.sgd(0.7, momentum=0.9, nesterov=True, foreach=True), sync_every=1,
                                    comm_dtype=torch.bfloat16)
    fp64 = puredist.outer_optimizer(puredist.sgd(0.7, momentum=0.9, foreach=True), sync_every=1,
                                    global_dtype=torch.float64)
    delayed_bf16 = puredist.outer_optimizer(puredist.sgd(0.7, momentum=0.9, foreach=True), sync_every=2, delay=1,
                                            comm_dtype=torch.bfloat16)
    sgd = puredist.sgd(1e-3, momentum=0.9, foreach=True)
    zero = puredist.zero(puredist.sgd(1e-3, momentum=0.9, foreach=True))
    compressed_averager = puredist.compressed_averager(puredist.int8_blocks())
    plan = puredist.plan_zero([p.numel() for p in params], 2)
    for param, grad in zip(params, grads):  # the classic paths average and step the parameters that have one
        param.grad = grad
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # period 1 warns, as torch's does: here every call averages
        periodic = classic.PeriodicModelAverager(period=1)
        post_local = classic.PostLocalSGDOptimizer(torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True),
                                                   classic.PeriodicModelAverager(period=1))
    zero_classic = classic.ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=1e-3, momentum=0.9, foreach=True)
    states = {"averager": averager.init(), "diloco": diloco.init(params), "streaming": streaming.init(params),
              "compressed": compressed.init(params), "delayed": delayed.init(params), "compressed averager": compressed_averager.init(params),
              "bf16": bf16.init(params), "fp64": fp64.init(params), "delayed bf16": delayed_bf16.init(params),
              "sgd": sgd.init(params), "sgd pure": sgd.init(params),
              "zero": zero.init(params, plan=plan, rank=torch.distributed.get_rank())}

    def run(name, update):
        def call():
            states[name] = update(states[name])
        return call

    # FSDP2's parameters: DTensors sharded over a mesh dimension of one rank, averaged across the other
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    sharded = [torch.nn.Parameter(distribute_tensor(p.detach(), mesh["shard"], [Shard(0)], src_data_rank=None))
               for p in params]
    mesh_collective = puredist.DistributedCollective.from_mesh(mesh, "replicate")
    states["sharded diloco"] = diloco.init(sharded)  # the global copy and momentum: DTensors, stepped on their shards
    return {
        "average_": lambda: puredist.average_(params, collective=collective),
        "average_ of DTensors": lambda: puredist.average_(sharded, collective=mesh_collective),
        "DiLoCo update_ of DTensors": run("sharded diloco", lambda s: diloco.update_(sharded, s, collective=mesh_collective)),
        "average_ async": lambda: puredist.average_(params, collective=collective, async_op=True).wait(),
        "hierarchical averager update_": run("averager", lambda s: averager.update_(params, s, collective=collective)),
        "DiLoCo update_ (synchronizing)": run("diloco", lambda s: diloco.update_(params, s, collective=collective)),
        "streaming DiLoCo update_": run("streaming", lambda s: streaming.update_(params, s, collective=collective)),
        "DiLoCo update_ with bf16 pseudo-gradients": run("bf16", lambda s: bf16.update_(params, s, collective=collective)),
        "DiLoCo update_ with an fp64 global copy": run("fp64", lambda s: fp64.update_(params, s, collective=collective)),
        "delayed DiLoCo update_ with bf16 pseudo-gradients": run(
            "delayed bf16", lambda s: delayed_bf16.update_(params, delayed_bf16.update_(params, s, collective=collective),
                                                           collective=collective)),
        "delayed DiLoCo update_ (a synchronization started, then applied)": run(
            "delayed", lambda s: delayed.update_(params, delayed.update_(params, s, collective=collective),
                                                 collective=collective)),
        "DiLoCo update_ with int8": run("compressed", lambda s: compressed.update_(params, s, collective=collective)),
        "compressed averager update (pure)": run(
            "compressed averager", lambda s: compressed_averager.update(params, s, collective=collective)[1]),
        "sgd update_": run("sgd", lambda s: sgd.update_(params, grads, s)),
        "sgd update (pure)": run("sgd pure", lambda s: sgd.update(params, grads, s)[1]),
        "PeriodicModelAverager.average_parameters": lambda: periodic.average_parameters(params),
        "PostLocalSGDOptimizer.step": post_local.step,
        "ZeroRedundancyOptimizer.step": zero_classic.step,
        "ZeRO update_": run("zero", lambda s: zero.update_(params, grads, s, collective=collective)),
    }


def _work_per_call(rank, world_size):
    counts = {}
    for leaves in (SMALL, LARGE):
        for name, call in _paths(leaves).items():
            for _ in range(3):  # the first call checks and plans the layout; steady state after
                call()
            with _CountingDispatch():  # as does the first under a dispatch mode (part of the key, as autocast is)
                for _ in range(3):
                    call()
            with _CountingDispatch() as mode:
                call()
            views = sum(op in _VIEWS for op in mode.ops)
            counts[(name, leaves)] = (len(mode.ops) - views, views, _python_calls(call))
    return counts


_VIEWS = {"aten.view.default", "aten.slice.Tensor"}
_NEW_TENSOR_PER_LEAF = {
    "compressed averager update (pure)": 6,
    # a new buffer of each conversion (the pseudo-gradients sent, their mean in the global copy's dtype, the
    # snapshot), viewed per leaf for the outer step: one view and one slice each
    "DiLoCo update_ with bf16 pseudo-gradients": 4,
    "DiLoCo update_ with an fp64 global copy": 2,
    "delayed DiLoCo update_ with bf16 pseudo-gradients": 6,
}
"""Paths that return a new tensor per leaf, and the views per leaf they make in C++
to cut them from one buffer and to lay the leaves end to end (nothing else)."""


def test_the_work_per_call_does_not_grow_with_the_leaves():
    counts = run_workers(_work_per_call, 2)[0]
    for name in {name for name, _ in counts}:
        (ops_small, views_small, calls_small), (ops_large, views_large, calls_large) = (
            counts[(name, SMALL)], counts[(name, LARGE)])
        assert ops_large == ops_small, (name, ops_small, ops_large)
        assert views_large - views_small == _NEW_TENSOR_PER_LEAF.get(name, 0) * (LARGE - SMALL), (
            name, views_small, views_large)
        assert calls_large == calls_small, (name, calls_small, calls_large)


class _Leaves(torch.nn.Module):
    def __init__(self, leaves: int) -> None:
        super().__init__()
        self.leaves = torch.nn.ParameterList(torch.nn.Parameter(torch.full((4,), float(i))) for i in range(leaves))

    def forward(self, x):
        return torch.stack(list(self.leaves)).mv(x).sum()


def _backward_calls_with_the_ddp_hooks(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    counts = {}
    for leaves in (SMALL, LARGE):
        local_sgd = classic.post_localSGD_hook.post_localSGD_hook
        for hook in (classic.hook_with_zero_step, classic.hook_with_zero_step_interleaved, local_sgd):
            ddp = DistributedDataParallel(_Leaves(leaves))
            if hook is local_sgd:  # local SGD from the start: the hook averages in the subgroup
                ddp.register_comm_hook(classic.PostLocalSGDState(None, torch.distributed.new_group([0, 1]), 0), hook)
            else:  # the ZeRO step runs inside the hook, per bucket
                zero = classic.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=1e-3,
                                                       overlap_with_ddp=True)
                ddp.register_comm_hook(None, hook(allreduce_hook, ddp, zero))
            x = torch.ones(4)
            for _ in range(4):  # the ZeRO hooks' first iterations build the buckets' plan
                ddp(x).backward()
            counts[(hook.__name__, leaves)] = _python_calls(lambda: ddp(x).backward())
    return counts


def test_the_ddp_hooks_make_no_python_call_per_parameter():
    # autograd's own work grows with the parameters; the Python calls of puredist's hooks must not
    counts = run_workers(_backward_calls_with_the_ddp_hooks, 2)[0]
    for name in {name for name, _ in counts}:
        assert counts[(name, LARGE)] == counts[(name, SMALL)] > 0, (name, counts[(name, SMALL)], counts[(name, LARGE)])


def _formatting_and_exceptions(rank, world_size):
    formatted, raised = [], []
    original_str = torch._tensor_str._str

    def recording_str(tensor, *args, **kwargs):
        formatted.append(tuple(tensor.shape))
        return original_str(tensor, *args, **kwargs)

    def tracer(frame, event, arg):
        if "/puredist/" not in frame.f_code.co_filename:
            return None

        def local(frame, event, arg):
            if event == "exception" and not issubclass(arg[0], (GeneratorExit, StopIteration)):  # (a generator closed)
                raised.append(f"{frame.f_code.co_name}: {arg[0].__name__}")
            return local
        return local

    leaves = 12
    paths = _paths(leaves)
    params = [torch.nn.Parameter(torch.full((3, 4), float(i))) for i in range(leaves)]
    grads = [torch.ones(3, 4) for _ in range(leaves)]
    sgd = puredist.sgd(0.1, momentum=0.9)
    zero = puredist.zero(puredist.adamw(1e-3))
    compressed = puredist.outer_optimizer(puredist.sgd(0.7, momentum=0.9), sync_every=1,
                                          compressor=puredist.int8_blocks())
    collective = puredist.DistributedCollective()
    states = [sgd.init({"p": params}), zero.init(params, plan=puredist.plan_zero([p.numel() for p in params], 2),
                                                  rank=rank), compressed.init(params)]
    for call in paths.values():
        call()
    torch._tensor_str._str = recording_str
    sys.settrace(tracer)
    try:
        for _ in range(3):
            for call in paths.values():
                call()
            new_params, states[0] = sgd.update({"p": params}, {"p": grads}, states[0])
            states[1] = zero.update_(params, grads, states[1], collective=collective)
            states[2] = compressed.update_(params, states[2], collective=collective)
            puredist.average(new_params, collective=collective)
    finally:
        sys.settrace(None)
        torch._tensor_str._str = original_str
    return formatted, raised


def test_no_tensor_is_formatted_and_no_exception_raised_on_the_paths_run_every_step():
    for formatted, raised in run_workers(_formatting_and_exceptions, 2):
        assert formatted == [], formatted
        assert raised == [], raised


def _dispatched(call) -> int:
    for _ in range(2):
        call()
    with _CountingDispatch() as mode:
        call()
    return len(mode.ops)


@pytest.mark.parametrize("fused", [None, True])
def test_adam_dispatches_what_torch_optim_adam_dispatches(fused):
    # torch's multi-tensor Adam reads each step count on the host (2 reads per parameter
    # without capturable): puredist's update_ runs that kernel, and adds nothing per leaf
    for leaves in (SMALL, LARGE):
        params = [torch.nn.Parameter(torch.randn(4)) for _ in range(leaves)]
        grads = [torch.randn(4) for _ in params]
        torch_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for p, g in zip(torch_params, grads):
            p.grad = g
        reference = torch.optim.Adam(torch_params, lr=1e-3, foreach=not fused, fused=fused)
        adam = puredist.adam(1e-3, foreach=not fused, fused=fused)
        state = [adam.init(params)]

        def step():
            state[0] = adam.update_(params, grads, state[0])

        assert _dispatched(step) <= _dispatched(reference.step)


@pytest.mark.parametrize("fused", [None, True])
def test_adams_steps_make_no_python_call_per_leaf(fused):
    # the pure update with the fused kernel copies the parameters and the state (a clone per tensor on a
    # CPU, one multi-tensor kernel on a GPU: dispatched per leaf here), then steps the copies
    calls = {}
    for leaves in (SMALL, LARGE):
        params = [torch.nn.Parameter(torch.randn(4)) for _ in range(leaves)]
        grads = [torch.randn(4) for _ in params]
        adam = puredist.adamw(1e-3, foreach=not fused, fused=fused)
        in_place, pure = [adam.init(params)], [params, adam.init(params)]

        def step_in_place():
            in_place[0] = adam.update_(params, grads, in_place[0])

        def step_pure():
            pure[0], pure[1] = adam.update(pure[0], grads, pure[1])

        for step in (step_in_place, step_pure):
            step()
        calls[leaves] = (_python_calls(step_in_place), _python_calls(step_pure))
    assert calls[SMALL] == calls[LARGE], calls


@pytest.mark.parametrize("leaves", [SMALL])
def test_the_counting_sees_per_leaf_work(leaves):
    # the oracle of the test above: a loop over leaves is counted
    params = [torch.zeros(4) for _ in range(2 * leaves)]
    with _CountingDispatch() as few:
        for p in params[:leaves]:
            p.add_(1)
    with _CountingDispatch() as many:
        for p in params:
            p.add_(1)
    assert len(many.ops) == 2 * len(few.ops) == 2 * leaves
    few, many = (puredist.tree.tree_map(lambda t: t + 1, [torch.zeros(1)] * n) for n in (leaves, 2 * leaves))
    assert _python_calls(lambda: puredist.tree.tree_map(lambda t: t, many)) > _python_calls(
        lambda: puredist.tree.tree_map(lambda t: t, few))


class _CountingReads(TorchDispatchMode):
    """Reads of a tensor's value on the host (``.item()``, ``int()``, ``bool()``): on a
    GPU each one waits for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_schedule_reads_the_step_counts_at_once_not_one_per_parameter(optimizer):
    # fused kernels keep the counts on the parameters' device (as torch's do): a read per
    # parameter would be a host synchronization per parameter on a GPU
    make = getattr(puredist, optimizer)
    opt = make(lambda count: 1e-3 / (1 + count), fused=True, **({"momentum": 0.9} if optimizer == "sgd" else {}))
    params = [torch.randn(4) for _ in range(SMALL)]
    grads = [torch.randn(4) for _ in params]
    state = opt.update_(params, grads, opt.init(params))
    with _CountingReads() as mode:
        opt.update_(params, grads, state)
    assert mode.reads <= 1, mode.reads
