"""A network model: how long each algorithm would take to reach a target loss on a
real link, projected from what the demo measured.

Measured (on this machine's loopback, which is not a network worth modelling): the
bytes each worker sent at each step, the held-out loss of the averaged model at each
evaluation, and the compute time of a step — the mean duration of the steps that
sent nothing (the local steps of the local methods; every algorithm runs the same
model, batch and inner optimizer, so they share it; the mean, because a run lasts the
sum of its steps, slow ones included). Projected, for a link of
bandwidth ``B`` bytes/s and per-message latency ``L``:

    time(k) = k * compute + sum over the steps j <= k that sent bytes of
              (bytes_j / B + 2 (g_j - 1) L)

(``g_j``: the workers step ``j``'s collective ran over, ``W`` but at a hierarchy's
lower levels; ``2 (g_j - 1)`` message latencies: a ring all-reduce's, once per step
that sent bytes, however many collectives it ran — a compressed synchronization runs
five, a rank check included, and ZeRO a broadcast per owner, so their latency is
undercounted, while torchft's background messages between synchronizations, a few
bytes that block nothing, are charged as a step that sent, so theirs is overcounted;
the slowest worker's bytes at each step). Two questions are answered with it, per link: the time to reach a target
loss (``k`` = the first evaluated step whose held-out loss is at most the target), and
the lowest held-out loss each algorithm reaches within one time budget (the shortest
projected time of a whole run, so that every algorithm's measurements cover it: no
extrapolation past the steps that ran; each run is read at its last evaluation within
the budget, so runs that end within a fraction of the budget of each other can rank by
when they evaluated). Communication is not overlapped with compute in the model (DDP does overlap
it with the backward, streaming DiLoCo with local steps), so the projection is an
upper bound for those.

This module must not measure: it projects from what the workers measured.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple, Sequence


class Link(NamedTuple):
    name: str
    bytes_per_second: float
    latency_s: float


LINKS = (
    Link("100 Gbit/s", 100e9 / 8, 10e-6),
    Link("10 Gbit/s", 10e9 / 8, 50e-6),
    Link("1 Gbit/s", 1e9 / 8, 200e-6),
    Link("100 Mbit/s", 100e6 / 8, 20e-3),
)
"""From a datacenter fabric to a wide-area link between sites."""


def compute_seconds(step_seconds: Sequence[Sequence[float]], step_bytes: Sequence[Sequence[int]]) -> float | None:
    """The mean duration of the steps that sent no byte, over all runs given
    (``step_seconds[r][k]`` and ``step_bytes[r][k]`` of run ``r``'s step ``k``; a
    duration of None: not measured, left out, e.g. the steps a killed worker never
    reported); None when every step measured sent something.

    The mean, not the median: ``k`` steps last ``k`` times the mean. Where workers share
    cores, the scheduler makes a few steps several times slower than most (digits, 4
    workers on 2 shared cores: a median of 1.2 ms, a mean of 2.7 to 3.7 ms), and the
    median, blind to them, made a projection over a shaped 20 Mbit/s link 1.4x (DDP) to
    3.4x (DiLoCo) shorter than the time measured there (``demo --link``, docs/links.md)."""
    quiet = [seconds for run_s, run_b in zip(step_seconds, step_bytes)
             for seconds, sent in zip(run_s, run_b) if sent == 0 and seconds is not None]
    return statistics.fmean(quiet) if quiet else None


def steps_to_reach(evaluations: Sequence[tuple[int, float]], target: float) -> int | None:
    """The first evaluated step whose loss is at most ``target``: ``evaluations`` is
    ``(step, loss)`` in step order; None if none reaches it."""
    return next((step for step, loss in evaluations if loss <= target), None)


def projected_seconds(step_bytes: Sequence[int], steps: int, compute_s: float, link: Link, world_size: int,
                      group_sizes: Sequence[int | None] | None = None) -> float:
    """The model's time for the first ``steps`` steps (``step_bytes[j]``: the slowest
    worker's bytes at step ``j + 1``) on ``link`` with ``world_size`` workers; a step's
    collective runs over ``group_sizes[j]`` of them where given (a hierarchy's pair
    steps), else over all."""
    sizes = group_sizes or [world_size] * len(step_bytes)
    sent = [(b, size or world_size) for b, size in zip(step_bytes[:steps], sizes) if b > 0]
    return (steps * compute_s + sum(b for b, _ in sent) / link.bytes_per_second
            + sum(2 * (size - 1) for _, size in sent) * link.latency_s)


def best_loss_within(
    evaluations: Sequence[tuple[int, float]], step_bytes: Sequence[int], compute_s: float, link: Link, world_size: int,
    budget_s: float, group_sizes: Sequence[int | None] | None = None,
) -> float | None:
    """The lowest loss of the evaluated steps ``(step, loss)`` whose projected time is
    at most ``budget_s`` (``group_sizes`` as :func:`projected_seconds`'s); None if the
    first evaluation comes later."""
    within = [loss for step, loss in evaluations
              if projected_seconds(step_bytes, step, compute_s, link, world_size, group_sizes) <= budget_s]
    return min(within, default=None)
