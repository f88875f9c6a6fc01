"""Differential tests of ``puredist.outer_optimizer`` with its default options against
two independent oracles: DiLoCo's Algorithm 1 (Douillard et al. 2023) written out here
with ``torch.optim``, and torchft 0.2's ``torchft.local_sgd.DiLoCo`` run for real
(a lighthouse, one ``Manager`` per replica over Gloo, replicas as processes:
``tests/torchft_diloco.py``).

Every side trains the same 2 replicas from the same initial weights, each on its own
seeded batches, with the same ``torch.optim`` inner optimizer (SGD or AdamW), H = 4,
12 inner steps, outer Nesterov SGD (lr 0.7, momentum 0.9), fp32, with one fragment and
with two (the two Linear layers). The sides are compared after every inner step, every
replica and every leaf, within 1e-6. The oracles are first checked against each other,
and checked to synchronize when the paper and torchft say they do.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import puredist
from puredist.outer import split_fragments

os.environ.setdefault("RUST_LOG", "error")  # torchft's lighthouse, in this process, logs every quorum otherwise
sys.path.insert(0, str(Path(__file__).parent))
import torchft_diloco as peers  # noqa: E402
from torchft_diloco import CASES, OUTER, REPLICAS, STEPS, SYNC_EVERY  # noqa: E402
from workers import run_workers  # noqa: E402

TOLERANCE = 1e-6  # fp32: the sides average in different orders (a sum then / 2, a mean of the difference)
JOB_TIMEOUT_S = 120  # the torchft job: 2 processes, 4 cases, each with its own lighthouse and managers
COLLECTIVE_TIMEOUT_S = 20  # torchft's Gloo collectives and votes
REAL_RANKS_CASES = ["sgd-1", "adamw-2"]  # one fragment with SGD inside, two with AdamW inside

Trajectory = list  # one entry per inner step: one list of leaves per replica


def fragment_leaves(fragments: int) -> list[list[int]]:
    """The leaf indices (in ``parameters()`` order) of torchft's module fragments."""
    model = peers.make_model()
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return [[index[id(p)] for p in part.parameters()] for part in peers.module_fragments(model, fragments)]


def sync_steps(fragment: int, fragments: int) -> list[int]:
    """The inner steps (counted from 1) after which ``fragment`` synchronizes: in
    DiLoCo every H steps from the H-th; in Streaming DiLoCo as torchft orders it,
    ``(fragment + 1) * H / fragments + n * H``."""
    first = (fragment + 1) * SYNC_EVERY // fragments
    return list(range(first, STEPS + 1, SYNC_EVERY))


def algorithm_1(kind: str, fragments: int) -> Trajectory:
    """DiLoCo's Algorithm 1, written out: each replica takes its inner steps; after
    fragment f's synchronization steps (:func:`sync_steps`) the pseudo-gradient
    ``global - mean_r(local_r)`` of its leaves is the ``.grad`` of the global copy (the
    initial weights at first), which takes one outer step (``torch.optim.SGD``, Nesterov,
    a step from the first synchronization on), and every replica's leaves become the new
    global copy."""
    models = [peers.make_model() for _ in range(REPLICAS)]
    inners = [peers.make_inner(kind, model.parameters()) for model in models]
    global_copy = [p.detach().clone().requires_grad_() for p in models[0].parameters()]
    outer = torch.optim.SGD(global_copy, **OUTER)  # steps only the leaves given a .grad
    trajectory = []
    for t in range(1, STEPS + 1):
        for r, (model, inner) in enumerate(zip(models, inners)):
            peers.inner_step(model, inner, r, t - 1)
        for f, leaves in enumerate(fragment_leaves(fragments)):
            if t not in sync_steps(f, fragments):
                continue
            local = [list(model.parameters()) for model in models]
            with torch.no_grad():
                for i in leaves:
                    global_copy[i].grad = global_copy[i] - torch.stack([mine[i] for mine in local]).mean(0)
                outer.step()
                outer.zero_grad()
                for mine in local:
                    for i in leaves:
                        mine[i].copy_(global_copy[i])
        trajectory.append([peers.snapshot(model) for model in models])
    return trajectory


def make_transform(fragments: int):
    """puredist's outer optimizer, default options but the fragments (warmup_steps=0, delay=0)."""
    return puredist.outer_optimizer(puredist.sgd(OUTER["lr"], momentum=OUTER["momentum"], nesterov=True),
                                    sync_every=SYNC_EVERY, fragments=fragments)


def puredist_simulated(kind: str, fragments: int) -> Trajectory:
    """puredist on :class:`puredist.SimulatedCollective`: the replicas' leaves stacked on a
    leading axis; each replica's inner step on its own model, whose leaves are copied
    in before ``update_`` and back after it."""
    transform = make_transform(fragments)
    models = [peers.make_model() for _ in range(REPLICAS)]
    inners = [peers.make_inner(kind, model.parameters()) for model in models]
    stacked = [torch.stack(leaves).detach().clone() for leaves in zip(*(model.parameters() for model in models))]
    state = transform.init(stacked)
    collective = puredist.SimulatedCollective(REPLICAS)
    trajectory = []
    for step in range(STEPS):
        for r, (model, inner) in enumerate(zip(models, inners)):
            peers.inner_step(model, inner, r, step)
        with torch.no_grad():
            for r, model in enumerate(models):
                for leaf, p in zip(stacked, model.parameters()):
                    leaf[r].copy_(p)
        state = transform.update_(stacked, state, collective=collective)
        with torch.no_grad():
            for r, model in enumerate(models):
                for leaf, p in zip(stacked, model.parameters()):
                    p.copy_(leaf[r])
        trajectory.append([peers.snapshot(model) for model in models])
    return trajectory


def _puredist_rank(rank: int, world_size: int, kind: str, fragments: int) -> list[list[torch.Tensor]]:
    """One Gloo rank: its model's parameters are the leaves ``update_`` writes."""
    transform = make_transform(fragments)
    model = peers.make_model()
    inner = peers.make_inner(kind, model.parameters())
    params = list(model.parameters())
    state = transform.init(params)
    collective = puredist.DistributedCollective()
    mine = []
    for step in range(STEPS):
        peers.inner_step(model, inner, rank, step)
        state = transform.update_(params, state, collective=collective)
        mine.append(peers.snapshot(model))
    return mine


@functools.cache  # (one run serves both oracles' tests)
def puredist_real_ranks(kind: str, fragments: int) -> Trajectory:
    """puredist on 2 Gloo ranks (forked processes) with :class:`puredist.DistributedCollective`."""
    per_rank = run_workers(_puredist_rank, REPLICAS, kind, fragments)
    return [[per_rank[r][step] for r in range(REPLICAS)] for step in range(STEPS)]


def equal_after(trajectory: Trajectory) -> dict[int, list[int]]:
    """For each leaf, the inner steps after which every replica holds the same value."""
    leaves = range(len(trajectory[0][0]))
    return {i: [t + 1 for t, replicas in enumerate(trajectory)
                if all(torch.equal(replicas[0][i], other[i]) for other in replicas[1:])] for i in leaves}


def assert_same_trajectory(ours: Trajectory, oracle: Trajectory, what: str) -> None:
    """Equal within :data:`TOLERANCE` after every inner step, for every replica and leaf;
    else say after which steps, by how much, and when each side synchronized."""
    assert len(ours) == len(oracle) == STEPS
    differences = []
    for mine, theirs in zip(ours, oracle):
        assert len(mine) == len(theirs) == REPLICAS
        assert all(len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b)) for a, b in zip(mine, theirs))
        differences.append(max((x - y).abs().max().item() for a, b in zip(mine, theirs) for x, y in zip(a, b)))
    wrong = [t + 1 for t, d in enumerate(differences) if not d <= TOLERANCE]  # (a NaN is wrong too)
    assert not wrong, (
        f"{what}: differs after inner steps {wrong} (counted from 1) by up to {max(differences):.3g}; "
        f"max |difference| per step {[float(f'{d:.2g}') for d in differences]}; replicas equal, per leaf, "
        f"after steps {equal_after(ours)} here, {equal_after(oracle)} in the oracle"
    )


@pytest.fixture(scope="module")
def torchft_runs(tmp_path_factory) -> dict[str, Trajectory]:
    """torchft's DiLoCo for every case: two replica processes, each running the cases in
    turn, a lighthouse per case (a quorum needs both replicas); the job's deadline
    kills both processes."""
    pytest.importorskip("torchft")
    from torchft.coordination import LighthouseServer

    folder = tmp_path_factory.mktemp("torchft_diloco")
    lighthouses = {case: LighthouseServer(bind="[::]:0", min_replicas=REPLICAS, join_timeout_ms=1000,
                                          quorum_tick_ms=20, heartbeat_timeout_ms=1000) for case in CASES}
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="error")
    processes, deadline = [], time.monotonic() + JOB_TIMEOUT_S
    try:
        for r in range(REPLICAS):
            spec = {"replica": r, "port": store.port, "timeout": COLLECTIVE_TIMEOUT_S, "out": str(folder / f"{r}.pt"),
                    "cases": {case: server.address() for case, server in lighthouses.items()}}
            with open(folder / f"{r}.err", "wb") as errors:  # (a file: a pipe nobody reads could fill and block)
                processes.append(subprocess.Popen([sys.executable, peers.__file__, json.dumps(spec)], env=env,
                                                  stdout=subprocess.DEVNULL, stderr=errors))
        codes = []
        for r, process in enumerate(processes):
            try:
                codes.append(process.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"torchft replica {r} did not finish in {JOB_TIMEOUT_S} s") from None
        failed = "".join(f"--- torchft replica {r} exited with {code}:\n"
                         f"{(folder / f'{r}.err').read_text(errors='replace')[-3000:]}\n"
                         for r, code in enumerate(codes) if code != 0)
        assert not failed, failed
    finally:
        for process in processes:
            process.kill()
        for server in lighthouses.values():
            server.shutdown()
    results = [torch.load(folder / f"{r}.pt") for r in range(REPLICAS)]
    return {case: [[results[r][case][step] for r in range(REPLICAS)] for step in range(STEPS)] for case in CASES}


def test_the_fragments_puredist_cuts_are_torchfts_modules():
    """puredist's cut (contiguous leaves of about equal size) of this model into 2
    fragments is torchft's module fragments (the two Linear layers), so that fragment f
    means the same leaves on every side."""
    sizes = [p.numel() for p in peers.make_model().parameters()]
    for fragments in (1, 2):
        assert [list(part) for part in split_fragments(sizes, fragments)] == fragment_leaves(fragments)
    assert fragment_leaves(2) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("case", CASES)
def test_algorithm_1_written_out_equals_torchft_diloco(case, torchft_runs):
    """The two oracles agree, independently of puredist: Algorithm 1 (and its streaming
    form) written out here equals torchft's DiLoCo after every inner step. Both
    synchronize each fragment exactly after its steps (f + 1) * H / F + n * H: its
    leaves are equal across replicas then, and only then (the replicas' data differ)."""
    kind, fragments = CASES[case]
    written_out, torchft = algorithm_1(kind, fragments), torchft_runs[case]
    assert_same_trajectory(written_out, torchft, f"Algorithm 1 against torchft's DiLoCo ({case})")
    expected = {i: sync_steps(f, fragments) for f, leaves in enumerate(fragment_leaves(fragments)) for i in leaves}
    assert equal_after(written_out) == equal_after(torchft) == expected


@pytest.mark.parametrize("case", CASES)
def test_default_outer_optimizer_equals_algorithm_1_on_simulated_replicas(case):
    """puredist's ``outer_optimizer`` with default options (warmup_steps=0, delay=0) on
    :class:`~puredist.SimulatedCollective` is DiLoCo's Algorithm 1 (with F fragments, its
    streaming form in torchft's order): the first outer step after inner step H (or
    fragment f's first step), a Nesterov step from the initial weights; equal after
    every inner step."""
    kind, fragments = CASES[case]
    assert_same_trajectory(puredist_simulated(kind, fragments), algorithm_1(kind, fragments),
                           f"puredist (simulated) against Algorithm 1 ({case})")


@pytest.mark.parametrize("case", CASES)
def test_default_outer_optimizer_equals_torchft_diloco_on_simulated_replicas(case, torchft_runs):
    """puredist's default ``outer_optimizer`` on simulated replicas equals torchft's
    ``DiLoCo`` run on real managers, after every inner step."""
    kind, fragments = CASES[case]
    assert_same_trajectory(puredist_simulated(kind, fragments), torchft_runs[case],
                           f"puredist (simulated) against torchft's DiLoCo ({case})")


@pytest.mark.parametrize("case", REAL_RANKS_CASES)
def test_default_outer_optimizer_on_real_gloo_ranks_equals_algorithm_1(case):
    """puredist's default ``outer_optimizer`` on 2 Gloo ranks
    (:class:`~puredist.DistributedCollective`, each rank's model parameters updated in
    place) equals Algorithm 1 after every inner step."""
    kind, fragments = CASES[case]
    assert_same_trajectory(puredist_real_ranks(kind, fragments), algorithm_1(kind, fragments),
                           f"puredist (Gloo ranks) against Algorithm 1 ({case})")


@pytest.mark.parametrize("case", REAL_RANKS_CASES)
def test_default_outer_optimizer_on_real_gloo_ranks_equals_torchft_diloco(case, torchft_runs):
    """puredist's default ``outer_optimizer`` on 2 Gloo ranks equals torchft's
    ``DiLoCo`` after every inner step."""
    kind, fragments = CASES[case]
    assert_same_trajectory(puredist_real_ranks(kind, fragments), torchft_runs[case],
                           f"puredist (Gloo ranks) against torchft's DiLoCo ({case})")
