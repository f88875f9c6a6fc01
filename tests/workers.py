"""Run a function on W local Gloo ranks (or one NCCL rank), forked from the test process.

The parent forks one process per rank first, while it has no threads of its own (a
fork taken while another thread holds a lock, e.g. the store server's, can leave the
child deadlocked), then creates the rendezvous ``TCPStore`` on a port the OS picks
and sends that port to every worker: the store owns the listening socket before any
worker connects, so there is no free-port race. Each worker joins the Gloo group, runs ``fn(rank, world_size, *args)``, meets the
others at a final barrier, and sends back its pickled result or traceback. Every job
has a deadline: a hang becomes a ``TimeoutError`` naming the silent ranks (Gloo's own
timeout is shorter, so a stuck collective raises a traceback first). The parent must
never initialize CUDA (a forked child could not use it): CUDA tests touch the GPU in
the workers only.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

JOB_TIMEOUT_S = 90.0
GLOO_TIMEOUT_S = 60.0
GRACE_AFTER_FAILURE_S = 5.0  # how long the other ranks get once one rank has failed


class WorkerError(AssertionError):
    """At least one rank raised; the message holds every failing rank's traceback."""


def _worker(rank, world_size, fn, args, conn, gloo_timeout, final_barrier, backend):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        if not conn.poll(GLOO_TIMEOUT_S):
            raise TimeoutError("the parent sent no rendezvous port")
        port = conn.recv()
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=GLOO_TIMEOUT_S))
        if "nccl" in backend:  # one GPU: NCCL takes one rank per device
            torch.cuda.set_device(0)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=gloo_timeout)
        )
        result = fn(rank, world_size, *args)
        if final_barrier:
            dist.barrier()
        payload = (True, result)
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        payload = (False, traceback.format_exc())
    try:
        conn.send_bytes(pickle.dumps(payload))
    except Exception:  # noqa: BLE001 - an unpicklable result is a failure too
        conn.send_bytes(pickle.dumps((False, traceback.format_exc())))
    finally:
        conn.close()
        os._exit(0)


def run_workers(
    fn,
    world_size: int,
    *args,
    timeout: float = JOB_TIMEOUT_S,
    victims: tuple[int, ...] = (),
    gloo_timeout: float = GLOO_TIMEOUT_S,
    broken: bool = False,
    backend: str = "gloo",
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks of ``backend``
    (Gloo; with NCCL, e.g. ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``, every rank is on
    GPU 0, so it takes ``world_size == 1``).

    Args:
        timeout: the job's deadline.
        victims: ranks the job kills or freezes on purpose (fault injection): they may
            end without a result (``None`` in their place), and nobody meets at the
            final barrier (the group is broken); every other rank must report.
        gloo_timeout: the process group's timeout (a frozen peer's collectives fail
            after it).
        broken: the job breaks the group on purpose though every rank lives (an
            injected exception): nobody meets at the final barrier.

    Returns:
        The ranks' return values, by rank.

    Raises:
        WorkerError: a rank raised (every failing rank's traceback included), or a
            rank that is not a victim ended without a result.
        TimeoutError: some rank did not finish within ``timeout`` seconds.
    """
    ctx = mp.get_context("fork")
    receivers, processes = {}, []
    for rank in range(world_size):
        parent_end, child_end = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=_worker,
            args=(rank, world_size, fn, args, child_end, gloo_timeout, not (victims or broken), backend),
            daemon=True,
        )
        process.start()
        child_end.close()
        receivers[parent_end] = rank
        processes.append(process)
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    for parent_end in receivers:
        parent_end.send(store.port)

    results: dict[int, tuple[bool, object]] = {}
    deadline = time.monotonic() + timeout
    try:
        while any(rank not in victims for rank in receivers.values()) and time.monotonic() < deadline:
            for receiver in multiprocessing.connection.wait(list(receivers), timeout=deadline - time.monotonic()):
                rank = receivers.pop(receiver)
                try:
                    results[rank] = pickle.loads(receiver.recv_bytes())
                except EOFError:
                    results[rank] = (True, None) if rank in victims else (False, "worker exited without a result")
                if not results[rank][0]:
                    deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
    finally:
        for rank, process in enumerate(processes):
            if rank in results:  # it reported and is exiting on its own
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
            process.join()
        del store

    failures = {r: out for r, (ok, out) in sorted(results.items()) if not ok}
    if failures:
        raise WorkerError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures.items()))
    silent = sorted(rank for rank in receivers.values() if rank not in victims)
    if silent:
        raise TimeoutError(f"ranks {silent} did not finish within {timeout} s")
    return [results[r][1] if r in results else None for r in range(world_size)]
