"""Faults injected from inside a worker: a rank dies or freezes at its k-th collective.

Installed in the victim only (workers are separate processes), by wrapping
``torch.distributed.all_reduce`` and ``broadcast``, which puredist looks up at call
time. ``when="before"`` ends the process instead of launching call ``k`` (its peers
wait for it in that collective); ``when="during"`` launches call ``k`` and ends the
process ``delay_s`` later, while the collective is (very likely) in flight.
``how="die"`` is SIGKILL (sockets close: peers fail fast); ``how="freeze"`` is SIGSTOP
(sockets stay open: peers fail at the process group's timeout); ``how="raise"`` makes
call ``k`` raise in this process instead of launching (it lives on; its peers wait for
the collective until the timeout).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch.distributed as dist

_SIGNALS = {"die": signal.SIGKILL, "freeze": signal.SIGSTOP}


def fault_at_collective(k: int, *, how: str = "die", when: str = "during", delay_s: float = 0.02) -> None:
    """From now on, end or stop this process at its ``k``-th (0-based) all-reduce or
    broadcast (see the module docstring)."""
    sig = _SIGNALS.get(how)
    calls = {"n": 0}

    def strike() -> None:
        os.kill(os.getpid(), sig)
        time.sleep(60)  # SIGSTOP/SIGKILL take effect; never return into the job

    def wrap(original):
        def collective(*args, **kwargs):
            index = calls["n"]
            calls["n"] += 1
            if index == k and how == "raise":
                raise RuntimeError(f"injected failure launching collective {k}")
            if index == k and when == "before":
                strike()
            work = original(*args, **kwargs)
            if index == k:
                timer = threading.Timer(delay_s, strike)
                timer.daemon = True
                timer.start()
            return work

        return collective

    dist.all_reduce = wrap(dist.all_reduce)
    dist.broadcast = wrap(dist.broadcast)
