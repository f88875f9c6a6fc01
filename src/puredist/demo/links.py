"""``python -m puredist demo --link RATE[,RATE...]``: the main job over real,
rate-limited links, measured beside the network model's projection.

For each rate, every worker runs in its own Linux network namespace, joined to the
others by a veth pair to one bridge, and the egress of its end is shaped by the
``tbf`` (token bucket) queueing discipline to that rate; the bridge lives in a hub
namespace, where the launcher's rendezvous store listens on the bridge's address.
Nothing here touches the host's own network: the addresses (:data:`SUBNET`) exist
only inside these namespaces, named with a prefix unique to the run
(``puredist-<pid>-<random>``), so that runs side by side never meet.

:class:`Network` builds them and removes them on every way out of its ``with``
block: a normal end, an exception, Ctrl-C, SIGTERM or SIGHUP (which it turns into
``KeyboardInterrupt`` while inside), a worker killed (the launcher then stops the
others and raises). A SIGKILL of the launcher itself leaves them: ``ip netns list``
shows them by their prefix.

Each worker shapes its own egress (:func:`shape`) and, algorithm by algorithm, trains
once unshaped (:data:`BASELINE`: the same namespaces without a rate) and once per rate,
so that an algorithm's runs follow each other within seconds and see the same load on a
shared machine. The comparison (:func:`compare`): per algorithm and rate, the measured
training time (the slowest worker's, the evaluations left out: they average over the
same link) of the whole run and up to the evaluation that first reached the target
(within 1 % of the first algorithm's final held-out loss), beside :func:`puredist.demo.network.projected_seconds`
for a link of that rate and zero latency, projected from the unshaped run's training
time and bytes.

This module must not train: it places the workers and compares what they measured.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import uuid
from contextlib import contextmanager
from typing import Any, Callable, NamedTuple

import torch.distributed as dist

from puredist.demo import network

SUBNET = "10.77.0"
"""The bridge is ``.1``, worker ``i`` is ``.(i + 2)``, on a /24 inside the run's namespaces only."""
INTERFACE = "eth0"
"""Each worker's end of its veth pair, inside its namespace (Gloo binds to it)."""
BASELINE = "unshaped"
"""The name of the runs without a rate, the network model's measurements."""
CLONE_NEWNET = 0x40000000


class Rate(NamedTuple):
    """A link rate as given on the command line (``20mbit``) and in bits per second."""

    name: str
    bits_per_second: float


_RATE = re.compile(r"(\d+(?:\.\d+)?)([kmg]?)bit", re.IGNORECASE)
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rates(text: str) -> list[Rate]:
    """``20mbit,100mbit`` -> the rates, each once, in the order given (``kbit``,
    ``mbit``, ``gbit``: powers of 1000, as ``tc`` reads them); ValueError naming the
    value otherwise."""
    rates = []
    for name in dict.fromkeys(part.strip().lower() for part in text.split(",") if part.strip()):
        match = _RATE.fullmatch(name)
        if match is None or float(match[1]) * _UNITS[match[2].lower()] < 8 * network.FRAME_BYTES:
            raise ValueError(f"expected rates like 20mbit,100mbit (kbit, mbit, gbit; at least "
                             f"{8 * network.FRAME_BYTES}bit), "
                             f"got {name!r}")
        rates.append(Rate(name, float(match[1]) * _UNITS[match[2].lower()]))
    if not rates:
        raise ValueError(f"expected rates like 20mbit,100mbit, got {text!r}")
    return rates


class LinkError(RuntimeError):
    """A command that builds the links failed: the message says which and why."""


def _ip(*arguments: str) -> None:
    done = subprocess.run(arguments, capture_output=True, text=True)
    if done.returncode != 0:
        raise LinkError(f"`{' '.join(arguments)}` failed: {(done.stderr or done.stdout).strip()}")


def unavailable() -> str | None:
    """Why this machine cannot build the links (root, iproute2's ``ip`` and ``tc``,
    network namespaces, ``tbf``), in one line; None if it can (a namespace with a
    ``tbf`` is made and removed to find out)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs iproute2 ({' and '.join(missing)} not found): apt-get install iproute2"
    probe = f"puredist-{os.getpid()}-{uuid.uuid4().hex[:6]}-probe"
    try:
        _ip("ip", "netns", "add", probe)
        _ip("tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1mbit", "burst", "1600",
            "limit", "65536")
    except LinkError as error:
        return str(error)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    """Move the calling thread (and the threads and processes it starts) into the
    network namespace ``fd`` refers to."""
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"setns: {os.strerror(error)}")


def enter(name: str) -> None:
    """Move the calling thread into the network namespace ``name`` for good."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        _setns(fd)
    finally:
        os.close(fd)


@contextmanager
def inside(name: str):
    """The calling thread in network namespace ``name`` for the ``with`` block, then
    back where it was."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        enter(name)
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(home)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


class Namespaces:
    """The network namespaces of one run, for a ``with`` block: a subclass's
    ``_build`` makes them (``_add``, each named with ``prefix``); on every way
    out of the block (a normal end, an exception, Ctrl-C, SIGTERM or SIGHUP, turned
    into ``KeyboardInterrupt`` while inside, a failure half-way through building) the
    processes still running in them are killed (only this run's can be: the
    namespaces are its own) and they are removed.

    Attributes:
        prefix: ``puredist-<pid>-<random>``, the start of every name.
    """

    def __init__(self) -> None:
        self.prefix = f"puredist-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._made: list[str] = []
        self._handlers: dict[int, Any] = {}

    def __enter__(self):
        self._handlers = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            self._build()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *_) -> None:
        try:
            for name in self._made:
                listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
                for pid in map(int, listed.split()):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            for name in reversed(self._made):  # a namespace takes its veth ends (and their peers) and bridge with it
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
            self._made.clear()
        finally:
            for signum, handler in self._handlers.items():
                signal.signal(signum, handler)

    def _add(self, name: str) -> None:
        _ip("ip", "netns", "add", name)
        self._made.append(name)
        _ip("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        raise NotImplementedError


class Network(Namespaces):
    """``world_size`` worker namespaces on one bridge in a hub namespace, for a
    ``with`` block (see the module's docstring and :class:`Namespaces`); each worker
    sets its rate (:func:`shape`).

    Attributes:
        hub: the hub namespace's name (the bridge, the rendezvous).
        workers: worker ``i``'s namespace's name at index ``i``.
        address: the bridge's address, where the rendezvous listens.
    """

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.hub = f"{self.prefix}-hub"
        self.workers = [f"{self.prefix}-w{i}" for i in range(world_size)]
        self.address = f"{SUBNET}.1"

    def _build(self) -> None:
        self._add(self.hub)
        _ip("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("ip", "-n", self.hub, "addr", "add", f"{self.address}/24", "dev", "br0")
        _ip("ip", "-n", self.hub, "link", "set", "br0", "up")
        for index, name in enumerate(self.workers):
            self._add(name)
            port = f"w{index}"
            _ip("ip", "-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", INTERFACE, "netns", name)
            _ip("ip", "-n", self.hub, "link", "set", port, "master", "br0", "up")
            _ip("ip", "-n", name, "addr", "add", f"{SUBNET}.{index + 2}/24", "dev", INTERFACE)
            _ip("ip", "-n", name, "link", "set", INTERFACE, "up")


def shape(rate: Rate | None, interface: str = INTERFACE, namespace: str | None = None) -> None:
    """Shape ``interface``'s egress (this process's namespace's, or ``namespace``'s) to
    ``rate``: a token bucket of one full frame (no burst above the rate: a link
    serializes every frame) and a queue of at least 0.1 s at the rate; None: a FIFO
    without a rate."""
    where = ["-n", namespace] if namespace else []
    if rate is None:
        _ip("tc", *where, "qdisc", "replace", "dev", interface, "root", "pfifo")
        return
    limit = max(64 * 1024, int(rate.bits_per_second / 8 * 0.1))
    _ip("tc", *where, "qdisc", "replace", "dev", interface, "root", "tbf", "rate", f"{int(rate.bits_per_second)}bit",
        "burst", str(network.FRAME_BYTES), "limit", str(limit))


def egress_bytes(interface: str = INTERFACE, namespace: str | None = None) -> int:
    """Bytes (Ethernet frames, headers included) the queueing discipline on
    ``interface`` (this process's namespace's, or ``namespace``'s) has sent since
    :func:`shape` set it."""
    where = ["-n", namespace] if namespace else []
    shown = subprocess.run(["tc", *where, "-s", "qdisc", "show", "dev", interface], capture_output=True, text=True,
                           check=True).stdout
    return int(re.search(r"Sent (\d+) bytes", shown)[1])


def worker_main(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Entry point of each worker with ``--link``: enter this worker's namespace
    (``config["namespaces"][LOCAL_RANK]``), bind Gloo to its end of the link, and train
    each algorithm unshaped and then at each of ``config["rates"]`` (:func:`shape`, a
    barrier, :func:`puredist.demo.training.train`); return per algorithm per rate
    (:data:`BASELINE` first) what it measured, with ``egress_bytes`` and ``sent_bytes``
    (all its Gloo threads wrote, evaluations included) over the run."""
    from puredist.demo.training import job_task, process_group, train
    from puredist.demo.wire import bytes_written

    enter(config["namespaces"][int(os.environ["LOCAL_RANK"])])
    os.environ["GLOO_SOCKET_IFNAME"] = INTERFACE
    results: dict[str, dict[str, Any]] = {}
    with process_group(config):
        task, knobs = job_task(config)
        for algorithm in config["algorithms"]:
            for rate in [None, *config["rates"]]:
                shape(rate)
                dist.barrier()
                if dist.get_rank() == 0:
                    print(f"link {BASELINE if rate is None else rate.name}:", flush=True)
                egress, sent = egress_bytes(), bytes_written()
                result = train(task, algorithm, config, knobs)
                result.update(egress_bytes=egress_bytes() - egress, sent_bytes=bytes_written() - sent)
                results.setdefault(algorithm, {})[BASELINE if rate is None else rate.name] = result
    return results


def compare(summary: dict[str, Any], baseline: dict[str, Any], rate: Rate) -> dict[str, dict[str, Any]]:
    """Per algorithm, measured at ``rate`` beside the model's projection for it (zero
    latency) from the unshaped run: ``eval_loss``; ``wire_bytes_per_byte`` (the
    unshaped run's frames per byte sent); ``baseline_s`` (the unshaped run's
    training time), ``measured_s``, ``projected_s`` and ``ratio`` (measured /
    projected) of the whole run; ``transfer_s`` (the bytes' time at the rate, none
    hidden: what the run would add waiting for them all); ``steps_to_target`` (the first
    evaluation at or below the target, within 1 % of the first algorithm's final
    held-out loss, None if none),
    ``measured_to_target_s``, ``projected_to_target_s`` and ``ratio_to_target`` there.
    ``summary`` and ``baseline`` are :func:`puredist.demo.report.summarize`'s of the
    shaped and the unshaped runs."""
    from puredist.demo.report import measured

    link = network.Link(rate.name, rate.bits_per_second / 8, 0.0)
    compute, world_size = baseline["network_model"]["compute_s_per_step"], baseline["world_size"]
    compared = {}
    for algorithm, row in summary["algorithms"].items():
        base = measured(baseline["algorithms"][algorithm])
        clock, steps, reached = row["training_s"], [e["step"] for e in row["evaluations"]], row["steps_to_target"]
        last = steps[-1]
        projected = network.projected_seconds(base, last, link, world_size, compute)
        to_target = None if reached is None else clock[steps.index(reached)]
        projected_to_target = None if reached is None else network.projected_seconds(base, reached, link, world_size,
                                                                                       compute)
        compared[algorithm] = {
            "eval_loss": row["eval_loss"], "wire_bytes_per_byte": base.wire_bytes_per_byte,
            "baseline_s": base.training_s[-1], "measured_s": clock[-1], "projected_s": projected,
            "ratio": clock[-1] / projected,
            "transfer_s": network.transfer_seconds(base, last, link, world_size, None),
            "steps_to_target": reached, "measured_to_target_s": to_target, "projected_to_target_s": projected_to_target,
            "ratio_to_target": None if to_target is None else to_target / projected_to_target,
        }
    return compared


def measure(args, launch: Callable[..., dict], config: dict[str, Any]) -> dict[str, Any]:
    """Run the job once over the links (``launch(args, host=..., entrypoint=...,
    namespaces=..., rates=...)`` starts the workers and returns their results, per rank
    per algorithm per rate, :func:`worker_main`'s), printing each rate's measured
    table; return what ``results.json`` holds: per rate the comparison (``"links"``,
    :func:`compare`) and per rate, the unshaped included, the full summary
    (``"runs"``)."""
    from puredist.demo.report import summarize, table
    from puredist.demo.training import TASKS

    task = TASKS[args.task]
    with Network(args.world_size) as net:
        print(f"  network namespaces {net.workers[0]}..{net.workers[-1].rsplit('-', 1)[1]}, bridge {net.address} "
              f"in {net.hub}", flush=True)
        with inside(net.hub):
            results = launch(args, host=net.address, entrypoint=worker_main, namespaces=net.workers, rates=args.link)
    by_rate = {name: {rank: {a: runs[name] for a, runs in by_algorithm.items()}
                      for rank, by_algorithm in results.items()}
               for name in [BASELINE, *(rate.name for rate in args.link)]}
    runs = {name: summarize(rate_results, task.name, task.title, config) for name, rate_results in by_rate.items()}
    for name, summary in runs.items():
        print(f"link {name} (each worker's egress):\n{table(summary)}", flush=True)
    return {"config": config, "task": task.name, "title": task.title, "world_size": args.world_size,
            "links": {rate.name: compare(runs[rate.name], runs[BASELINE], rate) for rate in args.link},
            "runs": runs}


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def links_table(result: dict[str, Any]) -> str:
    """Measured beside projected, per rate and algorithm, and per rate the algorithms
    in the order of their measured time to the target loss."""
    model = next(iter(result["runs"].values()))["network_model"]
    target_from = f"within {100 * model['target_tolerance']:.0f}% of {model['target_from']}'s final"
    lines = [
        "MEASURED over real links (each worker's egress shaped by tbf; training time, evaluations left out) "
        f"beside PROJECTED (network model, zero latency: the {BASELINE} run's time plus its bytes' frames at the "
        "rate):",
        f"{'rate':>8s} {'algorithm':14s} {'loss':>6s} {'frames':>6s} | {BASELINE:>8s} {'bytes at':>8s} {'measured':>9s} "
        f"{'projected':>9s} {'ratio':>6s} | to {target_from}: {'step':>4s} {'measured':>9s} "
        f"{'projected':>9s} {'ratio':>6s}",
    ]
    for rate, rows in result["links"].items():
        for algorithm, row in rows.items():
            step = "-" if row["steps_to_target"] is None else str(row["steps_to_target"])
            lines.append(
                f"{rate:>8s} {algorithm:14s} {row['eval_loss']:6.3f} {row['wire_bytes_per_byte']:6.3f} | "
                f"{_seconds(row['baseline_s']):>8s} "
                f"{_seconds(row['transfer_s']):>8s} {_seconds(row['measured_s']):>9s} "
                f"{_seconds(row['projected_s']):>9s} {_ratio(row['ratio']):>6s} | {'':{len(target_from) + 4}s} "
                f"{step:>4s} {_seconds(row['measured_to_target_s']):>9s} {_seconds(row['projected_to_target_s']):>9s} "
                f"{_ratio(row['ratio_to_target']):>6s}"
            )
    lines.append("(frames: bytes on the wire per byte sent, measured unshaped; bytes at: their time at the rate, "
                 "none hidden: the projection hides streaming's behind the compute of the steps before its fragment "
                 "is applied)")
    for rate, rows in result["links"].items():
        reached = sorted((row["measured_to_target_s"], name) for name, row in rows.items()
                         if row["measured_to_target_s"] is not None)
        missed = [name for name, row in rows.items() if row["measured_to_target_s"] is None]
        lines.append(f"{rate}: by measured time to {target_from}: " + " < ".join(n for _, n in reached)
                     + (f" (not reached: {', '.join(missed)})" if missed else ""))
    return "\n".join(lines)
