"""Failure contract of averaging, by injecting the fault: a peer dies or freezes before,
during or after an averaging; a later tensor is unsupported; a handle's wait fails.
Every survivor's tensors hold their old values or the mean — exactly as the
``CollectiveError`` says — and a retry on the surviving group is exact."""

import pytest
import torch
import torch.distributed as dist

import puredist
from faults import fault_at_collective
from puredist import CollectiveError, DistributedCollective, RankMismatchError
from workers import run_workers

TENSORS = 16
NUMEL = 2**20  # 4 MiB of fp32 each: 64 MiB per rank, several buckets of 16 MiB


def values(rank: int, index: int) -> torch.Tensor:
    """Rank ``rank``'s tensor ``index``: small integers, so every sum is exact and the
    mean has one rounding (the same in any summation order)."""
    gen = torch.Generator().manual_seed(1000 * rank + index)
    return torch.randint(-100, 100, (NUMEL,), generator=gen).float()


def mean_of(ranks, index: int) -> torch.Tensor:
    return sum(values(r, index) for r in ranks) / len(ranks)


def assert_old_or_mean_as_reported(tensors, error: CollectiveError, rank: int, ranks) -> list[int]:
    """The contract: tensor i holds the mean in its first ``completed_elements[i]``
    elements and its old values after — nothing else (no partial sums)."""
    for index, (tensor, done) in enumerate(zip(tensors, error.completed_elements)):
        mean, old = mean_of(ranks, index), values(rank, index)
        assert torch.equal(tensor[:done], mean[:done]), f"tensor {index}: not the mean in [0, {done})"
        assert torch.equal(tensor[done:], old[done:]), f"tensor {index}: not the old values after {done}"
    return list(error.completed_elements)


def _average_with_a_fault(rank, world_size, when, how):
    tensors = [values(rank, i) for i in range(TENSORS)]
    victim = world_size - 1
    if rank == victim and when == "before":
        fault_at_collective(0, how=how, when="before")  # never joins the first bucket
    if rank == victim and when == "during":
        fault_at_collective(2, how=how, when="during")  # goes down inside the third bucket
    collective = DistributedCollective()
    survivors = list(range(world_size - 1))
    try:
        puredist.average_(tensors, collective=collective)
    except CollectiveError as error:
        assert "No tensor holds a partial result" in str(error)
        completed = assert_old_or_mean_as_reported(tensors, error, rank, range(world_size))
    else:
        assert when == "after", "averaging with a dead peer returned normally"
        for index, tensor in enumerate(tensors):
            assert torch.equal(tensor, mean_of(range(world_size), index))
        completed = [NUMEL] * TENSORS
        if rank == victim:
            fault_at_collective(0, how=how, when="before")
            dist.all_reduce(torch.zeros(1))
    # retry on the surviving group: the mean over survivors of what each now holds
    group = dist.new_group(survivors, use_local_synchronization=True)
    held = [t.clone() for t in tensors]
    puredist.average_(tensors, collective=DistributedCollective(group))
    gathered = [[torch.empty_like(t) for _ in survivors] for t in held]
    for index, t in enumerate(held):
        dist.all_gather(gathered[index], t, group=group)
        assert torch.equal(tensors[index], sum(gathered[index]) / len(survivors))
    return completed


@pytest.mark.parametrize("when", ["before", "during", "after"])
def test_a_peer_dying_leaves_old_values_or_means_as_reported_and_a_retry_is_exact(when):
    # A survivor whose ring neighbour is the other survivor (alive, already failed) sees
    # no closed socket: it learns of the death from Gloo's timeout, kept well below the job's.
    results = run_workers(_average_with_a_fault, 3, when, "die", victims=(2,), timeout=60, gloo_timeout=10)
    first, second = results[0], results[1]
    assert first is not None and second is not None
    if when == "before":
        assert first == second == [0] * TENSORS  # nothing was averaged anywhere
    if when == "during":
        # the victim took part in two buckets: some tensors were averaged, some not
        assert any(c == NUMEL for c in first) and any(c < NUMEL for c in first)


def test_a_frozen_peer_times_out_with_old_values_or_means_as_reported():
    results = run_workers(_average_with_a_fault, 3, "during", "freeze", victims=(2,), timeout=60, gloo_timeout=3)
    assert results[0] is not None and results[1] is not None


def _later_tensor_unsupported(rank, world_size):
    dense = torch.full((2**19,), float(rank + 1))  # 2 MiB
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(ValueError, match=r"leaf 1 .*sparse_coo.*only dense"):
        puredist.average_([dense, sparse], collective=DistributedCollective())
    assert torch.equal(dense, torch.full((2**19,), float(rank + 1)))  # untouched: 1.0 / 2.0, not 3.0
    puredist.average_([dense], collective=DistributedCollective())  # the group still works
    assert torch.equal(dense, torch.full((2**19,), 1.5))


def test_an_unsupported_tensor_late_in_the_list_is_refused_before_anything_is_averaged():
    run_workers(_later_tensor_unsupported, 2)


def _unknown_group_size(rank, world_size):
    tensor = torch.full((4,), float(rank + 1))
    collective = DistributedCollective()
    for bad in (3, 2.0, True):  # (a float or a bool equal to a size is no size either)
        with pytest.raises(ValueError, match=rf"Arg ``group_size`` {bad} must be a size of group the collective "
                                             r"averages within, \(2,\) \(build it with DistributedCollective.with_subgroups"):
            collective.mean_([tensor], group_size=bad)
    assert torch.equal(tensor, torch.full((4,), float(rank + 1)))  # untouched
    collective.mean_([tensor], group_size=2)
    assert torch.equal(tensor, torch.full((4,), 1.5))


def test_a_group_size_the_collective_has_no_group_of_is_refused_naming_it():
    run_workers(_unknown_group_size, 2)


class _Listener:
    """A collective's ``refuse_on_all_ranks`` alone, recording what each refusal told."""

    def __init__(self) -> None:
        self.told = []

    def refuse_on_all_ranks(self, reason, *, group_size=None, context=""):
        self.told.append((reason, group_size, str(context)))


@pytest.mark.parametrize("kind", [TypeError, ValueError])
def test_refusing_tells_the_peers_then_raises_the_same_error(kind):
    from puredist.collectives import refusing

    listener, error = _Listener(), kind("Arg ``x``: bad")
    with pytest.raises(kind) as raised:
        with refusing(listener, group_size=2, context="step 3"):
            raise error
    assert raised.value is error
    assert listener.told == [(f"{kind.__name__}: Arg ``x``: bad", 2, "step 3")]


def test_refusing_tells_nobody_of_another_error_or_of_none():
    from puredist.collectives import refusing

    listener = _Listener()
    with pytest.raises(RuntimeError):
        with refusing(listener, context="step 3"):
            raise RuntimeError("the backend")
    with refusing(listener, context="step 3"):
        pass
    with pytest.raises(ValueError):  # one process: nobody to tell, the error all the same
        with refusing(puredist.SimulatedCollective(2)):
            raise ValueError("bad")
    assert listener.told == []


def _async_wait_fails(rank, world_size):
    tensors = [values(rank, i) for i in range(TENSORS)]
    if rank == 2:
        fault_at_collective(1, how="die", when="before")  # the first bucket succeeds, the second fails
    handle = puredist.average_(tensors, collective=DistributedCollective(), async_op=True)
    with pytest.raises(CollectiveError, match="No tensor holds a partial result") as first:
        handle.wait()
    assert not handle.is_completed() and handle.error is first.value
    with pytest.raises(CollectiveError) as second:
        handle.wait()  # stays failed
    assert second.value is first.value
    for index, tensor in enumerate(tensors):  # all or nothing: nothing
        assert torch.equal(tensor, values(rank, index))
    return True


def test_a_failed_wait_stays_failed_and_writes_nothing():
    results = run_workers(_async_wait_fails, 3, victims=(2,), timeout=60)
    assert results[:2] == [True, True]


def _launch_raises(rank, world_size):
    tensors = [values(rank, i) for i in range(TENSORS)]
    if rank == 1:
        fault_at_collective(2, how="raise")  # launching the third bucket raises here
    with pytest.raises(CollectiveError, match="No tensor holds a partial result") as error:
        puredist.average_(tensors, collective=DistributedCollective())
    assert_old_or_mean_as_reported(tensors, error.value, rank, range(world_size))
    return error.value.failed_bucket


def test_an_exception_launching_a_later_bucket_leaves_old_values_or_means_on_both_sides():
    peer, launcher = run_workers(_launch_raises, 2, timeout=60, gloo_timeout=3, broken=True)
    assert launcher == 2 and peer >= 2  # the peer waits for that bucket until the timeout


def _peer_gone_before_the_check(rank, world_size):
    import os

    dist.barrier()  # every connection is up
    if rank == 2:
        os._exit(0)
    tensors = [values(rank, i) for i in range(2)]
    with pytest.raises(CollectiveError, match="failed in the rank check") as error:
        puredist.average_(tensors, collective=DistributedCollective())
    assert error.value.failed_bucket is None and error.value.completed_elements == (0, 0)
    assert all(torch.equal(t, values(rank, i)) for i, t in enumerate(tensors))
    return True


def test_a_peer_gone_before_the_rank_check_is_a_collective_error_that_changed_nothing():
    assert run_workers(_peer_gone_before_the_check, 3, victims=(2,), timeout=60)[:2] == [True, True]


def _summary_fails(rank, world_size):
    import puredist._consistency as consistency

    def fails(*args):
        raise RuntimeError("the summary could not be made")

    consistency.digest = fails  # (this worker's own module: the fork's copy)
    tensors = [values(rank, i) for i in range(2)]
    with pytest.raises(CollectiveError, match="failed in the rank check") as error:
        puredist.average_(tensors, collective=DistributedCollective())
    assert isinstance(error.value.__cause__, RuntimeError) and error.value.completed_elements == (0, 0)
    assert all(torch.equal(t, values(rank, i)) for i, t in enumerate(tensors))
    return True


def test_a_rank_check_whose_summary_cannot_be_made_is_a_collective_error_that_changed_nothing():
    assert run_workers(_summary_fails, 2, timeout=60) == [True, True]


def _staging_fails_on_one_rank_of_a_mismatch(rank, world_size, async_op):
    import puredist.staging.pool as staging_pool

    if rank == 0:  # its first bucket cannot be staged, after its rank check has been sent
        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("injected: no staging memory")
        staging_pool._staging_memory = out_of_memory
    collective = DistributedCollective()
    x = torch.ones(4 + rank)  # the ranks' layouts differ
    for _ in range(2):  # and again, as a loop that catches the error would
        with pytest.raises(RankMismatchError):
            collective.mean_([x], async_op=async_op)
    assert torch.equal(x, torch.ones(4 + rank))
    return True


@pytest.mark.parametrize("async_op", [False, True])
def test_a_rank_failing_to_stage_after_sending_its_rank_check_finishes_it_so_that_no_peer_waits(async_op):
    # every rank raises the mismatch at once; before, the peer waited in the check for the Gloo timeout
    assert run_workers(_staging_fails_on_one_rank_of_a_mismatch, 2, async_op, timeout=60, gloo_timeout=30) == [True, True]


class _Done:
    def wait(self):
        return True


def test_a_failed_run_drops_its_staging_pool_so_that_no_later_call_shares_it():
    from puredist.staging.pool import StagingPool
    from puredist.staging.run import StagingOptions, run_staged

    pool = StagingPool(64)
    calls = []

    def launch(buffer):
        calls.append(buffer)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return _Done()

    # 160 bytes: 5 buckets of 32; pool slots are 64-byte aligned, so one bucket is in flight at a
    # time and buckets 1 and 2 are written back before bucket 3 is launched
    tensors = [torch.ones(40)]
    with pytest.raises(CollectiveError, match=r"bucket 3 of 5.*elements \[0, 16\)") as error:
        run_staged(tensors, launch, StagingOptions("test", bucket_cap_bytes=64), pool=pool, async_op=False)
    assert error.value.completed_elements == (16,)
    assert pool._memory == {}  # the buffers the failed run handed out are never reused


@pytest.mark.parametrize("async_op", [False, True])
def test_the_gate_runs_once_the_first_bucket_is_packed_and_before_any_collective(async_op, monkeypatch):
    # the rank check's second half: its round trip overlaps the first bucket's packing, and its error
    # leaves every tensor as it was, with no collective started
    from puredist.staging.pool import StagingPool
    from puredist.staging.run import StagingOptions, run_staged

    tensors = [torch.arange(40.0)]  # 160 bytes: 5 buckets of 32
    events = []
    copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda *args: events.append(("copy", None)) or copy(*args))

    def launch(buffer):
        events.append(("launch", buffer.tolist()))
        return _Done()

    def gate():
        events.append(("gate", None))

    handle = run_staged(tensors, launch, StagingOptions("test", bucket_cap_bytes=64), pool=StagingPool(1024),
                        async_op=async_op, gate=gate)
    if handle is not None:
        handle.wait()
    kinds = [kind for kind, _ in events]
    assert kinds[:3] == ["copy", "gate", "launch"] and kinds.count("gate") == 1 and kinds.count("launch") == 5
    assert events[2][1] == list(range(8))  # the first bucket, packed before the gate

    class Refused(Exception):
        pass

    def refusing_gate():
        raise Refused("ranks differ")

    events.clear()
    pool = StagingPool(1024)
    with pytest.raises(Refused):
        run_staged(tensors, launch, StagingOptions("test", bucket_cap_bytes=64), pool=pool, async_op=async_op,
                   gate=refusing_gate)
    assert [kind for kind, _ in events] == ["copy"] and torch.equal(tensors[0], torch.arange(40.0))
    if async_op:  # the packed buffer, never sent, is kept for the next run
        assert sum(pool._spare_bytes.values()) == 32


def test_the_gate_is_passed_where_there_is_no_bucket():
    from puredist.staging.pool import StagingPool
    from puredist.staging.run import StagingOptions, run_staged

    passed = []
    for async_op in (False, True):
        run_staged([], lambda buffer: _Done(), StagingOptions("test", bucket_cap_bytes=64), pool=StagingPool(1024),
                   async_op=async_op, gate=lambda: passed.append(True))
    assert passed == [True, True]


class _Failed:
    def wait(self):
        raise RuntimeError("injected")


def test_async_buffers_are_reused_after_success_and_dropped_after_a_failure():
    from puredist.staging.pool import StagingPool
    from puredist.staging.run import StagingOptions, run_staged

    pool = StagingPool(1024)
    tensors = [torch.ones(40)]  # 160 bytes: 5 buckets of 32
    seen = []

    def launch(buffer):
        seen.append(buffer.data_ptr())
        return _Done()

    run_staged(tensors, launch, StagingOptions("test", bucket_cap_bytes=64), pool=pool, async_op=True).wait()
    first = list(seen)
    seen.clear()
    run_staged(tensors, launch, StagingOptions("test", bucket_cap_bytes=64), pool=pool, async_op=True).wait()
    assert sorted(seen) == sorted(first)  # the same memory, no new allocation

    failing = run_staged(tensors, lambda b: _Failed(), StagingOptions("test", bucket_cap_bytes=64), pool=pool,
                         async_op=True)
    with pytest.raises(CollectiveError):
        failing.wait()
    assert not any(pool._spare_bytes.values())  # the failed run's buffers may still be held by the backend: not reused
    assert torch.equal(tensors[0], torch.ones(40))


def test_an_async_run_whose_later_bucket_fails_writes_none_of_the_buckets_that_succeeded():
    # deterministic, where the job above races: buckets 1 and 2 of 5 succeed, bucket 3 fails at its wait
    from puredist.staging.pool import StagingPool
    from puredist.staging.run import StagingOptions, run_staged

    pool = StagingPool(1024)
    tensors = [torch.arange(40.0)]  # 160 bytes: 5 buckets of 32
    outcomes = iter([_Done(), _Done(), _Failed(), _Done(), _Done()])

    def launch(buffer):
        buffer.mul_(-1)  # what a collective would leave there: another value
        return next(outcomes)

    handle = run_staged(tensors, launch, StagingOptions("test", bucket_cap_bytes=64), pool=pool, async_op=True)
    with pytest.raises(CollectiveError, match="in bucket 3 of 5") as error:
        handle.wait()
    assert error.value.completed_elements == (0,)
    assert torch.equal(tensors[0], torch.arange(40.0))  # all or nothing: nothing


def _source_dies_mid_broadcast(rank, world_size):
    tensors = [values(rank, i) for i in range(TENSORS)]
    source = world_size - 1
    if rank == source:
        fault_at_collective(2, how="die", when="during")
    with pytest.raises(CollectiveError, match="Broadcast from rank 2 failed") as error:
        DistributedCollective().broadcast_(tensors, src=source)
    for index, (tensor, done) in enumerate(zip(tensors, error.value.completed_elements)):
        assert torch.equal(tensor[:done], values(source, index)[:done])  # the owner's values
        assert torch.equal(tensor[done:], values(rank, index)[done:])  # or the old ones
    return list(error.value.completed_elements)


def test_a_source_dying_mid_broadcast_leaves_receivers_with_old_or_sent_values_as_reported():
    # a receiver may wait for data the dead source no longer relays: Gloo's timeout ends it
    first, second = run_workers(_source_dies_mid_broadcast, 3, victims=(2,), timeout=60, gloo_timeout=5)[:2]
    assert first is not None and second is not None


def _averaged_across_inference_mode(rank, world_size):
    collective = DistributedCollective()
    big, small = torch.full((2**18,), float(rank)), torch.full((4,), 10.0 * rank, dtype=torch.float64)
    with torch.inference_mode():  # blocking inside the mode first: the pool's memory is made there
        collective.mean_([torch.full((8,), float(rank))])
        frozen = torch.full((4,), float(rank))  # an inference tensor, averaged only inside the mode
        handle = collective.mean_([big, small], async_op=True)
        frozen_handle = collective.mean_([frozen], async_op=True)
    handle.wait()  # outside the mode: one bucket divides into its tensor, the other is divided in its buffer
    frozen_handle.wait()
    again = [torch.full((8,), float(rank)), torch.full((4,), 10.0 * rank, dtype=torch.float64)]
    collective.mean_(again)  # outside the mode, on the pool's memory and spares made inside it
    collective.mean_(again, async_op=True).wait()
    return big[0].item(), small.tolist(), frozen.tolist(), again[0][0].item(), again[1].tolist()


def test_an_averaging_started_in_inference_mode_and_waited_outside_writes_every_result():
    # its staging buffers were inference tensors: outside the mode the second bucket's division raised,
    # after the first bucket was written (a partial result and a raw RuntimeError)
    for big, small, frozen, again, again_small in run_workers(_averaged_across_inference_mode, 2):
        assert big == 0.5 and small == [5.0] * 4 and frozen == [0.5] * 4
        assert again == 0.5 and again_small == [5.0] * 4


def test_a_write_back_that_raises_is_a_collective_error_saying_what_was_written(monkeypatch):
    from puredist.staging.pool import StagingPool
    from puredist.staging.run import StagingOptions, run_staged
    from puredist.staging.run import _BucketInFlight

    real = _BucketInFlight.write_back

    def third_fails(bucket):
        if bucket.position == 2:
            raise RuntimeError("injected write-back failure")
        real(bucket)

    monkeypatch.setattr(_BucketInFlight, "write_back", third_fails)
    for async_op in (False, True):
        tensors, handles = [torch.arange(40.0)], []  # 160 bytes: 5 buckets of 32

        def run():
            handles.append(run_staged(tensors, lambda buffer: _Done(), StagingOptions("test", bucket_cap_bytes=64),
                                      pool=StagingPool(1024), async_op=async_op))
            handles[-1].wait()  # (a blocking run raises before)

        with pytest.raises(CollectiveError, match=r"bucket 3 of 5.*elements \[0, 16\)") as error:
            run()
        assert error.value.completed_elements == (16,)
        if async_op:  # the handle stays failed, with the same error
            with pytest.raises(CollectiveError) as again:
                handles[0].wait()
            assert again.value is error.value and not handles[0].is_completed() and handles[0].error is error.value
