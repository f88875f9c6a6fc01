"""One worker of ``demo --islands``, started by its island's ``torchrun``:
``python -m puredist.demo.island_worker CONFIG ISLAND`` (the launcher writes CONFIG,
a JSON file; :func:`puredist.demo.island_run.launch`).

The worker enters its network namespace, takes the core of its place in the island
(worker ``j`` of every island on core ``j`` modulo the cores: every island gets the same
share of the machine, as islands of equal hardware would; else the faster island waits
for the slower one at each synchronization), joins the job's Gloo group over the
islands' links and trains each algorithm twice: unshaped (the inter-island links without a
rate) and shaped (at the job's rate). The ranks form an ``(island, inside)`` mesh
(torchrun numbers a node's workers consecutively: a row is an island). Algorithms, in
the island shape (``H`` the period, ``W`` the warm-up):

- ``ddp``: DDP over every worker, its gradient all-reduce crossing the slow link every
  step (the baseline);
- ``hierarchical``: local steps with :func:`puredist.hierarchical_averager`: the
  island's workers average every step (over their bridge), every worker every ``H``;
- ``diloco``, ``streaming``, ``diloco_int4``: the HSDP shape of
  ``examples/diloco_two_clusters.py``: DDP inside an island (its workers equal every
  step), :func:`puredist.outer_optimizer` across islands over
  ``DistributedCollective.from_mesh(mesh, "island")`` (each worker with the worker at
  its place in every other island): bf16 pseudo-gradients; streaming in fragments
  applied ``delay`` steps after they start; 4-bit payloads with error feedback.

Per step each worker records its duration and the time it was *blocked* on the slow
link: in a collective that spans islands (DDP: from its last gradient bucket being
ready to the end of the backward; hierarchical: the averaging of every worker; DiLoCo:
the outer update, which starts, waits for and applies synchronizations; and, before
an evaluation, the wait for those in flight, also recorded on its own). Its utilization is
``1 - blocked / training time``. The first worker of each island reads the bytes its
island's two link directions sent (``tc``'s counters, frames included) while training.
Evaluations (the held-out loss of every worker's averaged parameters) run with the
links unshaped and are not training time.

This module must not report: it writes per algorithm what it measured for the launcher.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.func import functional_call, grad_and_value
from torch.nn.parallel import DistributedDataParallel as DDP

import puredist
from puredist.demo import islands, links
from puredist.demo.knobs import Knobs, block_size, outer_options
from puredist.demo.task import Task, cross_entropy, held_out
from puredist.demo.training import TORCH_OPTIMIZERS, job_task, process_group, progress_bar
from puredist.demo.wire import bytes_written


class Setup(NamedTuple):
    """One algorithm ready to train on this worker.

    Attributes:
        model: the module (its parameters, or those of ``params``, define the model).
        step: ``(inputs, targets, k) -> (loss, blocked seconds, crossed)`` for step ``k``
            (1-based); ``crossed``: whether it started a collective spanning islands.
        params: ``() -> {name: tensor}``, the parameters to evaluate (this worker's).
        flush: ``() -> None``: wait for this worker's synchronizations in flight (a
            barrier of their process group: Gloo's waits for the work before it).
    """

    model: torch.nn.Module
    step: Callable[[torch.Tensor, torch.Tensor, int], tuple[float, float, bool]]
    params: Callable[[], dict[str, torch.Tensor]]
    flush: Callable[[], None] = lambda: None


def _ddp(task: Task, model: torch.nn.Module, mesh, options: dict, knobs: Knobs) -> Setup:
    ddp = DDP(model)
    optimizer = TORCH_OPTIMIZERS[task.optimizer](ddp.parameters(), **task.optimizer_options)
    ready = [0.0]

    def hook(state, bucket):  # the last bucket is ready when the backward's compute is done
        if bucket.is_last():
            ready[0] = time.perf_counter()
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)

    def step(inputs, targets, k):
        optimizer.zero_grad()
        loss = cross_entropy(ddp(inputs), targets)
        loss.backward()
        blocked = time.perf_counter() - ready[0]
        optimizer.step()
        return loss.item(), blocked, True

    return Setup(model, step, lambda: dict(model.named_parameters()))


def _hierarchical(task: Task, model: torch.nn.Module, mesh, options: dict, knobs: Knobs) -> Setup:
    world, inside = dist.get_world_size(), mesh.size(1)
    period, warmup = options["sync_every"], options["warmup_steps"]
    levels = {1: inside, period: world} if 1 < inside < world else {period: world}
    averager = puredist.hierarchical_averager(levels, warmup)
    level = puredist.hierarchical_schedule(tuple(levels), warmup)  # at the averager's own count, k - 1
    collective = puredist.DistributedCollective.with_subgroups(list(levels.values()))
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = getattr(puredist, task.optimizer)(**task.optimizer_options)
    state = {"optimizer": optimizer.init(params), "averager": averager.init(params)}
    grad_and_value(lambda x: x.sum())(torch.zeros(1))  # torch.func's one-time set-up, before the timed steps

    def loss_fn(p, inputs, targets):
        return cross_entropy(functional_call(model, p, (inputs,)), targets)

    def step(inputs, targets, k):
        grads, loss = grad_and_value(loss_fn)(params, inputs, targets)
        state["optimizer"] = optimizer.update_(params, grads, state["optimizer"])
        crossed = level(k - 1) == len(levels) - 1
        started = time.perf_counter()
        state["averager"] = averager.update_(params, state["averager"], collective=collective)
        return loss.item(), time.perf_counter() - started if crossed else 0.0, crossed

    return Setup(model, step, lambda: params)


DILOCO_VARIANTS: dict[str, Callable[[dict, Knobs], dict[str, Any]]] = {
    "diloco": lambda options, knobs: {"comm_dtype": torch.bfloat16},
    "streaming": lambda options, knobs: {"comm_dtype": torch.bfloat16, "fragments": options["fragments"],
                                         "delay": options["delay"]},
    "diloco_int4": lambda options, knobs: {"compressor": puredist.int4_blocks(block_size(knobs))},
}
"""Each DiLoCo variant's options of :func:`puredist.outer_optimizer` besides ``H`` and the warm-up."""


def diloco_transform(algorithm: str, task: Task, options: dict, knobs: Knobs):
    """The outer transform of DiLoCo variant ``algorithm`` (checked by puredist's own
    rules when built: the launcher builds it before any worker starts)."""
    return puredist.outer_optimizer(puredist.sgd(**outer_options(knobs, task)), sync_every=options["sync_every"],
                                    warmup_steps=options["warmup_steps"], **DILOCO_VARIANTS[algorithm](options, knobs))


def _diloco(algorithm: str) -> Callable[..., Setup]:
    def setup(task: Task, model: torch.nn.Module, mesh, options: dict, knobs: Knobs) -> Setup:
        from puredist.outer.config import OuterConfig
        from puredist.outer.timeline import due_fragments

        ddp = DDP(model, process_group=mesh.get_group("inside"))  # the island's workers stay equal
        optimizer = TORCH_OPTIMIZERS[task.optimizer](ddp.parameters(), **task.optimizer_options)
        transform = diloco_transform(algorithm, task, options, knobs)
        params = list(model.parameters())
        state = [transform.init(params)]
        across = puredist.DistributedCollective.from_mesh(mesh, "island")
        variant = DILOCO_VARIANTS[algorithm](options, knobs)
        timeline = OuterConfig(puredist.sgd(lr=1.0), options["sync_every"], options["warmup_steps"],
                               variant.get("delay", 0), variant.get("fragments", 1))

        def step(inputs, targets, k):
            optimizer.zero_grad()
            loss = cross_entropy(ddp(inputs), targets)
            loss.backward()
            optimizer.step()
            started = time.perf_counter()
            state[0] = transform.update_(params, state[0], collective=across)
            return loss.item(), time.perf_counter() - started, bool(due_fragments(timeline, k))

        return Setup(model, step, lambda: dict(model.named_parameters()),
                     lambda: dist.barrier(group=mesh.get_group("island")))

    return setup


SETUPS = {"ddp": _ddp, "hierarchical": _hierarchical, **{name: _diloco(name) for name in DILOCO_VARIANTS}}
"""How each of the islands' algorithms is set up on a worker."""
ALGORITHMS = tuple(SETUPS)


class _Links:
    """The island's two link directions as the first worker of an island sees them:
    it shapes them and counts their bytes while training; other workers do nothing."""

    def __init__(self, directions: list | None, rate: links.Rate | None) -> None:
        self.directions, self.rate = directions, rate
        self.sent = [0] * len(directions or [])
        self._mark = self.sent

    def shape(self, rate: links.Rate | None) -> None:
        if self.directions:
            islands.shape_island(self.directions, rate)
            self._mark = islands.link_bytes(self.directions)

    def pause(self) -> None:
        """Count what was sent since the last mark, then lift the rate (an evaluation follows)."""
        if self.directions:
            self.sent = [s + now - m for s, now, m in zip(self.sent, islands.link_bytes(self.directions), self._mark)]
        self.shape(None)

    def resume(self) -> None:
        self.shape(self.rate)


def _evaluate(setup: Setup, test, world) -> tuple[float, float]:
    averaged = puredist.average({n: t.detach() for n, t in setup.params().items()}, collective=world)
    return held_out(setup.model, averaged, test)


def train(task: Task, algorithm: str, config: dict, mesh, link: _Links, steps: int, knobs: Knobs) -> dict[str, Any]:
    """Train ``algorithm`` for ``steps`` steps on this worker; return its per-step
    durations and blocked times, the steps that crossed islands, its evaluations
    (``(step, accuracy, loss)``), its training time at each, the bytes its Gloo threads
    wrote and (first worker of an island) its island's link bytes."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shard, test = task.load(config["seed"], rank, world_size)
    setup = SETUPS[algorithm](task, task.make_model(config["seed"]), mesh, config["options"], knobs)
    world = puredist.DistributedCollective()
    batches = torch.Generator().manual_seed(config["seed"] * 1000 + rank)
    every, at = config["evaluate"] if steps > config["evaluate"][0] else (steps, 0)  # a short run: at its end
    record = {"step_s": [], "blocked_s": [], "crossed": [], "evaluations": [], "training_s": [],
              "evaluation_waits_s": []}
    link.resume()
    dist.barrier()
    evaluating_s, sent, started = 0.0, bytes_written(), time.perf_counter()
    with progress_bar(f"{algorithm} {link.rate.name if link.rate else 'unshaped'}", steps, enabled=rank == 0) as bar:
        for k in range(1, steps + 1):
            inputs, targets = task.sample(shard, batches)
            step_started = time.perf_counter()
            loss, blocked, crossed = setup.step(inputs, targets, k)
            record["step_s"].append(time.perf_counter() - step_started)
            if crossed:
                record["crossed"].append(k)
            if k % every == at or k == steps:
                flushed = time.perf_counter()
                setup.flush()  # the synchronizations in flight complete over the link: blocked
                record["evaluation_waits_s"].append(time.perf_counter() - flushed)
                blocked += record["evaluation_waits_s"][-1]
                mark = time.perf_counter()
                record["training_s"].append(mark - started - evaluating_s)
                sent -= bytes_written()
                dist.barrier()  # (waiting for the other workers here is the evaluation's, not training)
                link.pause()
                dist.barrier()
                record["evaluations"].append((k, *reversed(_evaluate(setup, test, world))))
                bar.set_postfix_str(f"held-out loss {record['evaluations'][-1][2]:.3f}", refresh=False)
                link.resume()
                dist.barrier()
                sent += bytes_written()
                evaluating_s += time.perf_counter() - mark
            record["blocked_s"].append(blocked)
            bar.update()
    link.pause()
    record.update(bytes_written=bytes_written() - sent, link_bytes=link.sent if link.directions else None)
    return record


def _mesh(config: dict, island: int):
    """The ``(island, inside)`` mesh; ``RuntimeError`` unless each row holds one island's workers."""
    from torch.distributed.device_mesh import init_device_mesh

    count, per_island = len(config["namespaces"]), len(config["namespaces"][0])
    mesh = init_device_mesh("cpu", (count, per_island), mesh_dim_names=("island", "inside"))
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, island)
    rows = [found[row * per_island:(row + 1) * per_island] for row in range(count)]
    if any(len(set(row)) != 1 for row in rows):
        raise RuntimeError(f"the ranks' islands {found} are not one island a row of the mesh")
    return mesh


def main(argv: list[str]) -> None:
    config, island = json.loads(Path(argv[0]).read_text()), int(argv[1])
    local = int(os.environ["LOCAL_RANK"])
    cores = sorted(os.sched_getaffinity(0))  # worker j of every island on the same core: islands of equal hardware
    os.sched_setaffinity(0, {cores[local % len(cores)]})
    links.enter(config["namespaces"][island][local])
    os.environ["GLOO_SOCKET_IFNAME"] = links.INTERFACE
    rate = links.Rate(*config["rate"])
    results: dict[str, dict[str, Any]] = {}
    with process_group(config):
        task, knobs = job_task(config)
        mesh = _mesh(config, island)
        directions = [tuple(d) for d in config["links"][island]] if local == 0 else None
        for algorithm in config["algorithms"]:
            for name, shaped in (("unshaped", None), ("shaped", rate)):
                link = _Links(directions, shaped)
                steps = config["steps"][algorithm][name]
                if steps == 0:  # (not asked for)
                    continue
                results.setdefault(algorithm, {})[name] = train(task, algorithm, config, mesh, link, steps, knobs)
        rank = dist.get_rank()
        parameters = sum(p.numel() for p in task.make_model(config["seed"]).parameters())
    out = Path(config["results"]) / f"rank{rank}.json"
    out.with_suffix(".tmp").write_text(json.dumps({"island": island, "local_rank": local, "parameters": parameters,
                                                      "algorithms": results}))
    out.with_suffix(".tmp").rename(out)


if __name__ == "__main__":
    main(sys.argv[1:])
