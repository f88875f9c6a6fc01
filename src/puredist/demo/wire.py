"""Bytes on the wire, measured at the system calls.

``/proc/self/io``'s ``wchar`` counts every byte this process handed to the ``write``
family of system calls (``write``, ``writev``, ...; not ``send``/``sendmsg``), by every
thread, living or exited. Gloo's TCP transport writes its messages with ``writev``,
from Gloo's own threads (its worker threads and its transport's); the main thread of
a demo worker writes only the progress bar and files (and tqdm runs no monitor thread). So the bytes sent are the process's ``wchar`` minus the
main thread's (``/proc/self/task/<tid>/io``).

This module must not interpret the bytes: it only counts them.
"""

from __future__ import annotations

import os
from contextlib import contextmanager


def _wchar(path: str) -> int:
    with open(path) as io:
        for line in io:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError(f"{path} has no wchar line")


def bytes_written() -> int:
    """Bytes written so far by this process's threads other than the main one (a
    transport that used ``send`` instead of ``writev`` would not be counted)."""
    return _wchar("/proc/self/io") - _wchar(f"/proc/self/task/{os.getpid()}/io")  # Linux: the main thread's id is the pid


class ByteMeter:
    """Bytes written by the communication threads while inside ``counting``."""

    def __init__(self) -> None:
        self.total = 0

    @contextmanager
    def counting(self):
        start = bytes_written()
        try:
            yield
        finally:
            self.total += bytes_written() - start
