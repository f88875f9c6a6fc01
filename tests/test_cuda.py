"""CUDA paths, run by ``make test-gpu`` on a machine with a GPU (skipped without one).

One GPU serves both layouts torch allows there: Gloo with CUDA tensors at two ranks
(both on GPU 0), and NCCL at one rank (NCCL takes one rank per device). The oracles are
the same computations on the CPU, formulas over every rank's inputs, or torch's own
classes on the same GPU. Host synchronizations are found by torch's CUDA sync debug
mode (``"warn"``, each synchronizing call recorded where it was made).

The parent process never touches CUDA (workers are forked from it): everything on the
GPU happens in the workers. ``PUREDIST_CUDA_DRY_RUN=1`` runs the same checks on the CPU
(Gloo for NCCL, no sync debug mode), to check the tests themselves where there is no GPU.
"""

import contextlib
import os
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist

import puredist
from puredist import classic
from faults import fault_at_collective
from puredist._inputs import checked
from puredist._host_groups import host_group
from test_failures import NUMEL, TENSORS, assert_old_or_mean_as_reported, values
from test_zero_overlap import HOOKS, OPTIMIZERS, _parity
from workers import run_workers

DRY_RUN = os.environ.get("PUREDIST_CUDA_DRY_RUN") == "1"
DEVICE = "cpu" if DRY_RUN else "cuda"
ONE_RANK_BACKEND = "gloo" if DRY_RUN else "nccl"

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not DRY_RUN and not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)"),
]


@contextlib.contextmanager
def host_syncs():
    """The host synchronizations of the block (torch's CUDA sync debug mode): for each
    synchronizing call, where it was made, with the Python calls that led there."""
    found: list[str] = []
    if DRY_RUN:
        yield found
        return

    def record(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing CUDA operation" in str(message):  # not the mode's own prototype warning
            callers = traceback.extract_stack()[-8:-1]
            found.append(" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(callers)))

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def mixed_params(seed: int, device: str) -> list[torch.Tensor]:
    """fp32 over many small buckets, fp16, bf16, a transposed (non-contiguous) fp32
    matrix and complex64."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(300, 257, generator=gen).to(device),
        torch.randn(1000, generator=gen).half().to(device),
        torch.randn(33, 7, generator=gen).bfloat16().to(device),
        torch.randn(40, 30, generator=gen).to(device).t(),
        torch.randn(50, generator=gen, dtype=torch.complex64).to(device),
    ]


def mean_formula(per_rank: list[torch.Tensor]) -> torch.Tensor:
    """The documented mean: fp16 divides each value first, other dtypes sum then divide."""
    if per_rank[0].dtype == torch.float16:
        return sum(t / len(per_rank) for t in per_rank)
    return sum(per_rank) / len(per_rank)


def _average_on_the_gpu(rank, world_size):
    collective = puredist.DistributedCollective(bucket_cap_bytes=32 * 1024)  # many buckets, the ring reused
    params = mixed_params(rank, DEVICE)
    pointers = [p.data_ptr() for p in params]
    puredist.average_(params, collective=collective)
    assert [p.data_ptr() for p in params] == pointers
    everyone = [mixed_params(r, "cpu") for r in range(world_size)]
    for i, p in enumerate(params):
        assert p.device.type == DEVICE
        assert torch.equal(p.cpu(), mean_formula([e[i] for e in everyone])), f"tensor {i}"
    # the pure form, differentiated: the gradient is the mean over ranks of the cotangents
    x = mixed_params(rank, DEVICE)[0].requires_grad_()
    (mean,) = puredist.average([x], collective=collective)
    (mean * (rank + 1)).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, sum(r + 1 for r in range(world_size)) / world_size))


def test_gloo_averages_cuda_tensors_in_place_equal_to_the_formula():
    run_workers(_average_on_the_gpu, 2)


def _staging_reused_from_another_stream(rank, world_size):
    """NCCL's semantics, emulated at one rank (two NCCL ranks need two GPUs): the
    collective runs on a stream of its own that waits for the current stream at launch,
    and ``wait`` orders the current stream after it, the host not waiting. The first
    run's collective is held back (a late peer); the second is issued on another
    stream. Oracle: each run's tensor keeps its own values (the sum of one rank)."""
    from puredist.staging.pool import StagingPool
    from puredist.staging.run import StagingOptions, run_staged

    comm, side = torch.cuda.Stream(), torch.cuda.Stream()  # made first: the first Stream() builds torch's
    # pool of streams, which takes the host long enough for a held-back collective to end meanwhile
    torch.cuda._sleep(1)

    class Work:
        def wait(self):
            torch.cuda.current_stream().wait_stream(comm)

    def launch(late: bool):
        def start(buffer):
            comm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(comm):
                if late:
                    torch.cuda._sleep(200_000_000)
                buffer.mul_(1.0)  # reads and writes the staging buffer
            return Work()
        return start

    for async_op in (False, True):
        pool = StagingPool(backends={"cuda": "nccl"})
        first, second = torch.full((2**20,), 1.0, device="cuda"), torch.full((2**20,), 2.0, device="cuda")
        handle = run_staged([first], launch(True), StagingOptions("first"), pool=pool, async_op=async_op)
        if handle is not None:
            handle.wait()  # its buffer goes back to the pool; the host does not wait for the GPU
        with torch.cuda.stream(side):
            handle = run_staged([second], launch(False), StagingOptions("second"), pool=pool, async_op=async_op)
            if handle is not None:
                handle.wait()
        torch.cuda.synchronize()
        assert torch.equal(first, torch.full_like(first, 1.0)), (async_op, first.max().item())
        assert torch.equal(second, torch.full_like(second, 2.0)), async_op


@pytest.mark.skipif(DRY_RUN, reason="streams are CUDA's")
def test_staging_memory_taken_on_another_stream_waits_for_the_collective_that_last_used_it():
    run_workers(_staging_reused_from_another_stream, 1)


def _async_average_reads_the_values_at_launch(rank, world_size):
    collective = puredist.DistributedCollective(bucket_cap_bytes=2**20)
    bases = [torch.randn(1024, 1024, generator=torch.Generator().manual_seed(r)).to(DEVICE) for r in range(world_size)]
    products = [torch.empty(1024 * 1024, device=DEVICE) for _ in bases]
    for b, product in zip(bases, products):
        torch.matmul(b, b, out=product.view(1024, 1024))
    tensor = products[rank].clone()  # produced by kernels still running when the averaging starts
    handle = collective.mean_([tensor], async_op=True)
    # memory of a staging buffer freed before its collective is done would be handed out here, and overwritten
    churn = [torch.full((2**17,), float("nan"), device=DEVICE) for _ in range(64)]
    del churn
    handle.wait()
    assert torch.equal(tensor, sum(products) / world_size)


def test_an_async_averaging_on_the_gpu_averages_the_values_at_launch():
    run_workers(_async_average_reads_the_values_at_launch, 2)


def gpu_busy() -> None:
    """Queue ~20 ms of work on the current stream: a copy the host used before it was
    done would read stale memory."""
    if not DRY_RUN:
        torch.cuda._sleep(40_000_000)


def _drift(rank: int, step: int, shapes) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return [torch.randn(shape, generator=gen) for shape in shapes]


SHAPES = [(64, 48), (48,), (1000,), (7, 5)]


def _diloco_with_a_host_global_copy(rank, world_size, compressor):
    options = dict(sync_every=4, warmup_steps=1, delay=2, fragments=2)
    if compressor is not None:
        options.update(compressor=compressor)
    outer = puredist.sgd(lr=0.7, momentum=0.9, nesterov=True)
    on_host, on_device, on_gpu = (puredist.outer_optimizer(outer, global_device=g, **options) for g in ("cpu", None, DEVICE))
    collective = puredist.DistributedCollective()
    initial = _drift(-1, 0, SHAPES)
    runs = {  # name: (transform, params): the oracle is the whole run on the CPU
        "host copy": (on_host, [p.to(DEVICE, copy=True) for p in initial]),
        "on device": (on_device, [p.to(DEVICE, copy=True) for p in initial]),
        "gpu copy of host params": (on_gpu, [p.clone() for p in initial]),
        "cpu": (on_device, [p.clone() for p in initial]),
    }
    states = {name: transform.init(params) for name, (transform, params) in runs.items()}
    assert DRY_RUN or all(g.is_pinned() and g.device.type == "cpu" for g in states["host copy"].global_params)
    for step in range(14):
        for name, (transform, params) in runs.items():
            for p, d in zip(params, _drift(rank, step, SHAPES)):
                p.add_(d.to(p.device))
            gpu_busy()
            states[name] = transform.update_(params, states[name], collective=collective)
        oracle = runs["cpu"][1]
        for i, (host, device, gpu_copy, cpu) in enumerate(
            zip(runs["host copy"][1], runs["on device"][1], runs["gpu copy of host params"][1], oracle)
        ):
            if compressor is None or compressor.name.startswith("top"):
                # the same elementwise arithmetic on either device (top-k moves values, and halves them exactly),
                # the outer step on the host: bit for bit
                assert torch.equal(host.cpu(), cpu), f"step {step} leaf {i}"
            else:  # CUDA divides by a scalar through its reciprocal: a scale's last bit, then a level, may differ
                torch.testing.assert_close(host.cpu(), cpu, rtol=0, atol=0.1)
            if compressor is None:  # the outer step on the GPU (fused multiply-adds) rounds differently
                torch.testing.assert_close(device.cpu(), cpu, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(gpu_copy, cpu, rtol=1e-5, atol=1e-5)
    assert not torch.equal(oracle[0], initial[0])


@pytest.mark.parametrize("compressor", [None, puredist.top_k(0.1), puredist.int8_blocks()], ids=["diloco", "top-k", "int8"])
def test_diloco_with_cuda_parameters_and_a_pinned_host_global_copy_equals_the_cpu_run(compressor):
    run_workers(_diloco_with_a_host_global_copy, 2, compressor)


ZERO_OPTIMIZERS = [
    (torch.optim.Adam, puredist.adam, dict(lr=0.01, fused=True)),
    (torch.optim.AdamW, puredist.adamw, dict(lr=0.01, weight_decay=0.1, amsgrad=True, fused=True)),
    (torch.optim.SGD, puredist.sgd, dict(lr=0.05, momentum=0.9, fused=True)),
    (torch.optim.Adam, puredist.adam, dict(lr=0.01)),  # torch's default on CUDA: foreach
]


def _zero_on_the_gpu(rank, world_size):
    collective = puredist.DistributedCollective()
    for torch_class, functional, kwargs in ZERO_OPTIMIZERS:
        gen = torch.Generator().manual_seed(0)  # the same gradients on every rank: already averaged
        params = [torch.randn(shape, generator=gen).to(DEVICE) for shape in SHAPES]
        reference = [p.clone().requires_grad_() for p in params]
        torch_optimizer = torch_class(reference, **kwargs)
        sharded = puredist.zero(functional(**kwargs))
        state = sharded.init(params, plan=puredist.plan_zero([p.numel() for p in params], world_size), rank=rank)
        assert {*state.plan.owners} == {0, 1}
        for _ in range(3):
            grads = [torch.randn(shape, generator=gen).to(DEVICE) for shape in SHAPES]
            for r, g in zip(reference, grads):
                r.grad = g.clone()
            torch_optimizer.step()
            state = sharded.update_(params, grads, state, collective=collective)
        for p, r in zip(params, reference):
            assert torch.equal(p, r.detach()), f"{torch_class.__name__} {kwargs}"


def test_the_zero_step_on_the_gpu_equals_torch_optim_bitwise_fused_included():
    run_workers(_zero_on_the_gpu, 2)


def _classic_zero_on_the_gpu(rank, world_size):
    """nn.Parameters (leaves that require grad): Gloo broadcasts a CUDA tensor through a
    host copy and writes the result back into the source as well, at ``wait``."""
    for torch_class, _, kwargs in ZERO_OPTIMIZERS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)).to(DEVICE)
        reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
        zero = classic.ZeroRedundancyOptimizer(model.parameters(), torch_class, **kwargs)
        plain = torch_class(reference, **kwargs)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p, r in zip(model.parameters(), reference):
                p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)
                r.grad = p.grad.clone()
            zero.step()
            plain.step()
        for p, r in zip(model.parameters(), reference):
            assert torch.equal(p, r), f"{torch_class.__name__} {kwargs}"


def test_the_classic_zero_optimizer_steps_cuda_parameters_over_gloo_as_torch_optim():
    run_workers(_classic_zero_on_the_gpu, 2)


def test_zero_overlapped_with_ddp_on_cuda_tensors_over_gloo_matches_ddp_with_the_plain_optimizer():
    combos = [(hook, True, False, True, name) for hook in HOOKS for name in OPTIMIZERS]
    run_workers(_parity, 2, combos, 0, DEVICE, timeout=180)


def _a_peer_dies_during_a_gpu_averaging(rank, world_size):
    tensors = [values(rank, i).to(DEVICE) for i in range(TENSORS)]
    if rank == 1:  # (killed a few ms into a bucket, it would be too late here: the GPU's buckets are that fast)
        fault_at_collective(2, how="die", when="before")
    # the host's cap: buckets of 16 MiB, several (a GPU's default would send these 64 MiB in one)
    collective = puredist.DistributedCollective(bucket_cap_bytes=puredist.DEFAULT_BUCKET_CAP_BYTES)
    try:
        puredist.average_(tensors, collective=collective)
    except puredist.CollectiveError as error:
        completed = assert_old_or_mean_as_reported([t.cpu() for t in tensors], error, rank, range(world_size))
        assert sum(completed) < TENSORS * NUMEL
        return completed
    raise AssertionError("averaging with a dead peer returned normally")


def test_a_peer_dying_during_a_gpu_averaging_leaves_old_values_or_means():
    completed = run_workers(_a_peer_dies_during_a_gpu_averaging, 2, victims=(1,), timeout=60, gloo_timeout=10)[0]
    assert completed is not None


def _mismatched_gpu_tensors(rank, world_size):
    tensors = [torch.ones(4 + rank, device=DEVICE) * rank]
    with pytest.raises(puredist.RankMismatchError, match="different tensors"):
        puredist.average_(tensors, collective=puredist.DistributedCollective())
    assert torch.equal(tensors[0], torch.ones(4 + rank, device=DEVICE) * rank)


def test_ranks_passing_different_gpu_tensors_all_raise_and_nothing_changes():
    run_workers(_mismatched_gpu_tensors, 2)


def _nccl_paths_without_host_sync(rank, world_size, backend):
    collective = puredist.DistributedCollective(bucket_cap_bytes=64 * 1024)
    group = collective.process_group
    assert dist.get_backend(group) == backend
    assert "gloo" in dist.get_backend(host_group(group))  # the rank check never touches the GPU
    launched = []
    all_reduce = dist.all_reduce

    def recording(tensor, op=dist.ReduceOp.SUM, **kwargs):
        launched.append((tensor.device.type, tensor.dtype, op))
        return all_reduce(tensor, op=op, **kwargs)

    mixed_devices = "," in backend  # then also a CPU tensor, reduced by the group's Gloo
    tensors = mixed_params(0, DEVICE) + ([torch.ones(10)] if mixed_devices else [])
    before = [t.clone() for t in tensors]
    dist.all_reduce(torch.zeros(1, device=DEVICE))  # NCCL makes its communicator at the first collective, once
    dist.all_reduce = recording
    try:  # mean_ skips one rank's averaging: its body, run at one rank (what two ranks run)
        with host_syncs() as syncs:
            given = checked(tensors)  # as mean_ passes them (complex ones reduced as real views)
            collective._average_over(group, given, async_op=False, context="blocking")
            collective._average_over(group, given, async_op=True, context="async").wait()
    finally:
        dist.all_reduce = all_reduce
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))  # the mean of one rank
    public_syncs = _public_paths_synchronizations(rank, world_size, collective)
    assert not syncs and not public_syncs, (syncs, public_syncs)
    native = dist.ReduceOp.SUM if DRY_RUN else dist.ReduceOp.AVG
    assert {(device, dtype): op for device, dtype, op in launched} == {
        (DEVICE, torch.float32): native,
        # fp16 and bf16 divide first (their largest values are below fp32's: a sum could overflow)
        (DEVICE, torch.float16): dist.ReduceOp.SUM, (DEVICE, torch.bfloat16): dist.ReduceOp.SUM,
    } | ({("cpu", torch.float32): dist.ReduceOp.SUM} if mixed_devices else {})


def _public_paths_synchronizations(rank, world_size, collective) -> list[str]:
    """The host synchronizations of averaging, the averagers, DiLoCo, an optimizer and
    ZeRO, from the second step on (DiLoCo's first checks, once, that the initial
    parameters are replicated: it reads them back)."""
    params = [p.to(DEVICE) for p in _drift(-1, 0, SHAPES)]
    averager = puredist.periodic_averager(2)
    diloco = puredist.outer_optimizer(puredist.sgd(lr=0.7, momentum=0.9, nesterov=True), sync_every=3, delay=1)
    adam = puredist.adam(lr=0.01)
    sharded = puredist.zero(puredist.adamw(lr=0.01, fused=True))
    states = [averager.init(), diloco.init(params), adam.init(params),
              sharded.init(params, plan=puredist.plan_zero([p.numel() for p in params], world_size), rank=rank)]
    states[1] = diloco.update_(params, states[1], collective=collective)
    syncs = []
    for step in range(8):
        grads = [g.to(DEVICE) for g in _drift(rank, step, SHAPES)]
        with host_syncs() as found:
            puredist.average_(params, collective=collective)
            states[0] = averager.update_(params, states[0], collective=collective)
            states[1] = diloco.update_(params, states[1], collective=collective)
            states[2] = adam.update_(params, grads, states[2])
            states[3] = sharded.update_(params, grads, states[3], collective=collective)
        syncs += found
    assert states[1].step == 9 and states[3].step == 8
    return sorted(set(syncs))


@pytest.mark.parametrize("backend", [ONE_RANK_BACKEND, "cpu:gloo,cuda:nccl"], ids=["nccl", "gloo+nccl"])
def test_nccl_averages_with_its_native_mean_and_no_host_synchronization(backend):
    if DRY_RUN and "," in backend:
        pytest.skip("a CPU build has no NCCL")
    run_workers(_nccl_paths_without_host_sync, 1, backend, backend=backend)


def _public_paths_over_gloo(rank, world_size):
    return _public_paths_synchronizations(rank, world_size, puredist.DistributedCollective())


def test_the_public_paths_on_cuda_tensors_over_gloo_make_no_host_synchronization_of_their_own():
    # at two ranks the averagings, the rank checks and ZeRO's broadcasts run (Gloo's own threads may wait)
    for syncs in run_workers(_public_paths_over_gloo, 2):
        assert not syncs, syncs


def _host_copy_waits_once_per_synchronization(rank, world_size):
    sync_every, warmup, delay, fragments = 4, 1, 1, 2
    transform = puredist.outer_optimizer(
        puredist.sgd(lr=0.7, momentum=0.9, nesterov=True),
        sync_every=sync_every, warmup_steps=warmup, delay=delay, fragments=fragments, global_device="cpu",
    )
    collective = puredist.DistributedCollective()
    initial = _drift(-1, 0, SHAPES)
    params, oracle = [p.to(DEVICE) for p in initial], [p.clone() for p in initial]
    state, oracle_state = transform.init(params), transform.init(oracle)
    applying = {  # the steps at which some fragment's synchronization is applied
        warmup + f * sync_every // fragments + n * sync_every + delay for f in range(fragments) for n in range(10)
    }
    waits = []
    for step in range(16):
        for p, q, d in zip(params, oracle, _drift(rank, step, SHAPES)):
            p.add_(d.to(DEVICE))
            q.add_(d)
        gpu_busy()
        with host_syncs() as syncs:
            state = transform.update_(params, state, collective=collective)
        oracle_state = transform.update_(oracle, oracle_state, collective=collective)
        waits.append(len(syncs))
        assert all(torch.equal(p.cpu(), q) for p, q in zip(params, oracle)), f"step {step}"
    if not DRY_RUN:
        assert waits[1:] == [int(step in applying) for step in range(1, 16)], waits  # step 0: the initial check


def test_a_pinned_host_global_copy_waits_for_the_gpu_once_per_applied_synchronization():
    run_workers(_host_copy_waits_once_per_synchronization, 1, backend=ONE_RANK_BACKEND)


OPTIMIZER_CASES = [
    (torch.optim.SGD, puredist.sgd, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.SGD, puredist.sgd, dict(lr=0.1, maximize=True)),
    (torch.optim.Adam, puredist.adam, dict(lr=0.01, amsgrad=True)),
    (torch.optim.Adam, puredist.adam, dict(lr=0.01, weight_decay=0.1, maximize=True)),
    (torch.optim.AdamW, puredist.adamw, dict(lr=0.01, weight_decay=0.01)),
]
KERNELS = [dict(), dict(foreach=False), dict(foreach=True), dict(fused=True)]


def _optimizers_on_the_gpu(rank, world_size):
    cases = [(c, f, {**kw, **k}, dtype) for c, f, kw in OPTIMIZER_CASES for k in KERNELS
             for dtype in (torch.float32, torch.bfloat16)]
    cases += [(torch.optim.Adam, puredist.adam, dict(lr=0.01, **k), torch.complex64) for k in KERNELS[:3]]
    for torch_class, functional, kwargs, dtype in cases:
        if DRY_RUN and torch_class is torch.optim.SGD and kwargs.get("fused") and dtype == torch.bfloat16:
            continue  # torch's CPU fused SGD leaves uninitialized memory in a bf16 momentum buffer
        gen = torch.Generator().manual_seed(0)
        params = [torch.randn(shape, generator=gen, dtype=dtype).to(DEVICE) for shape in SHAPES]
        reference = [p.clone().requires_grad_() for p in params]
        torch_optimizer = torch_class(reference, **kwargs)
        optimizer = functional(**kwargs)
        state = optimizer.init(params)
        for _ in range(3):
            grads = [torch.randn(shape, generator=gen, dtype=dtype).to(DEVICE) for shape in SHAPES]
            for r, g in zip(reference, grads):
                r.grad = g.clone()
            torch_optimizer.step()
            state = optimizer.update_(params, grads, state)
        label = f"{torch_class.__name__} {kwargs} {dtype}"
        assert all(torch.equal(p, r.detach()) for p, r in zip(params, reference)), label
        for ours, theirs in zip(state, (torch_optimizer.state[r] for r in reference)):
            for field, value in ours._asdict().items():
                if value is not None:
                    assert torch.equal(value, theirs[field]) and value.device == theirs[field].device, (label, field)


def test_the_functional_optimizers_on_the_gpu_equal_torch_optim_bitwise_with_every_kernel():
    run_workers(_optimizers_on_the_gpu, 1)


GPU_ALGORITHMS = ("ddp", "periodic", "zero", "diloco", "diloco_int8")


def test_the_main_job_trains_on_the_gpu_as_on_the_cpu(tmp_path):
    """``python -m puredist demo --device cuda``: two workers (NCCL with a GPU each,
    else both on GPU 0 over Gloo) train every algorithm that runs on a GPU, the output
    names the GPU, and each held-out loss is the CPU run's within 2 % (the same seeds
    and minibatches; only the kernels' rounding differs, over 40 steps)."""
    from test_demo import run_demo

    options = ("--world-size", "2", "--steps", "40", "--algorithms", ",".join(GPU_ALGORITHMS))
    done, on_gpu = run_demo(tmp_path / "gpu", "--device", DEVICE, *options, timeout=600)
    _, on_cpu = run_demo(tmp_path / "cpu", "--device", "cpu", *options, timeout=600)
    assert DRY_RUN or " GPU" in done.stdout.splitlines()[0], done.stdout
    for algorithm in GPU_ALGORITHMS:
        assert on_gpu[algorithm]["eval_accuracy"] > 0.5, algorithm
        assert on_gpu[algorithm]["eval_loss"] == pytest.approx(on_cpu[algorithm]["eval_loss"], rel=0.02), algorithm


def _post_local_sgd_checkpoint_over_nccl(rank, world_size):
    from puredist.classic import PeriodicModelAverager, PostLocalSGDOptimizer

    model = torch.nn.Linear(4, 3).to(DEVICE)
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      PeriodicModelAverager(period=2, warmup_steps=0))
    model(torch.ones(2, 4, device=DEVICE)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    optimizer.load_state_dict(saved)
    model(torch.ones(2, 4, device=DEVICE)).sum().backward()
    optimizer.step()  # the first step after a load checks the ranks' own states, over a group that takes its tensor
    return optimizer.averager.step


def test_post_local_sgd_loads_its_checkpoint_under_a_device_only_default_group():
    # an NCCL default group has no CPU backend: torch.distributed refuses a CPU tensor there
    assert run_workers(_post_local_sgd_checkpoint_over_nccl, 1, backend=ONE_RANK_BACKEND) == [2]
