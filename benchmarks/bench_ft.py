"""The cost of fault tolerance: a DiLoCo synchronization over torchft
(:class:`puredist.ft.FaultTolerantOuter`: a quorum, the rank check, the all-reduce and
the vote) against the same over a plain Gloo group (:class:`puredist.DistributedCollective`),
2 workers on this machine, in one run. Run with ``make bench`` (or
``python benchmarks/bench_ft.py``).

Each worker times ``update_`` with ``sync_every=1`` (every call synchronizes), after
warm-up calls; the figure is the median over the calls of the slower worker. Layouts:
291 leaves of 4 floats (host work dominates) and 4M parameters in 16 tensors.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from datetime import timedelta

import torch

LAYOUTS = {"291 leaves x 4 floats": [(4,)] * 291, "4M params in 16 tensors": [(512, 512)] * 16}


def _time_syncs(make_update, shapes, calls: int, warmup: int) -> float:
    """Median seconds of an ``update_`` that synchronizes; ``make_update(transform,
    params)`` returns ``state -> new state``."""
    import puredist

    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=gen) for shape in shapes]
    transform = puredist.outer_optimizer(puredist.sgd(0.7, momentum=0.9, nesterov=True), sync_every=1,
                                         warmup_steps=2)
    state = transform.init(params)
    update = make_update(transform, params)
    seconds = []
    for call in range(warmup + calls):
        for p in params:
            p.add_(0.01)
        started = time.perf_counter()
        state = update(state)
        if call >= warmup:
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def _together(store, key: str) -> None:
    """Wait until both workers have added to ``key``."""
    store.add(key, 1)
    while int(store.add(key, 0)) < 2:
        time.sleep(0.01)


def _plain(rank: int, port: int, args, pipe) -> None:
    import torch.distributed as dist

    import puredist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    collective = puredist.DistributedCollective()

    def make_update(transform, params):
        return lambda state: transform.update_(params, state, collective=collective)

    pipe.send({name: _time_syncs(make_update, shapes, args.calls, args.warmup) for name, shapes in LAYOUTS.items()})
    dist.barrier()
    dist.destroy_process_group()


def _fault_tolerant(rank: int, lighthouse: str, port: int, args, pipe) -> None:
    import logging

    from puredist.ft import FaultTolerantOuter, replica_manager

    torch.set_num_threads(1)
    logging.getLogger("torchft").setLevel(logging.ERROR)
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    results = {}
    for k, (name, shapes) in enumerate(LAYOUTS.items()):
        manager = replica_manager(f"bench{rank}-{k}", lighthouse, min_replicas=2, timeout=timedelta(seconds=60))
        _together(store, f"up{k}")  # both managers up before the first quorum

        def make_update(transform, params):
            outer = FaultTolerantOuter(transform, manager)
            return lambda state: outer.update_(params, state)

        results[name] = _time_syncs(make_update, shapes, args.calls, args.warmup)
        _together(store, f"done{k}")  # neither leaves while the other synchronizes
        manager.shutdown(wait=False)
    pipe.send(results)


def _run(context, target, extra) -> dict[str, float]:
    """Start both workers; the slower worker's median per layout."""
    pipes, processes = [], []
    for rank in range(2):
        ours, theirs = context.Pipe()
        process = context.Process(target=target, args=(rank, *extra, theirs))
        process.start()
        pipes.append(ours)
        processes.append(process)
    results = [pipe.recv() for pipe in pipes]
    for process in processes:
        process.join(timeout=60)
    return {name: max(r[name] for r in results) for name in LAYOUTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RUST_LOG", "error")
    from torchft.coordination import LighthouseServer

    context = multiprocessing.get_context("spawn")
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    plain = _run(context, _plain, (store.port, args))
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=5000, quorum_tick_ms=20,
                                  heartbeat_timeout_ms=2000)
    ft_store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        fault_tolerant = _run(context, _fault_tolerant, (lighthouse.address(), ft_store.port, args))
    finally:
        lighthouse.shutdown()
    print(f"DiLoCo synchronization, 2 workers on this machine (CPU, Gloo), median of {args.calls} calls")
    print(f"{'layout':26s} {'plain Gloo':>11s} {'torchft':>9s} {'ratio':>7s}")
    for name in LAYOUTS:
        print(f"{name:26s} {1000 * plain[name]:8.2f} ms {1000 * fault_tolerant[name]:6.2f} ms "
              f"{fault_tolerant[name] / plain[name]:6.2f}x")


if __name__ == "__main__":
    main()
