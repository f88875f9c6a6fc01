"""The multi-process harness itself: results come back by rank, failures and hangs
are reported instead of blocking."""

import pytest
import torch
import torch.distributed as dist

from workers import WorkerError, run_workers


def _sum_of_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, t.item()


def test_results_come_back_by_rank():
    assert run_workers(_sum_of_ranks, 3) == [(0, 3.0), (1, 3.0), (2, 3.0)]


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on one")
    return rank


def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(WorkerError, match="boom on one"):
        run_workers(_fail_on_rank_one, 2)


def _hang_on_rank_zero(rank, world_size):
    if rank == 0:
        import time

        time.sleep(60)
    return rank


def test_a_hang_is_a_timeout_not_a_blocked_suite():
    # rank 1 finishes its function, then waits for rank 0 at the final barrier
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish"):
        run_workers(_hang_on_rank_zero, 2, timeout=3)
