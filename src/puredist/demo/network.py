"""A network model: how long each algorithm would take to reach a target loss on a
link, projected from a run of the same job on a fast one.

Measured on the fast link (loopback, or the ``--link`` job's unshaped namespaces): the
bytes each worker sent at each step, the held-out loss of the averaged model at each
evaluation, and the training time up to each evaluation (the slowest worker's, the
evaluations left out). That time holds the compute and everything the host does per
synchronization (the rank check, Gloo's messages and the turns between a ring's phases);
only the transfer of the bytes is missing from it. Projected, for a link of bandwidth ``B`` bytes/s and
per-message latency ``L``, up to an evaluated step ``k``:

    time(k) = training_s(k) + sum over the steps j <= k that sent bytes of
              (max(0, wire(bytes_j) / B - hidden_j) + 2 (g_j - 1) L)

- ``bytes_j``: the slowest worker's bytes at step ``j``. Every worker's egress is a link
  of its own (a ring all-reduce's phases each move ``bytes / W`` over every worker's
  link at once), so a step's transfer lasts its busiest sender's bytes over ``B``.
- ``wire``: the payload in Ethernet frames, the acknowledgements of what a worker
  receives (as much as it sends, in a ring) included, as they leave its egress: measured
  per run over real links (``demo --link``'s unshaped run: the queueing discipline's
  bytes per byte Gloo wrote, message headers and short messages' frames included), else
  TCP's framing of full segments (:data:`WIRE_BYTES_PER_BYTE`).
- ``hidden_j``: the compute the bytes travel behind. Streaming DiLoCo applies a
  fragment ``overlap_steps`` steps after it starts, so its bytes hide behind that many
  steps of compute (the mean step that sent nothing, :func:`compute_seconds`; none where
  no step sent nothing). Every other algorithm waits for its bytes: DDP's all-reduce of
  its last bucket cannot start before the backward ends, and these models fit one or
  two buckets, so what it hides behind the backward is at most part of one, not
  counted. The host's own work for a synchronization is not counted as hiding any
  bytes either: it is in ``training_s``, and the link's time comes on top of it.
- ``g_j``: the workers step ``j``'s collective ran over (``W`` but at a hierarchy's lower
  levels); ``2 (g_j - 1)`` message latencies: a ring all-reduce's, once per step that
  sent bytes, however many collectives it ran — a compressed synchronization runs five,
  a rank check included, and ZeRO a broadcast per owner, so their latency is
  undercounted, while torchft's background messages between synchronizations, a few
  bytes that block nothing, are charged as a step that sent, so theirs is overcounted.

Two questions are answered with it, per link: the time to reach a target loss (``k`` =
the first evaluated step whose held-out loss is at most the target), and the lowest
held-out loss each algorithm reaches within one time budget (the shortest projected
time of a whole run, so that every algorithm's measurements cover it: no extrapolation
past the steps that ran; each run is read at its lowest evaluation within the budget, so
runs that end within a fraction of the budget of each other can rank by when they
evaluated).

This module must not measure: it projects from what the workers measured.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple, Sequence

FRAME_BYTES = 1514
"""A full Ethernet frame at a 1500-byte MTU, header included (what ``tbf`` counts)."""
SEGMENT_BYTES = 1448
"""TCP's payload in it: 1500 less the IP header (20), TCP's (20) and its timestamps (12)."""
ACK_BYTES = 66
"""An acknowledgement's frame: Ethernet (14), IP (20) and TCP with timestamps (32) headers."""
WIRE_BYTES_PER_BYTE = (FRAME_BYTES + ACK_BYTES) / SEGMENT_BYTES
"""A worker's egress per byte of payload it sends: the frame that carries it, and one
acknowledgement per segment it receives (a ring receives what it sends)."""


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

    The compute a step's bytes can travel behind (:func:`transfer_seconds`). The mean,
    not the median: ``k`` steps last ``k`` times the mean, and where workers share
    cores the scheduler makes a few steps several times slower than most (digits, 4
    workers on 2 shared cores: a median of 1.2 ms, a mean of 2.7 to 3.7 ms)."""
    quiet = [seconds for run_s, run_b in zip(step_seconds, step_bytes)
             for seconds, sent in zip(run_s, run_b) if sent == 0 and seconds is not None]
    return statistics.fmean(quiet) if quiet else None


def steps_to_reach(evaluations: Sequence[tuple[int, float]], target: float) -> int | None:
    """The first evaluated step whose loss is at most ``target``: ``evaluations`` is
    ``(step, loss)`` in step order; None if none reaches it."""
    return next((step for step, loss in evaluations if loss <= target), None)


class Measured(NamedTuple):
    """What the model reads of one algorithm's run on a fast link.

    Attributes:
        evaluated_steps: the steps after which the run evaluated, in order (its last step among them).
        training_s: the slowest worker's training time up to each of them, the evaluations left out.
        step_bytes: the slowest worker's bytes at each step (``step_bytes[j]``: step ``j + 1``).
        group_sizes: the workers each step's collective spans (None: all; None for a step: all).
        overlap_steps: the steps of compute a synchronization's bytes travel behind (0: none).
        wire_bytes_per_byte: the frames a worker's egress sends per byte of payload: measured where the run
            was on an Ethernet link (``demo --link``'s unshaped run), else TCP's framing.
    """

    evaluated_steps: Sequence[int]
    training_s: Sequence[float]
    step_bytes: Sequence[int]
    group_sizes: Sequence[int | None] | None = None
    overlap_steps: int = 0
    wire_bytes_per_byte: float = WIRE_BYTES_PER_BYTE


def transfer_seconds(run: Measured, steps: int, link: Link, world_size: int, compute_s: float | None) -> float:
    """What the link adds to the first ``steps`` steps of ``run``: each sending step's
    wire bytes over the bandwidth, less the compute they travel behind
    (``overlap_steps`` steps of ``compute_s``; none where ``compute_s`` is None), and
    its ``2 (g - 1)`` latencies."""
    hidden = run.overlap_steps * (compute_s or 0.0)
    sizes = run.group_sizes or [None] * len(run.step_bytes)
    sent = [(b, size or world_size) for b, size in zip(run.step_bytes[:steps], sizes) if b > 0]
    return sum(max(0.0, b * run.wire_bytes_per_byte / link.bytes_per_second - hidden) + 2 * (size - 1) * link.latency_s
               for b, size in sent)


def projected_seconds(run: Measured, step: int, link: Link, world_size: int, compute_s: float | None) -> float:
    """The model's time for ``run`` up to its evaluated step ``step`` on ``link`` with
    ``world_size`` workers: the training time measured there plus
    :func:`transfer_seconds`."""
    return run.training_s[run.evaluated_steps.index(step)] + transfer_seconds(run, step, link, world_size, compute_s)


def best_loss_within(run: Measured, losses: Sequence[float], link: Link, world_size: int, compute_s: float | None,
                     budget_s: float) -> float | None:
    """The lowest of ``losses`` (one per evaluated step of ``run``) whose step's
    projected time is at most ``budget_s``; None if the first evaluation comes later."""
    within = [loss for step, loss in zip(run.evaluated_steps, losses)
              if projected_seconds(run, step, link, world_size, compute_s) <= budget_s]
    return min(within, default=None)
