"""The language-model study: DiLoCo against DDP, held-out loss against bytes sent.

Runs ``python -m puredist demo --task lm`` once per period ``H`` of :data:`GRID` (4
workers, the same data, steps and seed in every run; DDP in the first), then writes
into the output folder (default ``out/bench-lm``):

- ``H<period>/results.json``: each demo run's own report, and ``launch.json`` beside it
  (the run's whole setup, its command and wall time): a rerun keeps a report measured
  with the same setup, so an interrupted study resumes, and measures again where the
  setup differs (other ``--steps``, algorithms, options);
- ``study.json``: per configuration its algorithm, ``H``, payload, final held-out loss,
  bytes sent per worker, and the ratios of both to DDP's; the study's wall time and the
  most times a worker passed over its shard (``data_passes``, from each run's
  ``config``);
- ``study.md``: that table; ``study.png``: held-out loss against bytes sent per worker
  (each run's evaluations as a curve, log scale), with the published points as
  reference lines (:data:`REFERENCES`).

``make bench-lm`` runs it; ``--steps`` and ``--grid`` change the study (e.g.
``--grid 16:diloco,diloco_int4 64:diloco_int4``).

On Ctrl-C (or SIGINT, SIGTERM, SIGHUP to this script) the demo running is interrupted
once and waited for, so that it cleans up after itself (a ``--link`` study removes its
network namespaces); a second Ctrl-C stops the wait, not the demo.

This script must not train: the demo's workers do, and it reads their reports.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

GRID = (
    (80, ("ddp", "diloco_int2", "diloco_int4"), ("--block-size", "256")),
    (160, ("diloco_int2",), ("--block-size", "256")),
    (80, ("diloco_int2",), ("--block-size", "256", "--outer-lr", "1.0")),
    (16, ("diloco_sparse",), ("--outer-lr", "2.0")),
    (64, ("diloco_sparse",), ("--top-k", "256", "--outer-lr", "2.0")),
)
"""``(H, algorithms, further demo options)`` in the order run (DDP, which has no ``H``, once)."""
PAYLOADS = {"ddp": "fp32 gradients", "diloco": "bf16", "diloco_int8": "int8, blocks of {block_size}",
            "diloco_int4": "4-bit, blocks of {block_size}", "diloco_int2": "2-bit, blocks of {block_size}",
            "diloco_sparse": "{top_k} of 4096, 2-bit, no outer momentum"}
STEPS = 1920
REFERENCES = (
    (500, "DiLoCo: 500x fewer bytes than DDP (Douillard et al. 2023, arXiv:2311.08105)"),
    (146 * 30, "SparseLoCo in Covenant-72B: payloads 146x smaller than fp32, H = 30: ~4400x "
               "(Lidin et al. 2026, arXiv:2603.08163; H from a secondary source)"),
    (500 * 8, "MuLoCo: 2-bit, 8x fewer bytes than DiLoCo, at DiLoCo's 500x: 4000x (Therien et al. 2025, arXiv:2505.23725)"),
)
"""Published compression factors against DDP's bytes, ``(factor, label with source)``,
drawn at DDP's bytes divided by the factor (docs/lm-study.md says how each is derived)."""


def _grid(texts: list[str]) -> tuple:
    grid = []
    for text in texts:
        period, _, algorithms = text.partition(":")
        if not period.isdigit() or int(period) < 1 or not algorithms:
            raise SystemExit(f"error: --grid {text!r}: expected H:algorithm[,algorithm...], e.g. 64:diloco_int4")
        grid.append((int(period), tuple(algorithms.split(",")), ()))
    return tuple(grid)


def _label(period: int, options: tuple[str, ...]) -> str:
    return "-".join([f"H{period}", *(o.lstrip("-") for o in options)])


def _setup(period: int, algorithms: tuple[str, ...], options: tuple[str, ...], steps: int, extra: list[str]) -> list:
    """The demo's options for one run of the study but its output folder: the whole
    setup that a kept report is keyed by."""
    return ["--task", "lm", "--world-size", "4", "--steps", str(steps), "--sync-every", str(period),
            "--algorithms", ",".join(algorithms), *extra, *options]


def run_demo(command: list[str]) -> None:
    """Run the demo ``command`` to its end (``CalledProcessError`` if it fails), in a
    process group of its own: an interrupt of this script (SIGINT, SIGTERM, SIGHUP)
    reaches it once, forwarded here, and Ctrl-C is passed on only once the demo has
    exited, its own cleanup done (``subprocess.run`` killed it 0.25 s after Ctrl-C,
    before a ``--link`` run removed its network namespaces)."""
    process = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, process_group=0)
    forward = {s: signal.signal(s, lambda signum, _: _signal(process, signum)) for s in _FORWARDED}
    try:
        returncode = process.wait()
    except KeyboardInterrupt:
        _signal(process, signal.SIGINT)
        process.wait()
        raise
    finally:
        for signum, handler in forward.items():
            signal.signal(signum, handler)
    if returncode:
        raise subprocess.CalledProcessError(returncode, command)


def _signal(process: subprocess.Popen, signum: int) -> None:
    """Send ``signum`` to ``process``'s group, unless it is gone (it ended meanwhile)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


_FORWARDED = (signal.SIGTERM, signal.SIGHUP)
"""What :func:`run_demo` passes on to the demo as it comes (the demo cleans up on
either, then exits: a failed run here)."""


def run_period(period: int, algorithms: tuple[str, ...], options: tuple[str, ...], steps: int, output: Path,
               extra: list[str], run: Callable[[list[str]], None]) -> tuple[dict, float]:
    """The demo's report for one ``H`` and options and the run's wall time: read back
    where a run of the same setup (:func:`_setup`) was measured before, else measured
    by ``run(command)`` (again, where the kept report is of another setup)."""
    folder = output / _label(period, options)
    setup, launch = _setup(period, algorithms, options, steps, extra), folder / "launch.json"
    kept = json.loads(launch.read_text()) if launch.exists() and (folder / "results.json").exists() else {}
    if kept.get("setup") != setup:
        launch.unlink(missing_ok=True)  # (until this run ends, the folder holds no report of this setup)
        command = [sys.executable, "-m", "puredist", "demo", *setup, "--output", str(folder)]
        print("$", " ".join(command[1:]), flush=True)
        started = time.perf_counter()
        run(command)
        kept = {"setup": setup, "command": command[1:], "wall_s": time.perf_counter() - started}
        launch.write_text(json.dumps(kept))
    return json.loads((folder / "results.json").read_text()), kept["wall_s"]


def rows(reports: dict[tuple, dict]) -> list[dict]:
    """One row per configuration, with its loss and bytes against DDP's (the first
    report that holds a ``ddp`` run)."""
    ddp = next(r["algorithms"]["ddp"] for r in reports.values() if "ddp" in r["algorithms"])
    ddp_losses = {e["step"]: e["loss"] for e in ddp["evaluations"]}
    table = []
    for (period, options), report in reports.items():
        config = report["config"]
        for algorithm, run in report["algorithms"].items():
            outer = config["sparse_outer_options"] if algorithm == "diloco_sparse" else config["outer_options"]
            table.append({
                "algorithm": algorithm, "H": None if algorithm == "ddp" else period,
                "payload": PAYLOADS.get(algorithm, algorithm).format(top_k=config.get("top_k"),
                                                                      block_size=config.get("block_size")),
                "outer_lr": None if algorithm == "ddp" else outer["lr"], "data_passes": config["data_passes"],
                "eval_loss": run["eval_loss"],
                "bytes_per_worker": run["bytes_per_worker"], "loss_vs_ddp": run["eval_loss"] / ddp["eval_loss"],
                "bytes_vs_ddp": run["bytes_per_worker"] / ddp["bytes_per_worker"],
                "curve": [(e["bytes_per_worker"], e["loss"]) for e in run["evaluations"]],
                "loss_vs_ddp_by_step": {e["step"]: e["loss"] / ddp_losses[e["step"]] for e in run["evaluations"]},
            })
    return sorted(table, key=lambda row: (row["algorithm"] != "ddp", row["bytes_per_worker"]))


def markdown(table: list[dict]) -> str:
    """The table: final loss and bytes against DDP's, and the loss ratio at a third
    and two thirds of the run (the evaluations nearest them): whether the gap closes."""
    steps = sorted(table[0]["loss_vs_ddp_by_step"])
    thirds = [min(steps, key=lambda s: abs(s - steps[-1] * t / 3)) for t in (1, 2)]
    lines = ["| algorithm | H | payload | outer lr | held-out loss | loss / DDP | "
             + " | ".join(f"at step {s}" for s in thirds) + " | bytes sent per worker | DDP's bytes / these |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in table:
        lines.append(f"| {row['algorithm']} | {row['H'] or '-'} | {row['payload']} | {row['outer_lr'] or '-'} | "
                     f"{row['eval_loss']:.4f} | {row['loss_vs_ddp']:.3f}x | "
                     + " | ".join(f"{row['loss_vs_ddp_by_step'][s]:.3f}x" for s in thirds) + " | "
                     f"{row['bytes_per_worker'] / 2**20:.2f} MiB | "
                     f"{1 / row['bytes_vs_ddp']:.0f} |")
    return "\n".join(lines)


def plot(table: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for row in table:
        label = "ddp" if row["algorithm"] == "ddp" else f"{row['payload']}, H={row['H']}, outer lr {row['outer_lr']}"
        points = [(sent / 2**20, loss) for sent, loss in row["curve"] if sent > 0]
        line, = axes.plot(*zip(*points), marker=".", label=label) if points else (None,)
        if line is not None:
            axes.plot(points[-1][0], points[-1][1], "o", color=line.get_color())
    ddp = next(row for row in table if row["algorithm"] == "ddp")
    axes.axhline(ddp["eval_loss"], color="gray", linestyle=":", label="ddp's final loss")
    for (factor, label), style in zip(REFERENCES, ("--", "-.", ":")):
        axes.axvline(ddp["bytes_per_worker"] / 2**20 / factor, color="black", linestyle=style, linewidth=0.8,
                     label=label)
    axes.set(xscale="log", xlabel="bytes sent per worker (MiB, log)", ylabel="held-out loss (nats/char)", title=title)
    axes.legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None, run: Callable[[list[str]], None] = run_demo) -> int:
    """The study (``run``: how a demo command runs, :func:`run_demo`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS, help=f"steps of every run (default {STEPS})")
    parser.add_argument("--grid", nargs="+", default=None, help="H:algorithm,... (default: the study's grid)")
    parser.add_argument("--output", type=Path, default=Path("out/bench-lm"))
    args, extra = parser.parse_known_args(argv)  # the rest goes to every demo run (e.g. --outer-lr 0.5)
    grid = _grid(args.grid) if args.grid else GRID
    if not any("ddp" in algorithms for _, algorithms, _ in grid):
        raise SystemExit(f"error: --grid {' '.join(args.grid)}: no period runs ddp, the reference of every ratio")
    measured = {(period, options): run_period(period, algorithms, options, args.steps, args.output, extra, run)
                for period, algorithms, options in grid}
    reports, wall = {key: report for key, (report, _) in measured.items()}, sum(w for _, w in measured.values())
    table = rows(reports)
    passes = max(row["data_passes"] for row in table)
    (args.output / "study.md").write_text(f"{markdown(table)}\n\nEach worker passed over its shard at most {passes:.2f} times.\n")
    (args.output / "study.json").write_text(json.dumps(
        {"steps": args.steps, "world_size": 4, "extra_options": extra, "wall_s": wall,
         "data_passes": passes,
          "rows": [{k: v for k, v in row.items() if k != "curve"} for row in table]}, indent=1))
    plot(table, args.output / "study.png", f"char-level GPT, 4 workers, {args.steps} steps: loss against bytes")
    print(markdown(table))
    print(f"\nwrote {args.output / 'study.md'}, study.json and study.png (the demo runs: {wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
