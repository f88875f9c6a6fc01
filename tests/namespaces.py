"""What the tests of the demo's network namespaces share (``--link`` and
``--islands``): whether this machine can build them, the namespaces a run has, and a
demo started until it prints a given text."""

import os
import select
import subprocess
import sys
import time

import pytest

from puredist.demo import links

DEMO = [sys.executable, "-m", "puredist", "demo"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
UNAVAILABLE = links.unavailable()
needs_namespaces = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"network namespaces: {UNAVAILABLE}")


def namespaces(prefix: str) -> list[str]:
    """The network namespaces whose names start with ``prefix``."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(prefix)]


def start_until(arguments: list[str], text: str, timeout: float = 90) -> tuple[subprocess.Popen, str]:
    """The demo started with ``arguments`` in a session of its own (a signal to its
    process group reaches it alone, as Ctrl-C would), and what it printed up to
    ``text``; the test fails if ``text`` does not come within ``timeout`` seconds."""
    process = subprocess.Popen([*DEMO, *arguments], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                               start_new_session=True)
    seen, deadline = "", time.monotonic() + timeout
    while text not in seen and time.monotonic() < deadline and process.poll() is None:
        if select.select([process.stdout], [], [], 1.0)[0]:
            seen += os.read(process.stdout.fileno(), 4096).decode()
    if text not in seen:
        os.killpg(process.pid, 9)
        pytest.fail(f"{text!r} not printed: {seen}{process.stderr.read()}")
    return process, seen
