"""The demo's summary: a table on stdout and a PNG of the curves."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def summarize(results: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per algorithm: rank 0's curves, the slowest rank's wall time, and the bytes
    sent per worker (mean and largest)."""
    summary = {}
    for algorithm, run in results[0].items():
        per_rank = [results[rank][algorithm] for rank in sorted(results)]
        summary[algorithm] = {
            "final_accuracy": run["evaluations"][-1][1],
            "final_loss": sum(r["losses"][-1] for r in per_rank) / len(per_rank),
            "wall_s": max(r["wall_s"] for r in per_rank),
            "bytes_sent": sum(r["bytes_sent"] for r in per_rank) / len(per_rank),
            "bytes_sent_max": max(r["bytes_sent"] for r in per_rank),
            "losses": run["losses"],
            # (step, rank 0's view of the consensus accuracy, mean bytes sent so far)
            "evaluations": [
                (step, acc, sum(r["evaluations"][k][2] for r in per_rank) / len(per_rank))
                for k, (step, acc, _) in enumerate(run["evaluations"])
            ],
        }
    return summary


def table(summary: dict[str, dict[str, Any]]) -> str:
    """A fixed-width table: accuracy, loss, wall time, bytes sent per worker (mean,
    largest, and the mean's ratio to the first algorithm's)."""
    first = next(iter(summary.values()))["bytes_sent"] or 1
    lines = [
        f"{'algorithm':14s} {'held-out acc':>12s} {'final loss':>11s} {'wall':>7s} "
        f"{'sent/worker':>12s} {'max':>9s} {'vs first':>9s}",
    ]
    for algorithm, row in summary.items():
        lines.append(
            f"{algorithm:14s} {100 * row['final_accuracy']:11.1f}% {row['final_loss']:11.3f} {row['wall_s']:6.1f}s "
            f"{row['bytes_sent'] / 2**20:8.2f} MiB {row['bytes_sent_max'] / 2**20:5.2f} MiB {row['bytes_sent'] / first:8.2f}x"
        )
    return "\n".join(lines)


def plot(summary: dict[str, dict[str, Any]], path: Path) -> None:
    """Loss and accuracy against step and against bytes sent, one line per algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for algorithm, row in summary.items():
        losses = row["losses"]
        window = max(1, len(losses) // 30)
        smooth = [sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1]) for i in range(len(losses))]
        steps = list(range(1, len(losses) + 1))
        per_step_bytes = row["bytes_sent"] / max(1, len(losses))
        axes[0][0].plot(steps, smooth, label=algorithm)
        axes[0][1].plot([s * per_step_bytes / 2**20 for s in steps], smooth, label=algorithm)
        eval_steps, accuracies, sent = zip(*row["evaluations"])
        axes[1][0].plot(eval_steps, [100 * a for a in accuracies], marker="o", label=algorithm)
        axes[1][1].plot([b / 2**20 for b in sent], [100 * a for a in accuracies], marker="o", label=algorithm)
    for (i, j), (x, y) in {
        (0, 0): ("step", "training loss (rank 0, smoothed)"),
        (0, 1): ("MiB sent per worker (average rate)", "training loss (rank 0, smoothed)"),
        (1, 0): ("step", "held-out accuracy of the averaged model (%)"),
        (1, 1): ("MiB sent per worker", "held-out accuracy of the averaged model (%)"),
    }.items():
        axes[i][j].set_xlabel(x)
        axes[i][j].set_ylabel(y)
        axes[i][j].grid(alpha=0.3)
        axes[i][j].legend()
    figure.suptitle("puredist demo: handwritten digits, local Gloo workers")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
