"""One worker of the demo: train a task (:mod:`puredist.demo.digits` or
:mod:`puredist.demo.charlm`) under each algorithm in turn.

Every worker trains on its own shard of the training data, with the task's inner
optimizer (SGD with momentum for digits, AdamW for the language model). Runs by
algorithm (``H`` is the task's period: 8 for digits, 16 for the language model):

- ``ddp``: DDP + the ``torch.optim`` optimizer, gradients all-reduced every step (baseline).
- ``periodic``: post-local SGD in the functional style: ``torch.func`` gradients, the
  :mod:`puredist.optim` optimizer over explicit state, :func:`puredist.periodic_averager`
  (every ``H`` steps).
- ``hierarchical``: the same with :func:`puredist.hierarchical_averager` (pairs every
  ``H/4`` steps, everybody every ``H``).
- ``zero``: DDP + :class:`puredist.classic.ZeroRedundancyOptimizer` overlapped with
  the backward through :func:`puredist.classic.hook_with_zero_step_interleaved`.
- ``diloco``: :func:`puredist.outer_optimizer` with DiLoCo's outer Nesterov SGD
  (lr 0.7, momentum 0.9, :mod:`puredist.demo.knobs`) every ``H`` steps, bf16 pseudo-gradients.
- ``streaming``: Streaming DiLoCo: the same in 2 fragments synchronizing ``H/2``
  steps apart, each applied 2 steps after it starts (communication overlapped
  with local steps), bf16.
- ``diloco_int8``, ``diloco_int4``, ``diloco_int2``: ``diloco`` with int8, 4-bit or 2-bit
  block-quantized pseudo-gradients (blocks of 64 by default) and error feedback
  (:mod:`puredist.compression`).
- ``diloco_sparse``: SparseLoCo's recipe: each rank's 64 largest values of each chunk of
  4096 (:func:`puredist.chunked_top_k`: 2 bits of value, 1/146 of fp32's bytes) with error
  feedback in place of the outer momentum, gathered by every rank; outer SGD at lr 1.5
  without momentum (:data:`puredist.demo.knobs.SPARSE_OUTER_OPTIONS`).

Bytes sent are measured, not estimated (:mod:`puredist.demo.wire`: what Gloo's
threads wrote to their sockets), step by step; evaluations are left out, and before
each one a barrier lets the synchronizations in flight (streaming DiLoCo's) finish, so
that their bytes count where they were sent (the barrier's own bytes, measured once
before training, are not counted). The model
evaluated (held-out loss and accuracy) is the average of the workers' models,
computed with the pure :func:`puredist.average` (training is undisturbed). The
optimizer state each worker holds is counted in bytes (ZeRO: only its shard).

This module must not report: it returns what it measured to the launcher.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from contextlib import contextmanager
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.func import functional_call, grad_and_value
from torch.nn.parallel import DistributedDataParallel as DDP

import puredist
from puredist.classic import ZeroRedundancyOptimizer, hook_with_zero_step_interleaved
from puredist.demo import charlm, digits
from puredist.demo.knobs import Knobs, block_size, knobs_task, outer_options, top_k
from puredist.demo.task import Task, cross_entropy, held_out
from puredist.demo.wire import bytes_written
from puredist.tree import tree_leaves

ALGORITHMS = (
    "ddp", "periodic", "hierarchical", "zero", "diloco", "streaming", "diloco_int8", "diloco_int4", "diloco_int2",
    "diloco_sparse",
)
TASKS = {task.name: task for task in (digits.TASK, charlm.TASK, charlm.LARGE_TASK)}
TORCH_OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}
"""The ``torch.optim`` class of each :attr:`Task.optimizer` (DDP and ZeRO use it)."""
STREAMING_FRAGMENTS = 2
STREAMING_DELAY = 2


def progress_bar(algorithm: str, steps: int, enabled: bool):
    """tqdm's bar on stdout (on a terminal redrawn in place, elsewhere a few lines)."""
    from tqdm import tqdm

    tqdm.monitor_interval = 0  # no monitor thread: the bytes counted are those of threads other than the main one
    return tqdm(total=steps, desc=f"  {algorithm:13s}", file=sys.stdout, disable=not enabled,
                mininterval=0.5 if sys.stdout.isatty() else 5.0, ncols=80, leave=True)


def tensor_bytes(tree) -> int:
    """Bytes of the tensors in a pytree (an optimizer's state)."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def _ddp_step(model: DDP, optimizer, inputs, targets) -> float:
    optimizer.zero_grad()
    loss = cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.item()


def _setup_ddp(task: Task, model: nn.Module, collective, world_size: int):
    ddp = DDP(model)
    optimizer = TORCH_OPTIMIZERS[task.optimizer](ddp.parameters(), **task.optimizer_options)
    state = lambda: [list(s.values()) for s in optimizer.state.values()]  # noqa: E731
    return ddp, lambda x, y: _ddp_step(ddp, optimizer, x, y), lambda: dict(ddp.module.named_parameters()), state


def _setup_zero(task: Task, model: nn.Module, collective, world_size: int):
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), TORCH_OPTIMIZERS[task.optimizer], overlap_with_ddp=True,
        **task.optimizer_options,
    )
    # these models fit one DDP bucket: shard it, or one rank would own everything
    ddp.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, ddp, zero, shard_buckets=True))

    def step(inputs, targets) -> float:
        zero.zero_grad()
        loss = cross_entropy(ddp(inputs), targets)
        loss.backward()  # the ZeRO step runs inside
        return loss.item()

    state = lambda: [list(s.values()) for s in zero.optim.state.values()]  # noqa: E731 - this rank's shard
    return ddp, step, lambda: dict(ddp.module.named_parameters()), state


def hierarchy_for(world_size: int, period: int) -> dict[int, int]:
    """Pairs average every ``period // 4`` steps and everybody every ``period`` (a
    single level when the world cannot be cut into pairs)."""
    if world_size > 2 and world_size % 2 == 0:
        return {max(1, period // 4): 2, period: world_size}
    return {period: world_size}


def _setup_functional(averager: puredist.Averager | puredist.OuterTransform, collective):
    def setup(task: Task, model: nn.Module, _, world_size: int):
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
        optimizer = getattr(puredist, task.optimizer)(**task.optimizer_options)
        state = {"optimizer": optimizer.init(params), "averager": averager.init(params)}

        # torch.func's first transform in a process costs seconds of one-time set-up (1.6 s here, in the first
        # step of the first functional run): paid here, before the timed steps
        grad_and_value(lambda x: x.sum())(torch.zeros(1))

        def loss_fn(p, inputs, targets):
            return cross_entropy(functional_call(model, p, (inputs,)), targets)

        def step(inputs, targets) -> float:
            grads, loss = grad_and_value(loss_fn)(params, inputs, targets)
            state["optimizer"] = optimizer.update_(params, grads, state["optimizer"])
            state["averager"] = averager.update_(params, state["averager"], collective=collective)
            return loss.item()

        return model, step, lambda: params, lambda: state  # DiLoCo: inner and outer state, global copy

    return setup


def job_task(config: dict[str, Any]) -> tuple[Task, Knobs]:
    """The task a job trains, with its knobs (``config["knobs"]``, as :class:`Knobs`'
    fields; none: the task's own values) applied, and the knobs."""
    knobs = Knobs(*config.get("knobs", ()))
    return knobs_task(TASKS[config["task"]], knobs), knobs


_DILOCO_OPTIONS: dict[str, Callable[[Knobs], dict[str, Any]]] = {
    "diloco": lambda knobs: {"comm_dtype": torch.bfloat16},
    "streaming": lambda knobs: {"comm_dtype": torch.bfloat16, "fragments": STREAMING_FRAGMENTS, "delay": STREAMING_DELAY},
    "diloco_int8": lambda knobs: {"compressor": puredist.int8_blocks(block_size(knobs))},
    "diloco_int4": lambda knobs: {"compressor": puredist.int4_blocks(block_size(knobs))},
    "diloco_int2": lambda knobs: {"compressor": puredist.int2_blocks(block_size(knobs))},
    "diloco_sparse": lambda knobs: {"compressor": puredist.chunked_top_k(top_k(knobs))},
}
"""The options of each DiLoCo variant's :func:`puredist.outer_optimizer`, besides the task's period and warm-up."""


def transform(task: Task, knobs: Knobs, world_size: int, algorithm: str):
    """The pure averager or DiLoCo transform ``algorithm`` trains with (``None`` for
    ``ddp`` and ``zero``: torch's classes), built, so checked by puredist's own rules:
    ``ValueError`` or ``TypeError`` for options it cannot run with. Touches no process
    group, so the launcher builds those of the algorithms asked for before any worker
    starts (:func:`refusal`)."""
    if algorithm == "periodic":
        return puredist.periodic_averager(task.period, task.warmup_steps)
    if algorithm == "hierarchical":
        return puredist.hierarchical_averager(hierarchy_for(world_size, task.period), task.warmup_steps)
    if algorithm in _DILOCO_OPTIONS:
        outer = puredist.sgd(**outer_options(knobs, task, sparse=algorithm == "diloco_sparse"))
        return puredist.outer_optimizer(outer, sync_every=task.period, warmup_steps=task.warmup_steps,
                                        **_DILOCO_OPTIONS[algorithm](knobs))
    return None


def refusal(task: Task, knobs: Knobs, world_size: int, algorithms: list[str]) -> str | None:
    """Why one of ``algorithms`` cannot run with these options (``task`` with ``knobs``
    applied), in one line naming it, the options and puredist's reason; or ``None``.
    Each algorithm's transform is built as its workers would build it (their warnings
    are theirs to print), the others not at all."""
    for algorithm in algorithms:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                transform(task, knobs, world_size, algorithm)
        except (TypeError, ValueError) as error:
            return (f"--algorithms {algorithm} cannot run with --sync-every {task.period} and --warmup-steps "
                    f"{task.warmup_steps} ({str(error).splitlines()[0]}): change them, or leave {algorithm} out")
    return None


def _setup(task: Task, knobs: Knobs, world_size: int, algorithm: str, collective) -> Callable:
    """``algorithm``'s setup, only its own built (the hierarchical averager's subgroups
    are made, a collective of every rank, only where it runs)."""
    if algorithm in ("ddp", "zero"):
        return _setup_ddp if algorithm == "ddp" else _setup_zero
    if algorithm == "hierarchical":
        collective = puredist.DistributedCollective.with_subgroups(list(hierarchy_for(world_size, task.period).values()))
    return _setup_functional(transform(task, knobs, world_size, algorithm), collective)


def train(task: Task, algorithm: str, config: dict[str, Any], knobs: Knobs = Knobs()) -> dict[str, Any]:
    """Train one run on this rank (``task`` with ``knobs`` applied, :func:`job_task`);
    return its curves, per-step measurements and totals (``training_s``: at each
    evaluation, the seconds since the start less those spent evaluating)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if config.get("device") == "cuda" else torch.device("cpu")
    shard, test = task.load(config["seed"], rank, world_size)
    test = tuple(t.to(device) for t in test)
    collective = puredist.DistributedCollective()
    setup = _setup(task, knobs, world_size, algorithm, collective)
    model, step, current_params, optimizer_state = setup(
        task, task.make_model(config["seed"]).to(device), collective, world_size
    )
    batches = torch.Generator().manual_seed(config["seed"] * 1000 + rank)
    steps, eval_every = config["steps"], max(1, config["steps"] // 15)
    losses, evaluations, step_seconds, step_bytes, training_s = [], [], [], [], []
    evaluating_s = 0.0  # time spent evaluating: not training
    mark = bytes_written()
    dist.barrier()
    barrier_bytes = bytes_written() - mark  # what a barrier itself writes: not the algorithm's
    started = time.perf_counter()
    mark = bytes_written()  # bytes are counted from step to step; only evaluations are left out
    with progress_bar(algorithm, steps, enabled=rank == 0) as bar:
        for k in range(1, steps + 1):
            inputs, targets = (t.to(device, non_blocking=True) for t in task.sample(shard, batches))
            step_started = time.perf_counter()
            losses.append(step(inputs, targets))
            step_seconds.append(time.perf_counter() - step_started)
            evaluating = k % eval_every == 0 or k == steps
            if evaluating:
                dist.barrier()  # Gloo's barrier waits for this rank's synchronizations in flight: their bytes count
            now = bytes_written()
            step_bytes.append(max(0, now - mark - (barrier_bytes if evaluating else 0)))
            mark = now
            if evaluating:
                evaluation_started = time.perf_counter()
                training_s.append(evaluation_started - started - evaluating_s)
                # evaluate the averaged model; puredist.average is pure: training is undisturbed
                averaged = puredist.average(
                    {n: t.detach() for n, t in current_params().items()}, collective=collective
                )
                loss, accuracy = held_out(model.module if isinstance(model, DDP) else model, averaged, test)
                evaluations.append((k, accuracy, loss, sum(step_bytes)))
                bar.set_postfix_str(f"held-out loss {loss:.3f}", refresh=False)
                mark = bytes_written()
                evaluating_s += time.perf_counter() - evaluation_started
            bar.update()
    wall = time.perf_counter() - started
    result = {"losses": losses, "evaluations": evaluations, "bytes_sent": sum(step_bytes), "wall_s": wall,
              "training_s": training_s,
              "step_seconds": step_seconds, "step_bytes": step_bytes, "state_bytes": tensor_bytes(optimizer_state())}
    # for the network model: the steps of compute a synchronization's bytes can travel behind (streaming
    # DiLoCo applies a fragment STREAMING_DELAY steps after it starts; the others wait for their bytes)
    result["overlap_steps"] = STREAMING_DELAY if algorithm == "streaming" else 0
    if algorithm == "hierarchical":  # for the network model: a pair step's all-reduce spans 2 workers, not all
        result["step_group_sizes"] = hierarchical_group_sizes(hierarchy_for(world_size, task.period), task.warmup_steps,
                                                              steps)
    return result


def hierarchical_group_sizes(hierarchy: dict[int, int], warmup_steps: int, steps: int) -> list[int | None]:
    """For steps ``1..steps`` of a run, the group size the hierarchical averager
    averages over at that step (its schedule at its own count, ``step - 1``), or
    ``None`` where it does not average."""
    level, sizes = puredist.hierarchical_schedule(tuple(hierarchy), warmup_steps), list(hierarchy.values())
    return [None if level(k - 1) is None else sizes[level(k - 1)] for k in range(1, steps + 1)]


@contextmanager
def process_group(config: dict[str, Any]):
    """This worker's process group for the ``with`` block (one thread for torch; on
    ``cuda`` a GPU per worker with NCCL, else every worker on GPU 0); a barrier at the
    end of a block that ran through (an interrupted peer never comes to it), then the
    group is destroyed however the block ends."""
    torch.set_num_threads(1)
    if config.get("device") == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) if "nccl" in config["backend"] else 0)
    dist.init_process_group(config.get("backend", "gloo"))
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def worker_main(config: dict[str, Any]) -> dict[str, Any]:
    """Entry point of each worker process (started by torch's elastic launcher)."""
    with process_group(config):
        task, knobs = job_task(config)
        results = {algorithm: train(task, algorithm, config, knobs) for algorithm in config["algorithms"]}
    return results
