"""``demo --islands``: what the workers measured, summarized, projected and tabled.

Per algorithm, from its two runs (unshaped and at the rate; every worker's records,
:func:`puredist.demo.island_worker.train`'s):

- ``wall_s``: the shaped run's training time (the slowest worker's, evaluations left
  out). DDP's shaped run is short (its steps all alike: one all-reduce over the slow
  link each); its wall time is its time per step there times its steps
  (``wall_from``: ``"per step"``), its loss curve the unshaped run's.
- ``utilization``: the lowest over the workers (``utilization_per_worker``) of ``1 -
  blocked / training time``: the share of its training time a worker was not waiting
  on the slow link. ``evaluation_waits_s``: of the blocked time, the most any worker
  spent before an evaluation waiting for the synchronizations in flight (a run that
  evaluated less often would wait less).
- ``to_target_s``: the training time at the first evaluation within
  :data:`TARGET_TOLERANCE` of DDP's final held-out loss (the target, the first
  algorithm's where DDP did not run), None where none is; ``steps_to_target``.
- ``projected_s`` (the network model, :func:`projected_seconds`) and ``ratio``
  (``wall_s / projected_s``).
- ``eval_loss``: the final held-out loss of its curve.

``rho`` (:func:`rho`), the compute-to-communication ratio: the time one fp32 gradient
takes over the inter-island link at the rate, over the compute time of a step (a
step's training time less the time it was blocked on the link, the mean over every
shaped run and worker).

This module must not train or measure: it reads what the workers measured.
"""

from __future__ import annotations

from typing import Any

TARGET_TOLERANCE = 0.01
"""The target: within 1 % of DDP's final held-out loss."""


def _run(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One run of one algorithm, from each worker's record (rank order)."""
    steps = len(rows[0]["step_s"])
    training = [r["training_s"][-1] for r in rows]
    blocked = [sum(r["blocked_s"]) for r in rows]
    directions = [sent for r in rows if r["link_bytes"] for sent in r["link_bytes"]]
    return {
        "steps": steps,
        "evaluations": [{"step": k, "accuracy": a, "loss": loss} for k, a, loss in rows[0]["evaluations"]],
        "training_s": [max(times) for times in zip(*(r["training_s"] for r in rows))],
        "utilization_per_worker": [1 - b / t for b, t in zip(blocked, training)],
        "evaluation_waits_s": max(sum(r["evaluation_waits_s"]) for r in rows),
        "compute_s_per_step": sum(t - b for t, b in zip(training, blocked)) / (steps * len(rows)),
        "crossings": len(rows[0]["crossed"]),
        "link_bytes": max(directions, default=0),
        "bytes_per_worker": sum(r["bytes_written"] for r in rows) / len(rows),
    }


def projected_seconds(unshaped: dict[str, Any], bits_per_second: float, overlap_steps: int) -> float:
    """The network model: the unshaped run's training time plus, for each of its
    crossings (the steps that started a collective spanning islands), its share of the
    busiest link direction's bytes (frames, measured unshaped) at the rate, less the
    compute of ``overlap_steps`` steps it travels behind (streaming DiLoCo's delay; 0
    for the others, which wait for their bytes). No latency (none is emulated)."""
    crossings = unshaped["crossings"]
    if not crossings:
        return unshaped["training_s"][-1]
    per_crossing = unshaped["link_bytes"] * 8 / bits_per_second / crossings
    hidden = overlap_steps * unshaped["compute_s_per_step"]
    return unshaped["training_s"][-1] + crossings * max(0.0, per_crossing - hidden)


def rho(parameters: int, bits_per_second: float, compute_s: float) -> float:
    """One fp32 gradient's time over the link (``32 * parameters / rate``) over a step's compute."""
    return 32 * parameters / bits_per_second / compute_s


def _first_within(evaluations: list[dict[str, Any]], target: float) -> int | None:
    return next((index for index, e in enumerate(evaluations) if e["loss"] <= target), None)


def _algorithm(runs: dict[str, dict[str, Any]], target: float, bits_per_second: float, overlap_steps: int) -> dict:
    unshaped, shaped = runs["unshaped"], runs["shaped"]
    cut = shaped["steps"] < unshaped["steps"]
    curve = unshaped if cut else shaped
    per_step = shaped["training_s"][-1] / shaped["steps"]
    reached = _first_within(curve["evaluations"], target)
    step = None if reached is None else curve["evaluations"][reached]["step"]
    if cut:
        wall, to_target = per_step * unshaped["steps"], None if step is None else per_step * step
    else:
        wall, to_target = shaped["training_s"][-1], None if reached is None else shaped["training_s"][reached]
    projected = projected_seconds(unshaped, bits_per_second, overlap_steps)
    return {
        "steps": unshaped["steps"], "eval_loss": curve["evaluations"][-1]["loss"], "wall_s": wall,
        "wall_from": "per step" if cut else "measured", "shaped_steps": shaped["steps"],
        "utilization": min(shaped["utilization_per_worker"]),
        "utilization_per_worker": shaped["utilization_per_worker"],
        "evaluation_waits_s": shaped["evaluation_waits_s"],
        "to_target_s": to_target, "steps_to_target": step, "projected_s": projected, "ratio": wall / projected,
        "unshaped_s": unshaped["training_s"][-1], "link_bytes_per_crossing":
            shaped["link_bytes"] / shaped["crossings"] if shaped["crossings"] else 0,
        "crossings": unshaped["crossings"],
    }


def summarize(job: dict[str, Any], results: dict[int, dict[str, Any]], config: dict[str, Any], title: str) -> dict:
    """What ``results.json`` holds for an islands run: ``config``, ``islands`` (rate,
    ``rho``, the compute per step it is taken at, and per algorithm its row, see the
    module's docstring), ``network_model`` (the target and its tolerance) and ``runs``
    (per algorithm, its unshaped and shaped runs as measured)."""
    ranks = sorted(results)
    runs = {algorithm: {name: _run([results[r]["algorithms"][algorithm][name] for r in ranks])
                        for name in ("unshaped", "shaped")}
            for algorithm in job["algorithms"]}
    first = job["algorithms"][0]
    final = runs[first]["unshaped"]["evaluations"][-1]["loss"]
    target = final * (1 + TARGET_TOLERANCE)
    name, bits_per_second = job["rate"]
    shaped = [run["shaped"] for run in runs.values()]
    compute = sum(r["compute_s_per_step"] * r["steps"] for r in shaped) / sum(r["steps"] for r in shaped)
    parameters = results[ranks[0]]["parameters"]
    overlap = {"streaming": job["options"]["delay"]}
    return {
        "config": config, "task": job["task"], "title": title, "world_size": len(ranks),
        "islands": {
            "count": len(job["namespaces"]), "per_island": len(job["namespaces"][0]), "rate": name,
            "rate_bits_per_second": bits_per_second, "parameters": parameters, "compute_s_per_step": compute,
            "rho": rho(parameters, bits_per_second, compute),
            "algorithms": {a: _algorithm(r, target, bits_per_second, overlap.get(a, 0)) for a, r in runs.items()},
        },
        "network_model": {"projected_not_measured": True, "target_eval_loss": target, "target_tolerance": TARGET_TOLERANCE,
                          "target_from": first, "final_eval_loss": final, "latency_s": 0.0},
        "runs": runs,
    }


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s" if value < 100 else f"{value:.0f} s"


def islands_table(summary: dict[str, Any]) -> str:
    """The islands' measured table beside the network model's projection."""
    islands, model = summary["islands"], summary["network_model"]
    rows = islands["algorithms"]
    baseline = rows.get(model["target_from"], {}).get("wall_s")
    gradient = 4 * islands["parameters"]
    lines = [
        f"ISLANDS: {islands['count']} islands of {islands['per_island']} workers, the links between them shaped to "
        f"{islands['rate']} each way; rho = {islands['rho']:.1f} (one fp32 gradient, {gradient / 1e6:.2f} MB, takes "
        f"{8 * gradient / islands['rate_bits_per_second']:.2f} s at {islands['rate']}; a step computes in "
        f"{1000 * islands['compute_s_per_step']:.0f} ms)",
        f"MEASURED (training time, evaluations left out) beside PROJECTED (network model: the unshaped run plus its "
        f"bytes over the link); target: held-out loss {model['target_eval_loss']:.3f}, within "
        f"{100 * model['target_tolerance']:.0f}% of {model['target_from']}'s final {model['final_eval_loss']:.3f}",
        f"{'algorithm':13s} {'steps':>5s} {'loss':>6s} {'wall':>8s} {'utilization':>11s} {'to target':>9s} "
        f"{'at step':>7s} {'/ ' + model['target_from'] + ' wall':>10s} {'projected':>9s} {'measured/proj':>13s}",
    ]
    for algorithm, row in rows.items():
        versus = "-" if not baseline or row["to_target_s"] is None else f"{row['to_target_s'] / baseline:.2f}x"
        lines.append(
            f"{algorithm:13s} {row['steps']:5d} {row['eval_loss']:6.3f} {_seconds(row['wall_s']):>7s}"
            f"{'*' if row['wall_from'] == 'per step' else ' '} {100 * row['utilization']:10.1f}% "
            f"{_seconds(row['to_target_s']):>9s} {row['steps_to_target'] or '-':>7} {versus:>10s} "
            f"{_seconds(row['projected_s']):>9s} {row['ratio']:12.2f}x")
    cut = [(a, r["shaped_steps"]) for a, r in rows.items() if r["wall_from"] == "per step"]
    if cut:
        lines.append("(* " + ", ".join(f"{a}'s wall time is its time per step over the link (a run of {n} steps) "
                                       f"times its steps; its loss curve and step to the target the unshaped run's"
                                       for a, n in cut) + ")")
    lines.append("(utilization: the lowest worker's share of its training time not spent waiting on the slow link; to "
                 f"target / {model['target_from']} wall: the time to the target over {model['target_from']}'s wall time; "
                 "- not reached)")
    return "\n".join(lines)
