"""``demo --islands``: the job's options, its launchers, and what they return.

:func:`launch` builds the islands (:class:`puredist.demo.islands.Islands`), writes
the job (:func:`job`) where the workers read it, starts one ``torchrun`` per island
(each in its own session, so that a Ctrl-C reaches this process, which stops them) and
waits for all of them; if one exits with an error, or this process is interrupted
(Ctrl-C, SIGTERM, SIGHUP), it stops the others (SIGTERM to each launcher's process
group, then SIGKILL after :data:`STOP_TIMEOUT_S`), and the islands' namespaces are
removed with whatever still runs in them. It returns each worker's results, by rank.

This module must not train: it starts the islands and collects what they measured.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from puredist.demo import islands as network
from puredist.demo.links import Rate

ALGORITHMS = ("ddp", "hierarchical", "diloco", "streaming", "diloco_int4")
"""The islands' algorithms, baseline first (:mod:`puredist.demo.island_worker`)."""
DEFAULT_TASK = "lm"
DEFAULT_RATE = Rate("10mbit", 10e6)
"""The inter-island links' default rate (docs/links.md: where it puts the compute-to-communication ratio)."""
LOCAL_STEPS = 2
"""The local methods train this many times DDP's steps: enough to reach DDP's final loss."""
SHAPED_DDP_STEPS = 32
"""DDP's shaped run trains this many steps: its time per step, times its steps, is its wall time."""
SYNC_EVERY = 96
"""The islands' ``H`` unless ``--sync-every`` says otherwise: at the default rate a bf16 synchronization of the
language model takes about a tenth of ``H`` steps' compute (docs/links.md)."""
STREAMING = {"fragments": 4, "delay": 8}
"""Streaming DiLoCo's fragments and the steps each synchronization travels behind, on the islands."""
EVALUATIONS = 15
"""About this many evaluations in DDP's steps (:func:`evaluation_steps`)."""
STOP_TIMEOUT_S = 30.0


class IslandsFailed(RuntimeError):
    """A launcher exited with an error: the message names the island and ends with its last lines."""


def job(args, namespaces: network.Islands, results: Path, options: dict[str, int]) -> dict[str, Any]:
    """What every worker reads: the task, steps per algorithm and run, the knobs
    (``args.knobs``, :class:`~puredist.demo.knobs.Knobs`), the options of the
    algorithms (``sync_every``, ``warmup_steps``, ``fragments``, ``delay``), the
    namespaces, each island's link directions, the rate and where to write the
    results."""
    steps = {algorithm: {"unshaped": args.steps if algorithm == "ddp" else LOCAL_STEPS * args.steps,
                         "shaped": min(args.steps, SHAPED_DDP_STEPS) if algorithm == "ddp" else LOCAL_STEPS * args.steps}
             for algorithm in args.algorithms}
    return {"task": args.task, "seed": args.seed, "device": "cpu", "backend": "gloo", "algorithms": args.algorithms,
            "steps": steps, "evaluate": evaluation_steps(args.steps, options), "knobs": tuple(args.knobs),
            "options": options, "namespaces": namespaces.workers,
            "links": [namespaces.links(i) for i in range(len(namespaces.gateways))],
            "rate": tuple(args.link[0]), "results": str(results)}


def evaluation_steps(steps: int, options: dict[str, int]) -> tuple[int, int]:
    """``(every, at)``: every algorithm evaluates after the steps ``k`` with ``k % every
    == at`` (and after its last). ``every`` is a multiple of streaming DiLoCo's
    fragment spacing ``H // fragments`` giving about :data:`EVALUATIONS` in ``steps``;
    ``at`` puts each evaluation one step before a fragment starts, when none is in
    flight (a fragment starting after step ``W + j H / F`` is applied ``delay < H / F``
    steps later), so that no evaluation waits for one: such a wait is the measurement's,
    not training's, and would be counted as time blocked on the link."""
    spacing = max(1, options["sync_every"] // options["fragments"])
    every = spacing * max(1, round(steps / (EVALUATIONS * spacing)))
    return every, (options["warmup_steps"] - 1) % every


def _stop(launchers: list[subprocess.Popen]) -> None:
    """SIGTERM to each launcher still running (its workers with it), SIGKILL to any
    still running after :data:`STOP_TIMEOUT_S`; wait for all."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for launcher in launchers:
            if launcher.poll() is None:
                try:
                    os.killpg(launcher.pid, signum)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(launcher.poll() is None for launcher in launchers) and time.monotonic() < deadline:
            time.sleep(0.1)
        if all(launcher.poll() is not None for launcher in launchers):
            return


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def _wait(launchers: list[subprocess.Popen], logs: list[Path]) -> None:
    """Return when every launcher has exited with 0; stop them all and raise
    :class:`IslandsFailed` when one fails, stop them all and re-raise on an interrupt."""
    try:
        while True:
            codes = [launcher.poll() for launcher in launchers]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                _stop(launchers)
                island = failed[0]
                raise IslandsFailed(f"island {island}'s launcher exited with {codes[island]}:\n{_tail(logs[island])}")
            if all(code == 0 for code in codes):
                return
            time.sleep(0.2)
    except BaseException:
        _stop(launchers)
        raise


def launch(args, options: dict[str, int]) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """Run the job on ``args.islands`` islands of ``args.world_size // args.islands``
    workers; return the job and each worker's results by rank
    (:func:`puredist.demo.island_worker.main`'s)."""
    count, per_island = args.islands, args.world_size // args.islands
    with network.Islands(count, per_island) as islands:
        print(f"  network namespaces {islands.prefix}-router, -i0..-i{count - 1} (gateways) and their workers; "
              f"the rendezvous on {islands.endpoint}", flush=True)
        folder = Path(tempfile.mkdtemp(prefix=".islands-", dir=args.output))
        try:
            the_job = job(args, islands, folder, options)
            (folder / "job.json").write_text(json.dumps(the_job))
            run_id = f"puredist-islands-{uuid.uuid4().hex[:8]}"
            logs = [folder / f"island{i}.log" for i in range(count)]
            launchers = []
            for island, log in enumerate(logs):
                with open(log, "w") as stderr:
                    command = network.launcher_command(islands, island, per_island, run_id,
                                                       [str(folder / "job.json"), str(island)])
                    launchers.append(subprocess.Popen(command, stderr=stderr, start_new_session=True))
            _wait(launchers, logs)
            results = {}
            for path in folder.glob("rank*.json"):
                results[int(path.stem[4:])] = json.loads(path.read_text())
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return the_job, dict(sorted(results.items()))


def options(task, knobs) -> dict[str, int]:
    """The islands' algorithms' options: ``H`` (``sync_every``; :data:`SYNC_EVERY`
    unless the knob is given) and the warm-up (the task's unless the knob is given);
    streaming DiLoCo's fragments and delay (:data:`STREAMING`)."""
    return {"sync_every": SYNC_EVERY if knobs.sync_every is None else knobs.sync_every,
            "warmup_steps": task.warmup_steps if knobs.warmup_steps is None else knobs.warmup_steps, **STREAMING}


def _refusal(algorithms: list[str], task, settings: dict[str, int], knobs, world_size: int) -> str | None:
    """Why one of ``algorithms`` cannot run with ``settings``, in one line; or None
    (each transform is built as the workers build it, so puredist's own rules decide)."""
    import warnings

    import puredist
    from puredist.demo.island_worker import DILOCO_VARIANTS, diloco_transform

    for algorithm in algorithms:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if algorithm in DILOCO_VARIANTS:
                    diloco_transform(algorithm, task, settings, knobs)
                elif algorithm == "hierarchical":
                    puredist.hierarchical_averager({settings["sync_every"]: world_size}, settings["warmup_steps"])
        except (TypeError, ValueError) as error:
            return (f"--algorithms {algorithm} cannot run on islands with --sync-every {settings['sync_every']} and "
                    f"--warmup-steps {settings['warmup_steps']} ({str(error).splitlines()[0]}): change them, or leave "
                    f"{algorithm} out")
    return None


def problem(args, task, knobs) -> str | None:
    """Why ``--islands`` cannot run with these options or on this machine, in one line
    (every check before anything starts); None if it can. Settles ``args.algorithms``
    (default :data:`ALGORITHMS`) and ``args.link`` (default :data:`DEFAULT_RATE`)."""
    from puredist.demo import links

    given = f"--islands {args.islands}"
    if args.islands < 2 or args.world_size % args.islands:
        return f"{given} needs at least 2 islands and --world-size a multiple of them (got --world-size {args.world_size})"
    args.algorithms = args.algorithms or list(ALGORITHMS)
    others = [a for a in args.algorithms if a not in ALGORITHMS]
    if others:
        return f"{given} runs {', '.join(ALGORITHMS)}, not {', '.join(others)}"
    if args.device != "cpu" or args.kill_worker is not None:
        return f"{given} trains on the cpu (Gloo over the links), without --kill-worker"
    args.link = args.link or [DEFAULT_RATE]
    if len(args.link) > 1:
        return f"{given} takes one --link rate (the inter-island links'), got {','.join(r.name for r in args.link)}"
    refused = _refusal(args.algorithms, task, options(task, knobs), knobs, args.world_size)
    if refused is not None:
        return refused
    reason = links.unavailable()
    return None if reason is None else f"{given} {reason}"
