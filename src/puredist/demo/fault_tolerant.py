"""The demo's fault-tolerant algorithms, one replica group per worker over torchft,
surviving ``--kill-worker``: ``diloco_ft``, ``diloco`` (outer Nesterov SGD, bf16
pseudo-gradients, every ``H`` steps) made fault tolerant by :mod:`puredist.ft`; and,
for comparison, ``torchft_diloco``, torchft's own ``DiLoCo`` with the same optimizers
(:class:`_TorchftReplica`).

torch's elastic launcher, which runs the other algorithms, stops every worker when
one fails. Here the launcher process starts a torchft lighthouse and the workers
itself (spawned; each its own replica group, with a
:func:`puredist.ft.replica_manager`), plus, with ``--kill-worker STEP``, one warm
standby process. At STEP the last worker kills itself (``SIGKILL``, in the middle of
its training, between two synchronizations); the others go on without it. The
standby takes its place, as a scheduler restarting the worker would, without the
seconds of a fresh interpreter: it joins the next quorum, heals from a peer (step,
global copy, outer state; torchft's DiLoCo also the model and the inner optimizer's
state) and trains on to the end with fresh minibatches of the worker's shard.

Evaluations: at each evaluation step every worker sends its parameters to the
launcher through its pipe, and the launcher evaluates their average (of the workers
alive at that step), as :func:`puredist.demo.training.train` evaluates
``puredist.average``'s. Bytes are measured as there (:mod:`puredist.demo.wire`); the
pipe is written by the main thread, so evaluations send no counted bytes, while a
heal's transfer (torchft's HTTP server threads) and the managers' heartbeats count.

This module must not report: it returns per worker what ``train`` returns, with the
faults.
"""

from __future__ import annotations

import http.server
import io
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any

import torch
from torch.func import functional_call, grad_and_value

FAULT_TOLERANT = ("diloco_ft", "torchft_diloco")
"""The demo's algorithms that run over torchft (needs ``puredist[ft]``, CPU only);
``torchft_diloco`` (torchft's own DiLoCo) runs only when asked for, as a comparison."""
RUN_TIMEOUT_S = 1800.0
QUORUM_TIMEOUT = timedelta(seconds=300)
COLLECTIVE_TIMEOUT = timedelta(seconds=30)


def _to_bytes(params: dict[str, torch.Tensor]) -> bytes:
    """``params`` as ``torch.save`` writes them (a pipe then carries the values, not
    handles to shared memory that die with a killed sender)."""
    buffer = io.BytesIO()
    torch.save(params, buffer)
    return buffer.getvalue()


def _batches(task, shard, seed: int, index: int, step: int) -> torch.Generator:
    """Worker ``index``'s minibatch generator as it is after ``step`` steps (the
    stream :func:`puredist.demo.training.train` draws from): a restarted worker's
    data resumes where the worker's would be, as a data loader's at a checkpoint."""
    batches = torch.Generator().manual_seed(seed * 1000 + index)
    for _ in range(step):
        task.sample(shard, batches)
    return batches


class _PuredistReplica:
    """``diloco_ft``: puredist's functional inner optimizer and DiLoCo transform, made
    fault tolerant by :class:`puredist.ft.FaultTolerantOuter` (a heal hands over step,
    global copy and outer state; the inner optimizer's state is this worker's own)."""

    def __init__(self, task, model: torch.nn.Module, manager, outer: dict) -> None:
        import puredist
        from puredist.demo.task import cross_entropy
        from puredist.ft import FaultTolerantOuter

        self.params = {name: p.detach().clone() for name, p in model.named_parameters()}
        self._optimizer = getattr(puredist, task.optimizer)(**task.optimizer_options)
        self._inner_state = self._optimizer.init(self.params)
        transform = puredist.outer_optimizer(puredist.sgd(**outer), sync_every=task.period,
                                             warmup_steps=task.warmup_steps, comm_dtype=torch.bfloat16)
        self._outer = FaultTolerantOuter(transform, manager)
        self._state = transform.init(self.params)
        self._loss = lambda p, inputs, targets: cross_entropy(functional_call(model, p, (inputs,)), targets)

    @property
    def step(self) -> int:
        return self._state.step

    @property
    def heals(self) -> int:
        return self._outer.heals

    @property
    def failed(self) -> int:
        return self._outer.failed

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        grads, loss = grad_and_value(self._loss)(self.params, inputs, targets)
        self._inner_state = self._optimizer.update_(self.params, grads, self._inner_state)
        self._state = self._outer.update_(self.params, self._state)
        return loss

    def state(self) -> dict[str, Any]:
        return {"optimizer": self._inner_state, "averager": self._state}


class _TorchftReplica:
    """``torchft_diloco``, for comparison: torchft's own ``DiLoCo`` (fp32
    pseudo-gradients, no warm-up) around ``torch.optim`` inner and outer optimizers
    with the same hyper-parameters as ``diloco_ft``. The model and the inner
    optimizer's state are registered with the manager as torchft's DiLoCo example
    does, so a heal hands them over with the fragment's global copy and outer state.

    Its step is the manager's commits times ``H`` plus the inner steps since the last
    synchronization; a failed synchronization restores the global copy (torchft's
    rule), taking the step back to the last commit."""

    def __init__(self, task, model: torch.nn.Module, manager, outer: dict) -> None:
        from torchft.local_sgd import DiLoCo

        from puredist.demo.task import cross_entropy

        self._model, self._manager, self._period = model, manager, task.period
        self.params = dict(model.named_parameters())
        inner_class = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[task.optimizer]
        self._inner = inner_class(model.parameters(), **task.optimizer_options)
        self._outer = torch.optim.SGD(model.parameters(), **outer)
        self.heals = self.failed = 0
        manager.register_state_dict_fn("model", self._load, self._save)
        self._diloco = DiLoCo(manager, [model], self._inner, self._outer, sync_every=task.period).__enter__()
        self._local_steps = 0
        self._loss = lambda inputs, targets: cross_entropy(model(inputs), targets)

    def _save(self) -> dict[str, Any]:
        return {"model": self._model.state_dict(), "inner": self._inner.state_dict()}

    def _load(self, saved: dict[str, Any]) -> None:
        self._model.load_state_dict(saved["model"])
        self._inner.load_state_dict(saved["inner"])
        self.heals += 1

    @property
    def step(self) -> int:
        return self._manager.current_step() * self._period + self._local_steps

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        commits = self._manager.current_step()
        self._inner.zero_grad()
        loss = self._loss(inputs, targets)
        loss.backward()
        self._inner.step()  # its post-hook synchronizes every H steps
        self._local_steps = (self._local_steps + 1) % self._period
        if self._local_steps == 0 and self._manager.current_step() == commits:
            self.failed += 1
        return loss.detach()

    def state(self) -> dict[str, Any]:
        # DiLoCo's backup of the global copy (its fragment's original_parameters) is a copy of the parameters
        return {"inner": self._inner.state_dict(), "outer": self._outer.state_dict(),
                "global copy": [p.detach() for p in self.params.values()]}


REPLICAS = {"diloco_ft": _PuredistReplica, "torchft_diloco": _TorchftReplica}


def _train(job: dict[str, Any], index: int, restarted: bool, lighthouse: str, store_port: int, pipe) -> dict[str, Any]:
    """One worker's training over torchft: what ``training.train`` returns, per step
    (``None`` where this process did not take the step), and its evaluations sent
    to the launcher through ``pipe``."""
    from puredist.demo.knobs import outer_options
    from puredist.demo.training import job_task, tensor_bytes
    from puredist.demo.wire import bytes_written
    from puredist.ft import replica_manager

    (task, knobs), world_size, seed, steps = job_task(job), job["world_size"], job["seed"], job["steps"]
    shard, _ = task.load(seed, index, world_size)
    model = task.make_model(seed)
    manager = replica_manager(f"worker{index}", lighthouse, min_replicas=1, timeout=COLLECTIVE_TIMEOUT,
                              quorum_timeout=QUORUM_TIMEOUT)
    replica = REPLICAS[job["algorithm"]](task, model, manager, outer_options(knobs, task))
    store = torch.distributed.TCPStore("127.0.0.1", store_port, is_master=False, timeout=QUORUM_TIMEOUT)
    if not restarted:  # every first worker's manager is up before the first quorum: it takes them all
        store.add("up", 1)
        while int(store.add("up", 0)) < world_size:
            time.sleep(0.01)

    kill_at = job["kill_step"] if index == world_size - 1 and not restarted else None
    eval_every = max(1, steps // 15)
    batches = _batches(task, shard, seed, index, 0)
    losses, step_seconds, step_bytes = [None] * steps, [None] * steps, [None] * steps
    step_clock = [None] * steps  # seconds since the start at the end of each step (the evaluations: a pipe's send)
    last_commit, joined = 0, not restarted
    started = time.perf_counter()
    mark = bytes_written()
    while replica.step < steps:
        if replica.step + 1 == kill_at:
            pipe.send(("killed", index, kill_at, last_commit, time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        inputs, targets = task.sample(shard, batches)
        step_started = time.perf_counter()
        heals, commits, before = replica.heals, manager.current_step(), replica.step
        loss = replica.train_step(inputs, targets)
        if manager.current_step() != commits:
            last_commit = replica.step
        # the restarted worker's first commit: healed from a peer, or (killed before any commit) alongside them
        rejoined = not joined and (replica.heals != heals or manager.current_step() != commits)
        if rejoined:
            joined = True
            store.add("members", 1)  # before its next synchronization: the peers wait for it at the end
            pipe.send(("rejoined", index, replica.step, time.time()))
        if rejoined or replica.heals != heals:
            batches = _batches(task, shard, seed, index, replica.step)  # its data resumes at its peers' step
        if not joined:
            continue  # not yet in (torchft's DiLoCo asks for a quorum only after H steps of its own)
        if replica.step <= before:
            continue  # a failed synchronization: nothing applied (torchft's goes back to its last commit)
        k = replica.step - 1  # the step this one counts as (a heal jumps to its peers')
        step_seconds[k], losses[k] = time.perf_counter() - step_started, loss.item()
        now = bytes_written()
        step_bytes[k], mark = now - mark, now
        step_clock[k] = time.perf_counter() - started
        if replica.step % eval_every == 0 or replica.step == steps:
            pipe.send(("eval", index, replica.step, _to_bytes({n: p.detach() for n, p in replica.params.items()})))
    wall = time.perf_counter() - started
    store.add("done", 1)
    while int(store.add("done", 0)) < int(store.add("members", 0)):  # no peer leaves while another may still
        time.sleep(0.01)  # synchronize (the members: the workers alive, and a restarted one once it rejoined)
    manager.shutdown(wait=False)
    return {"losses": losses, "bytes_sent": sum(b for b in step_bytes if b is not None), "wall_s": wall,
            "step_seconds": step_seconds, "step_bytes": step_bytes, "step_clock": step_clock,
            "state_bytes": tensor_bytes(replica.state()), "failed_syncs": replica.failed, "heals": replica.heals}


def _worker(job: dict[str, Any], index: int | None, lighthouse: str, store_port: int, pipe) -> None:
    """A worker process (``index``), or a standby (``None``) that waits for the index
    of the worker whose place it takes."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    logging.getLogger("torchft").setLevel(logging.ERROR)  # its warnings about NCCL's flight recorder, on a CPU
    # torchft's checkpoint server (http.server) writes a line per request to stderr: one per heal, amid the report
    http.server.BaseHTTPRequestHandler.log_request = lambda *args, **kwargs: None
    warnings.filterwarnings("ignore", message="The given buffer is not writable")  # torch, reading a heal's bytes
    restarted = index is None
    if restarted:  # warm: everything imported and the data read, as a restart's would be from the page cache
        from puredist.demo.training import TASKS
        import puredist.ft  # noqa: F401

        TASKS[job["task"]].load(job["seed"], 0, job["world_size"])
        index = pipe.recv()
    try:
        pipe.send(("result", index, _train(job, index, restarted, lighthouse, store_port, pipe)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the launcher
        pipe.send(("error", index, traceback.format_exc()))


class _Launcher:
    """The processes of one fault-tolerant run and what they sent back."""

    def __init__(self, job: dict[str, Any], lighthouse: str, store) -> None:
        self.context = multiprocessing.get_context("spawn")
        self.job, self.lighthouse, self.store, self.store_port = job, lighthouse, store, store.port
        store.add("members", job["world_size"])
        self.pipes: dict[Any, Any] = {}  # our end of each process's pipe -> (process, index or None)
        self.results: dict[int, dict[str, Any]] = {}
        self.evaluations: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # step -> worker -> parameters
        self.faults: dict[str, Any] = {}

    def start(self, index: int | None) -> None:
        ours, theirs = self.context.Pipe()
        process = self.context.Process(target=_worker, args=(self.job, index, self.lighthouse, self.store_port, theirs),
                                       daemon=True)
        process.start()
        self.pipes[ours] = (process, index)

    def run(self) -> None:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while len(self.results) < self.job["world_size"] and not self._replacement_too_late():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the fault-tolerant run did not finish in {RUN_TIMEOUT_S:.0f} s")
            for pipe in multiprocessing.connection.wait(list(self.pipes), timeout=1.0):
                try:
                    message = pipe.recv()
                except EOFError:  # the process is gone: killed as planned, or failed
                    process, index = self.pipes.pop(pipe)
                    process.join()
                    if index is not None and self.faults.get("killed", {}).get("worker") != index:
                        raise RuntimeError(f"worker {index} exited with {process.exitcode} before it finished")
                    continue
                self._receive(pipe, message)

    def _replacement_too_late(self) -> bool:
        """Every other worker finished before the restarted one rejoined: it never
        will (no peer is left to heal it from)."""
        killed = self.faults.get("killed")
        return (killed is not None and "rejoined" not in self.faults
                and len(self.results) == self.job["world_size"] - 1 and killed["worker"] not in self.results)

    def _receive(self, pipe, message: tuple) -> None:
        kind, index, *rest = message
        if kind == "eval":
            step, saved = rest
            # a step taken again (torchft's DiLoCo after a failed synchronization): its last parameters count
            self.evaluations.setdefault(step, {})[index] = torch.load(io.BytesIO(saved))
        elif kind == "killed":
            step, last_commit, when = rest
            self.faults["killed"] = {"worker": index, "step": step, "last_commit_step": last_commit, "time": when}
            self.store.add("members", -1)
            standby = next((p for p, (_, i) in self.pipes.items() if i is None), None)
            if standby is None:
                raise RuntimeError(f"worker {index} was killed at step {step}, and the standby is gone")
            standby.send(index)
            self.pipes[standby] = (self.pipes[standby][0], index)
        elif kind == "rejoined":  # (sent only by the standby that took a killed worker's place)
            step, when = rest
            killed = self.faults["killed"]
            self.faults["rejoined"] = {"worker": index, "step": step}
            self.faults["recovery_s"] = when - killed["time"]
            self.faults["steps_lost"] = step - killed["last_commit_step"]
        elif kind == "result":
            self.results[index] = rest[0]
        else:
            raise RuntimeError(f"worker {index} failed:\n{rest[0]}")


def run(job: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Train ``job["algorithm"]`` (one of :data:`FAULT_TOLERANT`) with ``job["world_size"]`` workers (and, with
    ``job["kill_step"]``, the kill and the restart); return per worker what
    ``training.train`` returns (evaluations of the workers' average, computed here),
    with ``faults`` (``killed``, ``rejoined``, ``recovery_s``, ``steps_lost``: the
    killed worker's steps from its last commit to its peers' step when it
    rejoined) and its ``failed_syncs`` and ``heals``."""
    os.environ.setdefault("RUST_LOG", "error")  # torchft's servers log every quorum otherwise (the workers inherit it)
    from torchft.coordination import LighthouseServer

    from puredist.demo.task import held_out
    from puredist.demo.training import job_task

    task, _ = job_task(job)
    # a quorum waits up to join_timeout for a live replica that has not asked yet: longer than a peer's
    # steps between two synchronizations, so that the restarted worker is taken in at the next one
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000, quorum_tick_ms=20,
                                  heartbeat_timeout_ms=1000)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    launcher = _Launcher(job, lighthouse.address(), store)
    try:
        for index in range(job["world_size"]):
            launcher.start(index)
        if job.get("kill_step"):
            launcher.start(None)
        launcher.run()
    finally:
        for process, _ in launcher.pipes.values():
            process.kill()
        lighthouse.shutdown()
    model = task.make_model(job["seed"])
    _, test = task.load(job["seed"], 0, job["world_size"])
    results = launcher.results
    for index in range(job["world_size"]):  # a worker killed that never rejoined: nothing measured after its death
        results.setdefault(index, {"losses": [], "bytes_sent": 0, "wall_s": 0.0, "step_seconds": [None] * job["steps"],
                                   "step_bytes": [0] * job["steps"], "step_clock": [None] * job["steps"], "state_bytes": 0, "failed_syncs": 0, "heals": 0})
    for step, by_worker in sorted(launcher.evaluations.items()):
        sent = list(by_worker.values())
        averaged = {name: torch.stack([params[name] for params in sent]).mean(0) for name in sent[0]}
        loss, accuracy = held_out(model, averaged, test)
        for result in results.values():
            so_far = sum(b for b in result["step_bytes"][:step] if b is not None)
            result.setdefault("evaluations", []).append((step, accuracy, loss, so_far))
    faults = launcher.faults
    faults.get("killed", {}).pop("time", None)  # (a wall-clock instant: only the recovery time is reported)
    for result in results.values():
        result["faults"] = faults
        result["losses"] = [loss for loss in result["losses"] if loss is not None]
        # (a step the killed worker never reported stays unmeasured, None: no duration, out of the compute mean)
        result["step_bytes"] = [b or 0 for b in result["step_bytes"]]
        result["training_s"] = [result["step_clock"][step - 1] for step, *_ in result["evaluations"]]
    return results
