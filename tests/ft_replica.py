"""One replica group (one process) of the fault-tolerance tests: DiLoCo over a torchft
quorum, started by ``tests/test_ft.py`` as ``python tests/ft_replica.py SPEC_JSON``.

The replica trains a small model with a deterministic local step (a function of its
index, the step and its parameters, so that a one-process simulation can replay it),
synchronizes with :class:`puredist.ft.FaultTolerantOuter`, and saves what it ends
with (step, global copy, outer state, counters) to ``spec["out"]``. Faults are
injected here, as the spec says: exit before a step (``die_at``), exit inside the
data all-reduce of a synchronization (``die_in_reduction``), or sleep before one
(``slow_at``). Every failed synchronization is checked to have changed nothing. With
``spec["group"]`` the process is one rank of a replica group of several processes
(torchrun's environment, the group's own store).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch

import puredist
from puredist.ft import FaultTolerantOuter, HealFailed, ManagerCollective, replica_manager

SYNC_EVERY = 3


def make_params() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 4, generator=generator), "b": torch.randn(4, generator=generator)}


def make_transform(compressed: bool = False):
    return puredist.outer_optimizer(puredist.sgd(0.7, momentum=0.9, nesterov=True), sync_every=SYNC_EVERY,
                                    warmup_steps=2, compressor=puredist.int8_blocks(8) if compressed else None)


def local_step(params, replica: int, step: int) -> None:
    """A deterministic inner step: each replica pulls its parameters its own way."""
    with torch.no_grad():
        for leaf in params.values():
            leaf.sub_(0.05 * torch.sin(leaf * (replica + 1) + step))


def _snapshot(state) -> list[torch.Tensor]:
    return [t.clone() for t in state.global_params] + [t.clone() for s in state.outer_state for t in s]


def main(spec: dict) -> None:
    torch.set_num_threads(1)
    store = torch.distributed.TCPStore("127.0.0.1", spec["port"], is_master=False, timeout=timedelta(seconds=60))
    store.wait(spec.get("start_after", []))  # (a late replica: no manager, so no heartbeat, before then)
    group = spec.get("group")  # one rank of a replica group of several, as torchrun would start it
    if group is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(group["port"]), RANK=str(group["rank"]),
                          WORLD_SIZE=str(group["size"]))
    manager = replica_manager(group["name"] if group else spec["id"], spec["lighthouse"], min_replicas=1,
                              timeout=timedelta(seconds=spec["timeout"]), quorum_timeout=timedelta(seconds=60))
    reductions = 0
    allreduce = manager.allreduce

    def counted_allreduce(tensor, **kwargs):  # the rank check is a reduction's first all-reduce, the data its second
        nonlocal reductions
        reductions += 1
        if reductions == spec.get("die_in_reduction"):
            os._exit(3)
        return allreduce(tensor, **kwargs)

    manager.allreduce = counted_allreduce
    store.add(f"up.{spec['id']}", 1)
    for key in spec.get("wait_for", []):  # the others' managers are up: the first quorum takes every replica
        store.wait([key])
    if "context" in spec:  # one averaging, with this replica's context
        mean_with_context(manager, spec)
    elif "means" in spec:
        means(manager, store, spec)
    elif spec.get("averager"):
        periodic_averaging(manager, spec)
    elif spec.get("compressed_averager"):
        compressed_averaging(manager, spec)
    else:
        train(manager, store, spec)
    store.add(f"done.{spec['id']}", 1)
    store.wait([f"done.{other}" for other in spec.get("finish_with", [])])  # no peer leaves mid-synchronization
    manager.shutdown(wait=False)


def mean_with_context(manager, spec: dict) -> None:
    """Average ``[index + 1] * 4`` with ``spec["context"]``; save whether it raised
    ``RankMismatchError`` and what the tensor holds after."""
    tensor = torch.full((4,), float(spec["index"] + 1))
    try:
        ManagerCollective(manager).mean_([tensor], context=spec["context"])
        raised = None
    except puredist.RankMismatchError as error:
        raised = str(error)
    torch.save({"raised": raised, "tensor": tensor}, spec["out"])


def means(manager, store, spec: dict) -> None:
    """``spec["means"]`` averagings of ``[index + 1] * 4`` (a fresh tensor each), 2 s
    apart; save what each did (``"ok"`` and the tensor, or the error's type)."""
    outcomes = []
    for call in range(spec["means"]):
        tensor = torch.full((4,), float(spec["index"] + 1))
        try:
            ManagerCollective(manager).mean_([tensor], context="the same every time")
            outcomes.append(("ok", tensor))
        except Exception as error:  # noqa: BLE001 - recorded for the test
            outcomes.append((type(error).__name__, tensor))
        if call == 0:
            store.add(f"first.{spec['id']}", 1)
        time.sleep(2.0)  # (a late replica's manager is up well within this)
    torch.save(outcomes, spec["out"])


def periodic_averaging(manager, spec: dict) -> None:
    """Post-local SGD over the quorum: ``puredist.periodic_averager(2)`` for 6 steps of a
    deterministic local update of a model's parameters (leaves that require grad); save
    the parameters."""
    params = {name: torch.nn.Parameter(value) for name, value in make_params().items()}
    averager = puredist.periodic_averager(2)
    state = averager.init(params)
    collective = ManagerCollective(manager)
    for step in range(6):
        local_step(params, spec["index"], step)
        state = averager.update_(params, state, collective=collective)
    torch.save({"params": {name: p.detach() for name, p in params.items()}, "step": state.step}, spec["out"])


def compressed_averaging(manager, spec: dict) -> None:
    """``puredist.compressed_averager(int8_blocks(8))`` over the quorum for 3 steps of
    the local update, the parameters replaced by the means; save both and the
    residuals."""
    params = make_params()
    averager = puredist.compressed_averager(puredist.int8_blocks(8))
    state = averager.init(params)
    collective = ManagerCollective(manager)
    # at spec["nan_at"] (a NaN here) or spec["peer_nan_at"] (a NaN on a peer): (the error's start, torchft's
    # step before, after) of that averaging; then the step is run again without it
    refusals = []
    for step in range(3):
        local_step(params, spec["index"], step)
        if step in (spec.get("nan_at"), spec.get("peer_nan_at")):
            poisoned = {name: t.clone() for name, t in params.items()}
            if step == spec.get("nan_at"):
                next(iter(poisoned.values())).view(-1)[0] = float("nan")
            before = manager.current_step()
            try:
                averager.update(poisoned, state, collective=collective)
            except ValueError as error:
                refusals.append((str(error)[:40], before, manager.current_step()))
        means, state = averager.update(params, state, collective=collective)
        params = {name: mean.clone() for name, mean in means.items()}
    torch.save({"params": params, "residuals": list(state.residuals), "refusals": refusals}, spec["out"])


def train(manager, store, spec: dict) -> None:
    """DiLoCo with the spec's faults; save what it ends with."""
    transform = make_transform(spec.get("compressed", False))
    failing_loads = [spec.get("heal_load_fails", 0)]
    if failing_loads[0]:  # the first heals cannot load the peer's state
        load_state_dict = transform.load_state_dict

        def failing_load_state_dict(*args, **kwargs):
            if failing_loads[0]:
                failing_loads[0] -= 1
                raise ValueError("injected: the peer's state does not load")
            return load_state_dict(*args, **kwargs)

        transform = transform._replace(load_state_dict=failing_load_state_dict)
    ft = FaultTolerantOuter(transform, manager)
    if spec.get("inner"):  # more state registered with the manager (an inner optimizer's), served and healed too
        failing_inner = [spec.get("inner_load_fails", 0)]

        def load_inner(saved: dict) -> None:
            if failing_inner[0]:
                failing_inner[0] -= 1
                raise ValueError("injected: the inner state does not load")

        manager.register_state_dict_fn("inner", load_inner, lambda: {"lr": 0.1})
    params = make_params()
    state = transform.init(params)
    failures_changed_nothing = True
    worlds, heal_errors, peer_went_on = [], [], None
    while state.step < spec["steps"]:
        step = state.step
        if step == spec.get("die_at"):
            group = spec.get("group")
            if group is not None:  # the whole group at once: rank 0 hosts its manager's server, which the others'
                key = f"dying.{group['name']}"  # last vote may still be waiting on
                store.add(key, 1)
                while int(store.add(key, 0)) < group["size"]:
                    time.sleep(0.01)
            os._exit(3)
        if step == spec.get("pause_at"):  # hold until the restarted replica is up
            store.wait([spec["pause_until"]])
        if step == spec.get("slow_at"):
            time.sleep(spec["slow_s"])
        local_step(params, spec["index"], step)
        before, failed = _snapshot(state), ft.failed
        try:
            new = ft.update_(params, state)
        except HealFailed as error:
            failures_changed_nothing &= all(torch.equal(a, b) for a, b in zip(before, _snapshot(state)))
            try:
                ft.update_(params, state)
            except HealFailed as again:  # raised again, communicating nothing
                heal_errors = [str(error), str(again) == str(error) and again.__cause__ is error.__cause__,
                               type(error.__cause__).__name__]
            if spec.get("linger_s"):  # the process stays up (logging, saving): its peer must not wait for it
                try:
                    store.wait([f"done.{spec['linger_for']}"], timedelta(seconds=spec["linger_s"]))
                    peer_went_on = True
                except Exception:  # noqa: BLE001 - the store's timeout: the peer is still held up
                    peer_went_on = False
            break
        if ft.failed != failed:  # nothing applied: `state` itself returned, or (healed in it) the peer's state
            failures_changed_nothing &= all(torch.equal(a, b) for a, b in zip(before, _snapshot(state)))
        else:
            worlds.append(ft.collective.world_size)
        state = new
    torch.save({
        "step": state.step, "global": list(state.global_params), "outer": _snapshot(state)[len(state.global_params):],
        "params": dict(params), "failed": ft.failed, "heals": ft.heals, "worlds": worlds,
        "failures_changed_nothing": failures_changed_nothing, "heal_errors": heal_errors, "peer_went_on": peer_went_on,
        "last_error": repr(ft.last_error) if ft.last_error is not None else None,
    }, spec["out"])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
