"""The demo's summary: a table on stdout and a PNG of the curves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LINE_STYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)))
"""One per algorithm, so that curves that coincide (ZeRO is DDP step for step) stay visible."""


def summarize(results: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per algorithm: the averaged model's held-out loss and accuracy (as evaluated
    at the end), the slowest rank's wall time, bytes sent per worker (mean and
    largest), optimizer state per worker (largest), and rank 0's curves."""
    summary = {}
    for algorithm, run in results[0].items():
        per_rank = [results[rank][algorithm] for rank in sorted(results)]
        _, accuracy, loss, _ = run["evaluations"][-1]
        summary[algorithm] = {
            "heldout_loss": loss,
            "heldout_accuracy": accuracy,
            "wall_s": max(r["wall_s"] for r in per_rank),
            "bytes_sent": sum(r["bytes_sent"] for r in per_rank) / len(per_rank),
            "bytes_sent_max": max(r["bytes_sent"] for r in per_rank),
            "state_bytes_max": max(r["state_bytes"] for r in per_rank),
            "train_losses": run["losses"],
            # (step, held-out accuracy, held-out loss, mean bytes sent per worker so far)
            "evaluations": [
                (step, acc, loss, sum(r["evaluations"][k][3] for r in per_rank) / len(per_rank))
                for k, (step, acc, loss, _) in enumerate(run["evaluations"])
            ],
        }
    return summary


def table(summary: dict[str, dict[str, Any]]) -> str:
    """A fixed-width table: the averaged model's held-out loss and accuracy, wall time,
    bytes sent per worker (mean, largest, the mean's ratio to the first algorithm's),
    and the optimizer state a worker holds."""
    first = next(iter(summary.values()))["bytes_sent"] or 1
    lines = [
        f"{'algorithm':14s} {'held-out loss':>13s} {'acc':>6s} {'wall':>6s} "
        f"{'sent/worker':>12s} {'max':>9s} {'vs first':>8s} {'opt state':>10s}",
    ]
    for algorithm, row in summary.items():
        lines.append(
            f"{algorithm:14s} {row['heldout_loss']:13.3f} {100 * row['heldout_accuracy']:5.1f}% {row['wall_s']:5.1f}s "
            f"{row['bytes_sent'] / 2**20:8.2f} MiB {row['bytes_sent_max'] / 2**20:5.2f} MiB "
            f"{row['bytes_sent'] / first:7.2f}x {row['state_bytes_max'] / 2**10:6.1f} KiB"
        )
    return "\n".join(lines)


def plot(summary: dict[str, dict[str, Any]], path: Path) -> None:
    """Held-out loss of the averaged model against step and against bytes sent,
    held-out accuracy against bytes sent, and rank 0's training loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for index, (algorithm, row) in enumerate(summary.items()):
        style = dict(label=algorithm, linestyle=LINE_STYLES[index % len(LINE_STYLES)])
        steps, accuracies, losses, sent = zip(*row["evaluations"])
        mib = [b / 2**20 for b in sent]
        axes[0][0].plot(steps, losses, marker="o", markersize=3, **style)
        axes[0][1].plot(mib, losses, marker="o", markersize=3, **style)
        axes[1][0].plot(mib, [100 * a for a in accuracies], marker="o", markersize=3, **style)
        train = row["train_losses"]
        window = max(1, len(train) // 30)
        smooth = [sum(train[max(0, i - window + 1): i + 1]) / len(train[max(0, i - window + 1): i + 1]) for i in range(len(train))]
        axes[1][1].plot(range(1, len(train) + 1), smooth, **style)
    for (i, j), (x, y) in {
        (0, 0): ("training step", "held-out loss of the averaged model"),
        (0, 1): ("MiB sent per worker", "held-out loss of the averaged model"),
        (1, 0): ("MiB sent per worker", "held-out accuracy of the averaged model (%)"),
        (1, 1): ("training step", "training loss, rank 0's minibatches (smoothed)"),
    }.items():
        axes[i][j].set_xlabel(x)
        axes[i][j].set_ylabel(y)
        axes[i][j].grid(alpha=0.3)
        axes[i][j].legend()
    figure.suptitle("puredist demo: handwritten digits, local Gloo workers")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
