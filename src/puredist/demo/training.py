"""One worker of the demo: train a small MLP on scikit-learn's handwritten digits
(shipped inside the package, nothing downloaded) under each algorithm in turn.

Every worker trains on its own shard of the training set. Runs by algorithm:

- ``ddp``: DDP + ``torch.optim.SGD``, gradients all-reduced every step (baseline).
- ``periodic``: post-local SGD in the functional style: ``torch.func`` gradients,
  :func:`puredist.sgd` over explicit state, :func:`puredist.periodic_averager`.
- ``hierarchical``: the same with :func:`puredist.hierarchical_averager` (pairs
  average often, everybody rarely).
- ``zero``: DDP + :class:`puredist.classic.ZeroRedundancyOptimizer` overlapped with
  the backward through :func:`puredist.classic.hook_with_zero_step_interleaved`.
- ``diloco``: :func:`puredist.outer_optimizer` with DiLoCo's outer Nesterov SGD
  (lr 0.7, momentum 0.9) every 8 steps, bf16 pseudo-gradients.
- ``diloco_int4``, ``diloco_topk``: the same with 4-bit block-quantized (blocks of
  64) or top-1 % pseudo-gradients and error feedback (:mod:`puredist.compression`).

Bytes sent are measured, not estimated: the growth of this process's ``wchar``
(``/proc/self/io``: every byte handed to ``write``/``send``, by every thread, Gloo's
included) over the training steps only; evaluation and logging are left out. The
model evaluated (held-out loss and accuracy) is the average of the workers' models,
computed with the pure :func:`puredist.average` (training is undisturbed). The
optimizer state each worker holds is counted in bytes (ZeRO: only its shard).
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.func import functional_call, grad_and_value
from torch.nn.parallel import DistributedDataParallel as DDP

import puredist
from puredist.tree import tree_leaves
from puredist.classic import ZeroRedundancyOptimizer, hook_with_zero_step_interleaved

ALGORITHMS = ("ddp", "periodic", "hierarchical", "zero", "diloco", "diloco_int4", "diloco_topk")
LEARNING_RATE = 0.05
MOMENTUM = 0.9
BATCH_SIZE = 32
PERIOD = 8
WARMUP_STEPS = 16


def load_digits_shards(seed: int, rank: int, world_size: int):
    """This rank's training shard and the common held-out set (20 %), as tensors."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    features = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    held_out = len(labels) // 5
    test, train = order[:held_out], order[held_out:]
    mine = train[rank::world_size]
    return (features[mine], labels[mine]), (features[test], labels[test])


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


def bytes_written() -> int:
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


class ByteMeter:
    """Bytes this process wrote while inside :meth:`counting`."""

    def __init__(self) -> None:
        self.total = 0

    @contextmanager
    def counting(self):
        start = bytes_written()
        try:
            yield
        finally:
            self.total += bytes_written() - start


def progress_bar(algorithm: str, steps: int, enabled: bool):
    """tqdm's bar on stdout (on a terminal redrawn in place, elsewhere a few lines)."""
    from tqdm import tqdm

    return tqdm(total=steps, desc=f"  {algorithm:13s}", file=sys.stdout, disable=not enabled,
                mininterval=0.5 if sys.stdout.isatty() else 5.0, ncols=80, leave=True)


def held_out(model: nn.Module, params: dict[str, torch.Tensor], test) -> tuple[float, float]:
    """``(cross-entropy loss, accuracy)`` of ``params`` on the held-out set."""
    features, labels = test
    with torch.no_grad():
        logits = functional_call(model, params, (features,))
    loss = nn.functional.cross_entropy(logits, labels).item()
    return loss, (logits.argmax(dim=1) == labels).float().mean().item()


def tensor_bytes(tree) -> int:
    """Bytes of the tensors in a pytree (an optimizer's state)."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def _ddp_step(model: DDP, optimizer, features, labels) -> float:
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(features), labels)
    loss.backward()
    optimizer.step()
    return loss.item()


def _setup_ddp(model: nn.Module, collective, world_size: int):
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    state = lambda: [list(s.values()) for s in optimizer.state.values()]  # noqa: E731
    return ddp, lambda x, y: _ddp_step(ddp, optimizer, x, y), lambda: dict(ddp.module.named_parameters()), state


def _setup_zero(model: nn.Module, collective, world_size: int):
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=LEARNING_RATE, momentum=MOMENTUM
    )
    # this model fits one DDP bucket: shard it, or one rank would own everything
    ddp.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, ddp, zero, shard_buckets=True))

    def step(features, labels) -> float:
        zero.zero_grad()
        loss = nn.functional.cross_entropy(ddp(features), labels)
        loss.backward()  # the ZeRO step runs inside
        return loss.item()

    state = lambda: [list(s.values()) for s in zero.optim.state.values()]  # noqa: E731 - this rank's shard
    return ddp, step, lambda: dict(ddp.module.named_parameters()), state


def hierarchy_for(world_size: int) -> dict[int, int]:
    """Pairs average every 2 steps and everybody every 8 (a single level when the
    world cannot be cut into pairs)."""
    if world_size > 2 and world_size % 2 == 0:
        return {2: 2, PERIOD: world_size}
    return {PERIOD: world_size}


def _setup_functional(averager: puredist.Averager | puredist.OuterTransform, collective):
    def setup(model: nn.Module, _, world_size: int):
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
        optimizer = puredist.sgd(lr=LEARNING_RATE, momentum=MOMENTUM)
        state = {"optimizer": optimizer.init(params), "averager": averager.init(params)}

        def loss_fn(p, features, labels):
            return nn.functional.cross_entropy(functional_call(model, p, (features,)), labels)

        def step(features, labels) -> float:
            grads, loss = grad_and_value(loss_fn)(params, features, labels)
            state["optimizer"] = optimizer.update_(params, grads, state["optimizer"])
            state["averager"] = averager.update_(params, state["averager"], collective=collective)
            return loss.item()

        return model, step, lambda: params, lambda: state  # DiLoCo: inner and outer state, global copy

    return setup


def train(algorithm: str, config: dict[str, Any]) -> dict[str, Any]:
    """Train one run on this rank; return its curves and totals."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    (features, labels), test = load_digits_shards(config["seed"], rank, world_size)
    collective = puredist.DistributedCollective()

    def diloco(**payload):
        return _setup_functional(
            puredist.outer_optimizer(
                puredist.sgd(lr=0.7, momentum=0.9, nesterov=True), sync_every=PERIOD, warmup_steps=WARMUP_STEPS, **payload
            ),
            collective,
        )

    setups: dict[str, Callable] = {
        "ddp": _setup_ddp,
        "zero": _setup_zero,
        "periodic": _setup_functional(puredist.periodic_averager(PERIOD, WARMUP_STEPS), collective),
        "diloco": diloco(comm_dtype=torch.bfloat16),
        "diloco_int4": diloco(compressor=puredist.int4_blocks(64)),
        "diloco_topk": diloco(compressor=puredist.top_k(0.01)),
        "hierarchical": _setup_functional(
            puredist.hierarchical_averager(hierarchy_for(world_size), WARMUP_STEPS),
            puredist.DistributedCollective.with_subgroups(list(hierarchy_for(world_size).values())),
        ),
    }
    model, step, current_params, optimizer_state = setups[algorithm](make_model(config["seed"]), collective, world_size)
    batches = torch.Generator().manual_seed(config["seed"] * 1000 + rank)
    meter = ByteMeter()
    steps, eval_every = config["steps"], max(1, config["steps"] // 15)
    losses, evaluations = [], []
    dist.barrier()
    started = time.perf_counter()
    with progress_bar(algorithm, steps, enabled=rank == 0) as bar:
        for k in range(1, steps + 1):
            batch = torch.randint(len(labels), (BATCH_SIZE,), generator=batches)
            with meter.counting():
                losses.append(step(features[batch], labels[batch]))
            if k % eval_every == 0 or k == steps:
                # evaluate the averaged model; puredist.average is pure: training is undisturbed
                averaged = puredist.average(
                    {n: t.detach() for n, t in current_params().items()}, collective=collective
                )
                loss, acc = held_out(model.module if isinstance(model, DDP) else model, averaged, test)
                evaluations.append((k, acc, loss, meter.total))
                bar.set_postfix_str(f"held-out loss {loss:.3f}", refresh=False)
            bar.update()
    wall = time.perf_counter() - started
    return {"losses": losses, "evaluations": evaluations, "bytes_sent": meter.total, "wall_s": wall,
            "state_bytes": tensor_bytes(optimizer_state())}


def worker_main(config: dict[str, Any]) -> dict[str, Any]:
    """Entry point of each worker process (started by torch's elastic launcher)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        results = {algorithm: train(algorithm, config) for algorithm in config["algorithms"]}
        dist.barrier()  # only on success: an interrupted peer never comes to it
        return results
    finally:
        dist.destroy_process_group()
