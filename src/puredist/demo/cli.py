"""``python -m puredist demo``: the main job, on local processes, no cluster needed.

Spawns ``--world-size`` worker processes over Gloo on 127.0.0.1 with torch's own
elastic launcher (the engine of ``torchrun``), trains the same model under each
algorithm, then prints a table and writes ``results.json`` and ``demo.png`` into the
output folder.

This module must not train: it starts the workers and reports what they return.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Sequence

from puredist.demo import island_run, links
from puredist.demo.fault_tolerant import FAULT_TOLERANT
from puredist.demo.knobs import KNOB_OPTIONS, Knobs, knobs_task
from puredist.demo.training import ALGORITHMS, TASKS, refusal

EVERY_ALGORITHM = ALGORITHMS + FAULT_TOLERANT
DEFAULT_FAULT_TOLERANT = ("diloco_ft",)


def install_hint(extra: str) -> str:
    """How to install one of puredist's extras: from its clone, as the README says."""
    return f"pip install -e '.[{extra}]' -c constraints.txt (in puredist's clone)"
"""Run by default where torchft is installed (``torchft_diloco`` is a comparison, on request)."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _algorithms(text: str) -> list[str]:
    chosen = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))  # each once
    unknown = [name for name in chosen if name not in EVERY_ALGORITHM]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"unknown algorithm(s) {unknown or [text]}; choose from {', '.join(EVERY_ALGORITHM)}"
        )
    return chosen


def _rates(text: str) -> list[links.Rate]:
    try:
        return links.parse_rates(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m puredist demo",
        description=(
            "Train a task with local worker processes (Gloo on 127.0.0.1, no GPU, no network), once "
            "per algorithm, and compare the averaged model's held-out loss and accuracy, wall time, "
            "the bytes each worker sent and the optimizer state it held; then project, from the "
            "measured bytes and compute time, the time each would take to reach the first "
            "algorithm's loss over real links. Tasks: digits (an MLP on scikit-learn's handwritten "
            "digits, SGD, H=8, ~45 s on 2 cores), lm (a character-level GPT on the Python standard library's sources, "
            "AdamW, H=16, ~8 min) and lm-large (the same GPT at 19M parameters on 256-character "
            "windows: for --device cuda; seconds a step per worker on a CPU). Algorithms: ddp (gradient all-reduce every step), periodic "
            "(post-local SGD: average every H steps), hierarchical (pairs every H/4 steps, everybody "
            "every H), zero (ZeRO optimizer step overlapped with DDP), diloco (outer Nesterov SGD on "
            "bf16 pseudo-gradients every H steps), streaming (DiLoCo in 2 fragments, each applied 2 "
            "steps after it starts), diloco_int8, diloco_int4, diloco_int2 (int8, 4-bit, 2-bit pseudo-gradients with error "
            "feedback), "
            "diloco_sparse (SparseLoCo: 64 values of each 4096, 2-bit, error feedback, outer SGD lr 1.5 without "
            "momentum), diloco_ft (diloco over torchft, one replica group per worker, "
            "a lighthouse started here; with --kill-worker a worker is killed, restarts, heals and rejoins), "
            "torchft_diloco (for comparison, on request: torchft's own DiLoCo with torch.optim, fp32 "
            "pseudo-gradients, no warm-up)."
        ),
    )
    parser.add_argument("--world-size", type=_positive_int, default=4, help="worker processes (default 4)")
    parser.add_argument("--task", choices=list(TASKS), default=None,
                        help="what to train (default digits; lm with --islands)")
    parser.add_argument(
        "--steps", type=_positive_int, default=None,
        help="training steps per algorithm (default: " + ", ".join(f"{t.default_steps} for {t.name}" for t in TASKS.values()) + ")",
    )
    parser.add_argument(
        "--algorithms", type=_algorithms, default=None,
        help=f"comma-separated subset of {','.join(EVERY_ALGORITHM)} (default: all but torchft_diloco; diloco_ft "
             "where torchft is installed and the device is cpu)",
    )
    parser.add_argument(
        "--kill-worker", type=_positive_int, default=None, metavar="STEP",
        help="kill the last worker of every fault-tolerant algorithm (diloco_ft, torchft_diloco) at this step; "
             "it restarts, heals from a peer and rejoins",
    )
    parser.add_argument("--output", type=Path, default=None,
                        help="folder for demo.png and results.json (default out/demo, out/demo-lm for --task lm)")
    parser.add_argument("--seed", type=int, default=0, help="seed for data split, model and batches (default 0)")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="where the workers train (default cpu). cuda: NCCL with a GPU per worker when the machine has as many "
             "(bytes are then counted for Gloo's traffic only: the rank checks), else every worker on GPU 0 over Gloo",
    )
    parser.add_argument(
        "--link", type=_rates, default=None, metavar="RATE[,RATE...]",
        help="train once per rate over real links instead of loopback: each worker in its own network namespace on "
             "one bridge, its egress shaped by tbf to RATE (e.g. 20mbit,100mbit; needs root and iproute2), the "
             "fault-tolerant algorithms left out; report the measured time beside the network model's projection",
    )
    parser.add_argument(
        "--islands", type=_positive_int, default=None, metavar="N",
        help="train on N islands of --world-size/N workers instead (as root): each island's workers on a bridge of "
             "their own, the islands joined through a router by links shaped to --link's rate (default "
             f"{island_run.DEFAULT_RATE.name}), each island started by a torchrun of its own; algorithms "
             f"{','.join(island_run.ALGORITHMS)}; report wall time, compute utilization and time to ddp's loss beside "
             "the network model (docs/links.md)",
    )
    _add_knobs(parser)
    return parser


def _add_knobs(parser: argparse.ArgumentParser) -> None:
    """The options of what a DiLoCo study varies (:mod:`puredist.demo.knobs`)."""
    group = parser.add_argument_group("what a DiLoCo study varies")
    for option, (kind, metavar, text) in KNOB_OPTIONS.items():
        group.add_argument(option, type=kind, default=None, metavar=metavar, help=text)


def _knobs(args: argparse.Namespace) -> Knobs:
    return Knobs(*(getattr(args, option[2:].replace("-", "_")) for option in KNOB_OPTIONS))


def _writable_folder(path: Path) -> str | None:
    """None if ``path`` is (made) a writable folder, else why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{uuid.uuid4().hex}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        return f"{error.strerror or error}"
    return None


def _run_config(args: argparse.Namespace, task) -> dict:
    """What ``results.json`` records of the run: enough to run it again and to know what ran."""
    import platform

    import torch

    from puredist import __version__
    from puredist.demo.knobs import block_size, outer_options, top_k
    from puredist.demo.training import STREAMING_DELAY, STREAMING_FRAGMENTS

    knobs = _knobs(args)
    task = knobs_task(task, knobs)
    return {
        "task": args.task, "steps": args.steps, "seed": args.seed, "world_size": args.world_size,
        "algorithms": args.algorithms, "device": args.device, "backend": args.backend, "kill_worker": args.kill_worker,
        "link": [rate.name for rate in args.link] if args.link else None,
        "period": task.period, "warmup_steps": task.warmup_steps,
        "data_passes": task.data_passes(args.steps, args.world_size),
        "optimizer": task.optimizer, "optimizer_options": task.optimizer_options, "outer_options": outer_options(knobs, task),
        "block_size": block_size(knobs),
        "sparse_outer_options": outer_options(knobs, task, sparse=True), "top_k": top_k(knobs),
        "streaming": {"fragments": STREAMING_FRAGMENTS, "delay": STREAMING_DELAY},
        "versions": {"puredist": __version__, "torch": torch.__version__, "python": platform.python_version()},
    }


def _choose_algorithms(args: argparse.Namespace) -> str | None:
    """Settle ``args.algorithms`` (the default: every algorithm that runs here); return
    why the options cannot run, or None."""
    runs_ft = importlib.util.find_spec("torchft") is not None and args.device == "cpu"
    if args.algorithms is None:
        args.algorithms = list(ALGORITHMS + DEFAULT_FAULT_TOLERANT if runs_ft else ALGORITHMS)
        if not runs_ft:
            print(f"(not running {', '.join(DEFAULT_FAULT_TOLERANT)}: " + ("it trains on the cpu only)" if args.device != "cpu"
                  else f"it needs torchft: {install_hint('ft')})"))
    fault_tolerant = [a for a in args.algorithms if a in FAULT_TOLERANT]
    if fault_tolerant and not runs_ft:
        return (f"--algorithms {','.join(fault_tolerant)} " + ("trains on the cpu only" if args.device != "cpu" else
                f"needs torchft: {install_hint('ft')}"))
    if args.kill_worker is not None:
        if not fault_tolerant:
            return f"--kill-worker {args.kill_worker} kills a worker of a fault-tolerant algorithm: add diloco_ft"
        if args.world_size < 2 or args.kill_worker > args.steps:
            return (f"--kill-worker {args.kill_worker} needs a worker that survives (--world-size >= 2, got "
                    f"{args.world_size}) and a step of the run (--steps {args.steps})")
    return None


def _link_problem(args: argparse.Namespace) -> str | None:
    """Why ``--link`` cannot run with these options or on this machine, or None."""
    fault_tolerant = [a for a in args.algorithms if a in FAULT_TOLERANT]
    if fault_tolerant:
        return f"--link runs the algorithms torch's launcher starts, not {','.join(fault_tolerant)}"
    if args.device != "cpu":
        return f"--link trains on the cpu (Gloo over the links), not --device {args.device}"
    reason = links.unavailable()
    return None if reason is None else f"--link {','.join(rate.name for rate in args.link)} {reason}"


def _launch(args: argparse.Namespace, host: str | None = None, entrypoint=None, **job_options) -> dict:
    """Train every algorithm of ``args`` on ``args.world_size`` workers; return per
    rank per algorithm what it measured. The rendezvous listens on ``host`` (default
    127.0.0.1), the workers start at ``entrypoint`` (default
    :func:`puredist.demo.training.worker_main`), whose job carries ``job_options``."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from puredist.demo.training import worker_main

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=args.world_size,
        run_id=f"puredist-demo-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"{host or '127.0.0.1'}:0",  # the launcher's store owns the port before workers start
        local_addr=host,  # where the workers find the store (None: this host's name)
        rdzv_configs={"is_host": True},  # a single node: this process hosts the store, whatever its address
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    job = {"task": args.task, "steps": args.steps, "seed": args.seed, "device": args.device, "backend": args.backend,
           "algorithms": [a for a in args.algorithms if a not in FAULT_TOLERANT], "knobs": tuple(_knobs(args)),
           **job_options}
    results = (elastic_launch(config, entrypoint or worker_main)(job) if job["algorithms"]
               else {r: {} for r in range(args.world_size)})
    for algorithm in args.algorithms:
        if algorithm in FAULT_TOLERANT:
            from puredist.demo import fault_tolerant

            print(f"  {algorithm:13s} (over torchft" + (f", worker {args.world_size - 1} killed at step "
                  f"{args.kill_worker})" if args.kill_worker else ")"), flush=True)
            trained = fault_tolerant.run({**job, "algorithm": algorithm, "world_size": args.world_size,
                                          "kill_step": args.kill_worker})
            for rank, result in trained.items():
                results[rank][algorithm] = result
    # in the order given (the fault-tolerant runs ran last): the first is the report's reference
    return {rank: {a: by_algorithm[a] for a in args.algorithms} for rank, by_algorithm in results.items()}


DEMO_EXTRAS = {"sklearn": "scikit-learn", "matplotlib": "matplotlib", "tqdm": "tqdm"}
WORKER_MEMORY_BYTES = 400 * 2**20
"""About what one worker process needs (torch imported, the model, Gloo's buffers)."""


def _missing_extras() -> list[str]:
    return [package for module, package in DEMO_EXTRAS.items() if importlib.util.find_spec(module) is None]


def _available_memory() -> int:
    """Bytes of memory available to new processes (``MemAvailable``: free plus reclaimable)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _most_workers(available: int) -> int:
    """The most workers this machine can hold: 8 per core, and the memory available."""
    return max(1, min(8 * (os.cpu_count() or 1), available // WORKER_MEMORY_BYTES))


def _machine_problem(args: argparse.Namespace) -> str | None:
    """What this machine lacks for the job ``args`` asks for (the demo's extras, memory
    for ``--world-size`` workers, a writable ``--output``), or ``None``."""
    missing = _missing_extras()
    if missing:
        return f"the demo needs {' and '.join(missing)}: {install_hint('demo')}"
    available = _available_memory()
    most = _most_workers(available)
    if args.world_size > most:
        return (f"--world-size {args.world_size} is more worker processes than this machine holds "
                f"({os.cpu_count()} cores, {available / 2**30:.0f} GiB "
                f"available, ~{WORKER_MEMORY_BYTES // 2**20} MiB a worker): at most {most} here")
    problem = _writable_folder(args.output)
    if problem is not None:
        return f"--output {str(args.output)!r} is not a writable folder: {problem}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.task = args.task or (island_run.DEFAULT_TASK if args.islands else "digits")
    args.output = args.output or Path("out/islands" if args.islands else "out/demo" if args.task == "digits"
                                      else f"out/demo-{args.task}")
    problem = _machine_problem(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # torch's C++ warnings (deprecations inside torch and Gloo, printed by the workers'
    # threads) are not the user's to act on here; the workers read this when torch loads
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    task = TASKS[args.task]
    args.steps = args.steps or task.default_steps
    args.backend, where = "gloo", "127.0.0.1 (Gloo)"
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda: no CUDA GPU is visible here", file=sys.stderr)
            return 2
        gpus = torch.cuda.device_count()
        args.backend = "cpu:gloo,cuda:nccl" if gpus >= args.world_size else "gloo"
        where = (f"{args.world_size} of {gpus} {torch.cuda.get_device_name(0)} GPUs (NCCL)" if gpus >= args.world_size
                 else f"one {torch.cuda.get_device_name(0)} GPU, shared (Gloo)")
    if args.link and not args.islands and args.algorithms is None:
        args.algorithms = list(ALGORITHMS)
    knobs = _knobs(args)
    if args.islands:
        problem = island_run.problem(args, knobs_task(task, knobs), knobs)
    else:
        problem = (_choose_algorithms(args) or refusal(knobs_task(task, knobs), knobs, args.world_size, args.algorithms)
                   or (_link_problem(args) if args.link else None))
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.islands:
        where = (f"{args.islands} islands joined by links of {args.link[0].name} (Gloo, one network namespace each, a "
                 f"torchrun per island)")
    elif args.link:
        where = f"links of {', '.join(rate.name for rate in args.link)} (Gloo, one network namespace each)"
    print(f"puredist demo: {task.title}; {args.world_size} workers on {where}, {args.steps} steps per algorithm")
    started = time.perf_counter()
    try:
        if args.islands:
            return _report_islands(args, task, knobs, started)
        if args.link:
            return _report_links(args, links.measure(args, _launch, _run_config(args, task)), started)
        results = _launch(args)
    except (KeyboardInterrupt, SignalException):
        print("\ninterrupted: every worker was stopped", file=sys.stderr)
        return 130
    except ChildFailedError as error:
        print(f"\nerror: a worker failed:\n{error.format_msg()}", file=sys.stderr)
        return 1
    except island_run.IslandsFailed as error:
        print(f"\nerror: a worker failed: {error}", file=sys.stderr)
        return 1
    except (RuntimeError, TimeoutError) as error:  # a fault-tolerant run's worker failed, the run hung, a link failed
        print(f"\nerror: {error}", file=sys.stderr)
        return 1
    return _report_local(args, task, results, started)


def _report_local(args: argparse.Namespace, task, results: dict, started: float) -> int:
    """Print the tables of a run on local processes, write its results.json and plot."""
    from puredist.demo.report import faults_table, plot, projection_table, summarize, table

    summary = summarize(results, task.name, task.title, _run_config(args, task))
    print(f"\n{table(summary)}\n\n{projection_table(summary)}")
    if any("faults" in row for row in summary["algorithms"].values()):
        print(f"\n{faults_table(summary)}")
    (args.output / "results.json").write_text(json.dumps(summary, indent=1))
    plot(summary, args.output / "demo.png")
    print(f"\nwrote {args.output / 'demo.png'} and {args.output / 'results.json'} "
          f"({time.perf_counter() - started:.0f} s in all)")
    return 0


def _report_islands(args: argparse.Namespace, task, knobs: Knobs, started: float) -> int:
    from puredist.demo.island_report import islands_table, summarize

    settings = island_run.options(knobs_task(task, knobs), knobs)
    args.knobs = knobs
    job, results = island_run.launch(args, settings)
    config = {**_run_config(args, task), "period": settings["sync_every"], "warmup_steps": settings["warmup_steps"],
              "streaming": {"fragments": settings["fragments"], "delay": settings["delay"]}, "islands": args.islands,
              "local_steps": island_run.LOCAL_STEPS * args.steps, "shaped_ddp_steps": island_run.SHAPED_DDP_STEPS}
    summary = summarize(job, results, config, task.title)
    print()
    print(islands_table(summary))
    (args.output / "results.json").write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {args.output / 'results.json'} ({time.perf_counter() - started:.0f} s in all)")
    return 0


def _report_links(args: argparse.Namespace, measured: dict, started: float) -> int:
    print()
    print(links.links_table(measured))
    (args.output / "results.json").write_text(json.dumps(measured, indent=1))
    print(f"\nwrote {args.output / 'results.json'} ({time.perf_counter() - started:.0f} s in all)")
    return 0
