"""DiLoCo with compressed pseudo-gradients: a lossless codec equals the uncompressed
transform bit for bit, real Gloo ranks equal the simulation, checkpoints resume bit for
bit, and bad combinations are refused."""

import io

import pytest
import torch
import torch.distributed as dist

import puredist
from puredist import SimulatedCollective
from workers import run_workers

OUTER = dict(sync_every=3, warmup_steps=1, fragments=2)


def diloco(**options):
    return puredist.outer_optimizer(puredist.sgd(lr=0.7, momentum=0.9, nesterov=True), **{**OUTER, **options})


def drift(rank, step, replicas=None):
    """Each rank's local progress at ``step`` (stacked over ranks when ``replicas``)."""
    def one(r):
        gen = torch.Generator().manual_seed(1000 * r + step)
        return [0.1 * torch.randn(6, 5, generator=gen), 0.1 * torch.randn(5, generator=gen)]

    if replicas is None:
        return one(rank)
    return [torch.stack(parts) for parts in zip(*(one(r) for r in range(replicas)))]


def initial(replicas=None):
    params = [torch.ones(6, 5), torch.zeros(5)]
    return params if replicas is None else [p.expand(replicas, *p.shape).clone() for p in params]


def run(transform, params, collective, steps, replicas=None, rank=0, state=None, first=0):
    state = transform.init(params) if state is None else state
    for step in range(first, steps):
        for p, d in zip(params, drift(rank, step, replicas)):
            p.add_(d)
        state = transform.update_(params, state, collective=collective)
    return params, state


@pytest.mark.parametrize("delay", [0, 1])
def test_a_lossless_codec_equals_the_uncompressed_transform(delay):
    replicas, steps = 2, 12
    plain, _ = run(diloco(delay=delay), initial(replicas), SimulatedCollective(replicas), steps, replicas)
    ours, state = run(diloco(delay=delay, compressor=puredist.top_k(1.0)), initial(replicas),
                      SimulatedCollective(replicas), steps, replicas)
    assert all(torch.equal(a, b) for a, b in zip(ours, plain))
    assert all(torch.equal(r, torch.zeros_like(r)) for r in state.residuals)  # nothing left unsent


def test_a_lossy_codec_keeps_its_error_for_later_and_still_trains_together():
    replicas = 4
    ours, state = run(diloco(compressor=puredist.int4_blocks(8)), initial(replicas), SimulatedCollective(replicas), 10,
                      replicas)
    assert any(r.abs().max() > 0 for r in state.residuals)
    plain, _ = run(diloco(), initial(replicas), SimulatedCollective(replicas), 10, replicas)
    for a, b in zip(ours, plain):  # 4-bit pseudo-gradients with error feedback stay near the exact run
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)


def _on_real_ranks(rank, world_size):
    params, state = run(diloco(compressor=puredist.int8_blocks(16)), initial(), puredist.DistributedCollective(), 10,
                        rank=rank)
    return params, state.residuals


def test_real_ranks_equal_the_simulation_bit_for_bit():
    replicas = 2
    real = run_workers(_on_real_ranks, replicas)
    simulated, state = run(diloco(compressor=puredist.int8_blocks(16)), initial(replicas),
                           SimulatedCollective(replicas), 10, replicas)
    for rank, (params, residuals) in enumerate(real):
        assert all(torch.equal(p, s[rank]) for p, s in zip(params, simulated))
        assert all(torch.equal(r, s[rank]) for r, s in zip(residuals, state.residuals))


def _one_flat_fragment_on_real_ranks(rank, world_size, delay):
    from puredist.outer.storage.flat_layout import flat_base

    transform = diloco(fragments=1, delay=delay, compressor=puredist.int8_blocks(16))
    collective = puredist.DistributedCollective()
    params, state = run(transform, initial(), collective, 6, rank=rank)
    laid_flat = flat_base(state.residuals) is not None  # the one-tensor path ran (and kept its buffer)
    buffer = io.BytesIO()
    torch.save(transform.state_dict(state, rank=rank), buffer)
    restored = transform.load_state_dict(transform.init(params), torch.load(io.BytesIO(buffer.getvalue())), rank=rank)
    resumed, state = run(transform, [p.clone() for p in params], collective, 12, rank=rank, state=restored, first=6)
    uninterrupted, _ = run(transform, initial(), collective, 12, rank=rank)
    return laid_flat, flat_base(restored.residuals) is not None, resumed, uninterrupted, state.residuals


@pytest.mark.parametrize("delay", [0, 1])
def test_a_fragment_averaged_as_one_tensor_equals_the_simulation_bit_for_bit_and_resumes(delay):
    # on real ranks a fragment of small leaves is laid out flat: its pseudo-gradients and residuals are each
    # one tensor (host work independent of the leaves); the simulation runs leaf by leaf, an independent oracle
    replicas = 2
    real = run_workers(_one_flat_fragment_on_real_ranks, replicas, delay)
    transform = diloco(fragments=1, delay=delay, compressor=puredist.int8_blocks(16))
    simulated, state = run(transform, initial(replicas), SimulatedCollective(replicas), 12, replicas)
    for rank, (laid_flat, relaid_flat, resumed, uninterrupted, residuals) in enumerate(real):
        assert laid_flat and relaid_flat
        assert all(torch.equal(p, s[rank]) for p, s in zip(uninterrupted, simulated))
        assert all(torch.equal(p, s) for p, s in zip(resumed, uninterrupted))
        assert all(torch.equal(r, s[rank]) for r, s in zip(residuals, state.residuals))
        assert any(r.abs().max() > 0 for r in residuals)


def _large_leaves(rank, world_size, replicas=None):
    """4 DiLoCo steps of two leaves averaging 80 KiB (above the flat layout's limit), int8."""
    from puredist.outer.storage.flat_layout import flat_base

    transform = puredist.outer_optimizer(puredist.sgd(lr=0.7, momentum=0.9), sync_every=2,
                                         compressor=puredist.int8_blocks(16))
    lead = () if replicas is None else (replicas,)
    params = [torch.ones(*lead, 400, 100), torch.zeros(*lead, 300)]
    state = transform.init(params)
    collective = puredist.DistributedCollective() if replicas is None else SimulatedCollective(replicas)
    for step in range(4):
        for i, p in enumerate(params):
            drifts = [torch.randn(p.shape[len(lead):], generator=torch.Generator().manual_seed(100 * r + 10 * step + i))
                      for r in ([rank] if replicas is None else range(replicas))]
            p.add_(drifts[0] if replicas is None else torch.stack(drifts))
        state = transform.update_(params, state, collective=collective)
    return params, state.residuals, flat_base(state.global_params) is None


def test_leaves_too_large_to_lay_flat_equal_the_simulation_bit_for_bit():
    simulated, residuals, _ = _large_leaves(0, 2, replicas=2)
    for rank, (params, real_residuals, per_leaf) in enumerate(run_workers(_large_leaves, 2)):
        assert per_leaf
        assert all(torch.equal(p, s[rank]) for p, s in zip(params, simulated))
        assert all(torch.equal(r, s[rank]) for r, s in zip(real_residuals, residuals))


def _peer_dies_in_a_flat_sync(rank, world_size):
    import os
    import signal

    import puredist.compression

    transform = diloco(fragments=1, compressor=puredist.int8_blocks(16))
    params, state = run(transform, initial(), puredist.DistributedCollective(), 3, rank=rank)  # residuals not zero
    if rank == 1:  # passes the rank check and phase 1 of the next sync, then dies instead of sending phase 2
        puredist.compression.phases._gathered_payloads = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
    for p, d in zip(params, drift(rank, 3)):  # inner step 4: a synchronization
        p.add_(d)
    before = [t.clone() for t in (*params, *state.global_params, *state.residuals)]
    with pytest.raises(puredist.CollectiveError, match=r"its all-gather \(phase 2\).*No tensor holds a partial"):
        transform.update_(params, state, collective=puredist.DistributedCollective())
    unchanged = all(torch.equal(a, b) for a, b in zip((*params, *state.global_params, *state.residuals), before))
    survivors = puredist.DistributedCollective(dist.new_group([0, 2], use_local_synchronization=True))
    state = transform.update_(params, state, collective=survivors)  # the same state, retried: completes
    return unchanged, [torch.equal(r, b) for r, b in zip(state.residuals, before[-2:])]


def test_a_peer_dying_in_a_flat_sync_leaves_the_state_passed_in_unchanged_and_a_retry_completes():
    results = run_workers(_peer_dies_in_a_flat_sync, 3, victims=(1,), timeout=60, gloo_timeout=10)
    for unchanged, residuals_equal in (results[0], results[2]):
        assert unchanged
        assert not all(residuals_equal)  # the retry moved the error feedback on


def test_a_checkpoint_mid_run_resumes_bit_for_bit_and_stays_on_its_world_size():
    replicas, transform, collective = 2, diloco(delay=1, compressor=puredist.int8_blocks(16)), SimulatedCollective(2)
    uninterrupted, _ = run(transform, initial(replicas), collective, 12, replicas)
    params, state = run(transform, initial(replicas), collective, 7, replicas)
    buffer = io.BytesIO()
    torch.save(transform.state_dict(state, rank=0), buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()))
    restored = transform.load_state_dict(transform.init(params), saved, rank=0)
    resumed, _ = run(transform, params, collective, 12, replicas, state=restored, first=7)
    assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted))
    with pytest.raises(ValueError, match="no error-feedback residuals of rank 1"):
        transform.load_state_dict(transform.init(params), saved, rank=1)
    merged = {**saved, **transform.state_dict(state, rank=1)}  # one file of both ranks' entries loads on each
    for rank in (0, 1):
        alone = transform.load_state_dict(transform.init(params), transform.state_dict(state, rank=rank), rank=rank)
        both = transform.load_state_dict(transform.init(params), merged, rank=rank)
        want, got = transform.state_dict(alone, rank=rank), transform.state_dict(both, rank=rank)
        assert want.keys() == got.keys()
        assert all(torch.equal(v, got[k]) if isinstance(v, torch.Tensor) else v == got[k] for k, v in want.items())


def test_a_compressor_and_a_comm_dtype_are_exclusive():
    with pytest.raises(ValueError, match=r"``compressor`` \(int8_blocks\(128\)\) and ``comm_dtype``"):
        diloco(compressor=puredist.int8_blocks(), comm_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="``compressor`` must be a puredist Compressor"):
        diloco(compressor="int8")


@pytest.mark.parametrize("codec", ["int4", "topk", "chunked"])
def test_each_sync_sends_the_pseudo_gradient_plus_the_residual_left_by_the_last(codec):
    # oracle: with outer sgd(lr=1) every synchronization is g <- g - mean(g - l), the mean taken by the
    # compressed averager (its error feedback tested on its own); DiLoCo must feed each sync's residuals into
    # the next (a lossy codec's error otherwise is lost for good)
    from puredist.compression import compressed_averager

    compressor = {"int4": puredist.int4_blocks(16), "topk": puredist.top_k(0.1), "chunked": puredist.chunked_top_k(2, 8)}[codec]
    replicas, gen = 3, torch.Generator().manual_seed(0)
    params = [torch.randn(1, 40, generator=gen).expand(replicas, 40).clone()]
    diloco = puredist.outer_optimizer(puredist.sgd(lr=1.0), sync_every=1, compressor=compressor)
    state = diloco.init(params)
    averager = compressed_averager(compressor)
    glob, feedback = params[0].clone(), averager.init(params[0])
    collective = SimulatedCollective(replicas)
    for _ in range(5):
        params[0].add_(torch.randn(replicas, 40, generator=gen))  # each replica's local steps
        local = params[0].clone()
        state = diloco.update_(params, state, collective=collective)
        mean, feedback = averager.update(glob - local, feedback, collective=collective)
        glob = glob - mean
        torch.testing.assert_close(params[0], glob, rtol=0, atol=1e-6)
    assert any(r.abs().sum() > 0 for r in state.residuals)  # a lossy codec leaves something for later


def _outer_step_refused(rank, world_size, numel):
    # the outer learning rate turns negative at the second outer step (after inner step 2): refused before anything
    # is sent
    transform = puredist.outer_optimizer(puredist.sgd(lr=lambda count: 0.7 if count < 1 else -1.0, momentum=0.9),
                                         sync_every=1, compressor=puredist.int8_blocks(64))
    collective = puredist.DistributedCollective()
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(numel, generator=gen) for _ in range(3)]
    state = transform.init(params)
    drifts = torch.Generator().manual_seed(rank + 1)
    for _ in range(3):
        for p in params:
            p.add_(torch.randn(p.shape, generator=drifts))
        before = [t.clone() for t in (*params, *state.residuals)]
        try:
            state = transform.update_(params, state, collective=collective)
        except ValueError as error:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, (*params, *state.residuals)))
            return state.step, "``lr``" in str(error), unchanged
    return None


@pytest.mark.parametrize("numel", [100, 40000], ids=["one flat fragment", "per leaf"])
def test_an_outer_step_refused_changes_nothing_in_the_state_passed_in(numel):
    # after inner step 1 the outer step takes lr 0.7; after inner step 2 it would take lr -1
    assert run_workers(_outer_step_refused, 2, numel) == [(1, True, True)] * 2


def test_a_state_made_without_a_compressor_is_refused_naming_the_residuals():
    params = [torch.zeros(2, 3)]
    plain = puredist.outer_optimizer(puredist.sgd(0.7), sync_every=1)
    compressed = puredist.outer_optimizer(puredist.sgd(0.7), sync_every=1, compressor=puredist.int8_blocks(4))
    with pytest.raises(ValueError, match=r"0 error-feedback residuals for 1 parameters.*int8_blocks\(4\)"):
        compressed.update_(params, plain.init(params), collective=puredist.SimulatedCollective(1))
