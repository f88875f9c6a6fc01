"""The demo's summary: tables on stdout (measured, then projected) and a PNG of the curves.

This module must not train or measure: it formats results.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from puredist.demo import network

TARGET_TOLERANCE = 0.01
"""The projection's target: a held-out loss within 1 % of the first algorithm's final one."""
LINE_STYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)))
"""One per algorithm, so that curves that coincide (ZeRO is DDP step for step) stay visible."""


def summarize(results: dict[int, dict[str, Any]], task: str, title: str, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The job's summary (what ``results.json`` holds).

    Per algorithm (``"algorithms"``): the averaged model's held-out loss and accuracy
    as evaluated at the end (``eval_loss``, ``eval_accuracy``), the slowest rank's wall
    time, bytes sent per worker (mean and largest), the optimizer state a worker holds
    (largest), rank 0's curves, the slowest worker's bytes per step and training time
    at each evaluation (``training_s``), what the network model reads of the run
    (``step_group_sizes``, ``overlap_steps``, and ``wire_bytes_per_byte`` over real
    links: None elsewhere), for a fault-tolerant run its ``faults`` (``killed``: worker and step; ``rejoined``: worker
    and step, None if it did not; ``recovery_s``; ``steps_lost``) and ``failed_syncs``
    (the most any worker had), and the network
    model's projection (``steps_to_target``, ``projected_s`` per link: None where the
    target was not reached); ``evaluations`` lists, for each evaluation, its ``step``,
    held-out ``accuracy`` and ``loss``, and the mean ``bytes_per_worker`` sent so far.
    ``"network_model"``: its inputs, the target (``target_eval_loss``) being within
    ``target_tolerance`` (:data:`TARGET_TOLERANCE`) of the first algorithm's final
    held-out loss (``final_eval_loss``). ``"config"``: the run's configuration, as given (task, steps, seed,
    world size, device, hyper-parameters, versions).
    """
    world_size = len(results)
    runs = {algorithm: _run_record([results[rank][algorithm] for rank in sorted(results)])
            for algorithm in results[0]}
    compute_s = network.compute_seconds(
        [r[a]["step_seconds"] for r in results.values() for a in r], [r[a]["step_bytes"] for r in results.values() for a in r]
    )
    final = next(iter(runs.values()))["eval_loss"]
    target = final * (1 + TARGET_TOLERANCE)
    budgets = _project(runs, target, world_size, compute_s)
    return {
        "config": config or {},
        "task": task,
        "title": title,
        "world_size": world_size,
        "algorithms": runs,
        "network_model": {
            "projected_not_measured": True,
            "target_eval_loss": target,
            "target_tolerance": TARGET_TOLERANCE,
            "final_eval_loss": final,
            "target_from": next(iter(runs)),
            "compute_s_per_step": compute_s,
            "budget_s": budgets,
            "links": [link._asdict() for link in network.LINKS],
        },
    }


def _run_record(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One algorithm's entry of :func:`summarize` from each rank's record (rank order),
    before the network model's projections."""
    world_size = len(per_rank)
    _, accuracy, loss, _ = per_rank[0]["evaluations"][-1]
    run = {
        "eval_loss": loss,
        "eval_accuracy": accuracy,
        "wall_s": max(r["wall_s"] for r in per_rank),
        "bytes_per_worker": sum(r["bytes_sent"] for r in per_rank) / world_size,
        "bytes_per_worker_max": max(r["bytes_sent"] for r in per_rank),
        "state_bytes_max": max(r["state_bytes"] for r in per_rank),
        "train_losses": per_rank[0]["losses"],
        "evaluations": [
            {"step": step, "accuracy": acc, "loss": loss,
             "bytes_per_worker": sum(r["evaluations"][k][3] for r in per_rank) / world_size}
            for k, (step, acc, loss, _) in enumerate(per_rank[0]["evaluations"])
        ],
        "step_bytes": [max(sent) for sent in zip(*(r["step_bytes"] for r in per_rank))],
        "step_group_sizes": per_rank[0].get("step_group_sizes"),  # (None: every collective over all workers)
        "overlap_steps": per_rank[0].get("overlap_steps", 0),
        # over real links (``demo --link``): the frames its egress sent per byte its Gloo threads wrote
        "wire_bytes_per_byte": (sum(r["egress_bytes"] for r in per_rank) / sum(r["sent_bytes"] for r in per_rank)
                                if "egress_bytes" in per_rank[0] else None),
        # the slowest worker's training time at each evaluation (None: a worker that was not running then)
        "training_s": [max(t for t in times if t is not None)
                       for times in zip(*(r["training_s"] for r in per_rank))],
    }
    if "faults" in per_rank[0]:  # a fault-tolerant run: the same record on every rank
        run["faults"] = per_rank[0]["faults"]
        run["failed_syncs"] = max(r["failed_syncs"] for r in per_rank)
    return run


def _project(runs: dict[str, dict[str, Any]], target: float, world_size: int, compute_s: float) -> dict[str, float]:
    """Add the network model's projections to each run of ``runs`` (``steps_to_target``,
    ``projected_s``, ``projected_loss_within_budget``, per link); returns the budget
    per link: the shortest whole run's projected time."""
    budgets = {  # the shortest whole run on each link: every run's measurements cover it
        link.name: min(network.projected_seconds(measured(run), len(run["step_bytes"]), link, world_size, compute_s)
                       for run in runs.values())
        for link in network.LINKS
    }
    for run in runs.values():
        curve = [(e["step"], e["loss"]) for e in run["evaluations"]]
        reached = network.steps_to_reach(curve, target)
        run["steps_to_target"] = reached
        run["projected_s"] = {
            link.name: None if reached is None else network.projected_seconds(measured(run), reached, link, world_size,
                                                                              compute_s)
            for link in network.LINKS
        }
        run["projected_loss_within_budget"] = {
            link.name: network.best_loss_within(measured(run), [loss for _, loss in curve], link, world_size, compute_s,
                                                budgets[link.name])
            for link in network.LINKS
        }
    return budgets


def measured(run: dict[str, Any]) -> network.Measured:
    """What the network model reads of one algorithm's summary (:func:`summarize`'s)."""
    return network.Measured([e["step"] for e in run["evaluations"]], run["training_s"], run["step_bytes"],
                            run["step_group_sizes"], run["overlap_steps"],
                            run["wire_bytes_per_byte"] or network.WIRE_BYTES_PER_BYTE)


def table(summary: dict[str, Any]) -> str:
    """A fixed-width table of what was measured: the averaged model's held-out loss
    and accuracy, wall time, bytes sent per worker (mean, largest, the mean's ratio to
    the first algorithm's), and the optimizer state a worker holds."""
    runs = summary["algorithms"]
    first = next(iter(runs.values()))["bytes_per_worker"]  # 0: the first algorithm sent nothing, no ratio
    lines = [
        f"{'algorithm':14s} {'held-out loss':>13s} {'acc':>6s} {'wall':>6s} "
        f"{'sent/worker':>12s} {'max':>10s} {'vs first':>8s} {'opt state':>10s}",
    ]
    for algorithm, row in runs.items():
        lines.append(
            f"{algorithm:14s} {row['eval_loss']:13.3f} {100 * row['eval_accuracy']:5.1f}% {row['wall_s']:5.1f}s "
            f"{_size(row['bytes_per_worker']):>12s} {_size(row['bytes_per_worker_max']):>10s} "
            + (f"{row['bytes_per_worker'] / first:7.3f}x " if first else f"{'n/a':>8s} ")
            + f"{_size(row['state_bytes_max']):>10s}"
        )
    return "\n".join(lines)


def faults_table(summary: dict[str, Any]) -> str:
    """What the fault-tolerant runs lived through: the worker killed and when, when
    it rejoined and how long that took, the steps of its work lost, the failed
    synchronizations, and the held-out loss against the same algorithm without
    torchft (``diloco``) where it ran."""
    runs = summary["algorithms"]
    lines = ["FAULTS (fault-tolerant algorithms):"]
    for algorithm, row in runs.items():
        faults = row.get("faults")
        if faults is None:
            continue
        killed, rejoined = faults.get("killed"), faults.get("rejoined")
        text = "no worker killed" if killed is None else (
            f"worker {killed['worker']} killed at step {killed['step']}; "
            + (f"rejoined at step {rejoined['step']} after {faults['recovery_s']:.1f} s, "
               f"{faults['steps_lost']} steps of its work lost" if rejoined else "it did not rejoin before the end")
        )
        versus = (f"; held-out loss {row['eval_loss'] / runs['diloco']['eval_loss']:.3f}x diloco's"
                  if "diloco" in runs else "")
        lines.append(f"{algorithm:14s} {text}; {row['failed_syncs']} failed synchronizations{versus}")
    return "\n".join(lines)


def _size(count: float) -> str:
    return f"{count / 2**10:.1f} KiB" if count < 2**20 else f"{count / 2**20:.2f} MiB"


def _duration(seconds: float) -> str:
    return f"{1000 * seconds:.0f} ms" if seconds < 1 else f"{seconds:.1f} s" if seconds < 100 else f"{seconds:.0f} s"


def _per_link(runs: dict[str, Any], links: list[str], field: str, show, first_column) -> list[str]:
    """One line per algorithm: ``first_column(row)``, then ``row[field][link]`` shown by
    ``show`` for each link, the lowest per link marked ``*``, ``-`` for None."""
    lowest = {link: min((v for row in runs.values() if (v := row[field][link]) is not None), default=None) for link in links}
    lines = []
    for algorithm, row in runs.items():
        cells = [
            "-" if (value := row[field][link]) is None else show(value) + ("*" if value == lowest[link] else " ")
            for link in links
        ]
        lines.append(f"{algorithm:14s} {first_column(row):>6s} " + " ".join(f"{cell:>12s}" for cell in cells))
    return lines


def projection_table(summary: dict[str, Any]) -> str:
    """The network model's projections (see :mod:`puredist.demo.network`), per
    algorithm and link: the time to reach the target loss, and the loss reached within
    the link's time budget; the best per link marked ``*``, ``-`` where there is none."""
    model = summary["network_model"]
    runs, links = summary["algorithms"], [link["name"] for link in model["links"]]
    header = " ".join(f"{link:>12s}" for link in links)
    compute = model["compute_s_per_step"]
    hidden = ("" if compute is None else
              f", less the {1000 * compute:.1f} ms compute a step that a streaming fragment travels behind")
    return "\n".join([
        "PROJECTED (network model, not measured): each run's training time measured here plus, on each step that "
        f"sent bytes, their Ethernet frames over the link{hidden}, and 2(g-1) latencies (g: the workers its "
        "collective spans)",
        f"time to reach held-out loss {model['target_eval_loss']:.3f} (within {100 * model['target_tolerance']:.0f}% of "
        f"{model['target_from']}'s final {model['final_eval_loss']:.3f}):",
        f"{'algorithm':14s} {'step':>6s} " + header,
        *_per_link(runs, links, "projected_s", _duration,
                   lambda row: "-" if row["steps_to_target"] is None else str(row["steps_to_target"])),
        "(* the fastest on that link; - not reached)",
        "held-out loss reached within the same time (the fastest whole run's, per link):",
        f"{'algorithm':14s} {'':6s} " + " ".join(f"{_duration(model['budget_s'][link]):>12s}" for link in links),
        *_per_link(runs, links, "projected_loss_within_budget", lambda loss: f"{loss:.3f}", lambda row: ""),
        "(* the lowest on that link, each run read at its lowest evaluation within the time: a run that ends lower "
        "after it is not counted)",
    ])


def plot(summary: dict[str, Any], path: Path) -> None:
    """Three panels, one legend for all: held-out loss of the averaged model against
    step; its final value against the bytes each worker sent (log scale, one point per
    algorithm: the trade-off at a glance); and each algorithm's wall time. A killed
    worker's step is a dotted line in the first panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = summary["algorithms"]
    colors = plt.get_cmap("tab10" if len(runs) <= 10 else "tab20").colors
    figure, (curves, tradeoff, wall) = plt.subplots(1, 3, figsize=(15, 4.8), width_ratios=(1.2, 1.2, 0.8))
    for index, (algorithm, row) in enumerate(runs.items()):
        color, marker = colors[index % len(colors)], "os^Dv<>pPX*h"[index % 12]
        steps = [e["step"] for e in row["evaluations"]]
        losses = [e["loss"] for e in row["evaluations"]]
        curves.plot(steps, losses, color=color, linestyle=LINE_STYLES[index % len(LINE_STYLES)], marker=marker,
                    markersize=3, label=algorithm)
        killed = (row.get("faults") or {}).get("killed")
        if killed:
            curves.axvline(killed["step"], color=color, linestyle=":", linewidth=1, label=f"{algorithm}: worker killed")
        mib = max(row["bytes_per_worker"], 1) / 2**20
        tradeoff.scatter(mib, row["eval_loss"], color=color, marker=marker, s=50)
        wall.barh(index, row["wall_s"], color=color)
    curves.set(xlabel="training step", ylabel="held-out loss of the averaged model", title="loss against step")
    tradeoff.set(xscale="log", xlabel="MiB sent per worker (log scale)", ylabel="final held-out loss",
                 title="final loss against bytes sent")
    wall.set(yticks=range(len(runs)), yticklabels=list(runs), xlabel="seconds (training steps)", title="wall time")
    wall.invert_yaxis()
    for axis in (curves, tradeoff, wall):
        axis.grid(alpha=0.3)
    handles, labels = curves.get_legend_handles_labels()
    columns = min(6, len(labels))
    figure.legend(handles, labels, loc="lower center", ncol=columns, frameon=False)
    figure.suptitle(f"puredist demo: {summary['title']}, {summary['world_size']} local Gloo workers")
    figure.tight_layout(rect=(0, 0.03 + 0.05 * -(-len(labels) // columns), 1, 1))  # room for the legend's rows
    figure.savefig(path, dpi=100)
    plt.close(figure)
