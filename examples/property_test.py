"""Property-test your own distributed training step, many ranks in one process.

The training step is written once, for one rank (as it would run under torchrun with
a ``DistributedCollective``); ``vmap`` with a ``VmapCollective(R)`` runs it for R
simulated ranks in one process, so a whole post-local SGD step — each rank's local
SGD step, then the scheduled averaging — is checked by hypothesis against plain
arithmetic, without any process group.

    python examples/property_test.py        # or: pytest examples/property_test.py
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad, vmap

import puredist


def loss_fn(w, x, y):
    return ((x @ w - y) ** 2).mean()


@settings(max_examples=50, deadline=None)
@given(
    replicas=st.sampled_from([2, 4, 8]),
    period=st.integers(2, 5),
    steps=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_post_local_sgd_keeps_the_mean_model_on_the_sgd_path(replicas, period, steps, seed):
    """With plain SGD, the mean of the replicas moves by exactly -lr times the mean
    gradient at every step, whether or not the step averages; and right after an
    averaging step, all replicas agree."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(replicas, 3, dtype=torch.float64, generator=gen)  # one row per simulated rank
    averager = puredist.periodic_averager(period)
    state = averager.init(w)
    lr = 0.1

    def train_step(w, x, y, state, collective):  # one rank's step
        w = w - lr * grad(loss_fn)(w, x, y)
        return averager.update(w, state, collective=collective)

    ranks = vmap(train_step, in_dims=(0, 0, 0, None, None), out_dims=(0, None))
    for _ in range(steps):
        x = torch.randn(replicas, 5, 3, dtype=torch.float64, generator=gen)
        y = torch.randn(replicas, 5, dtype=torch.float64, generator=gen)
        g = vmap(grad(loss_fn))(w, x, y)  # the oracle: every rank's gradient on its own batch
        expected_mean = w.mean(0) - lr * g.mean(0)
        due = state.step % period == 0  # the schedule, written out by hand
        w, state = ranks(w, x, y, state, puredist.VmapCollective(replicas))
        torch.testing.assert_close(w.mean(0), expected_mean)
        if due:
            torch.testing.assert_close(w, w[:1].expand_as(w))


if __name__ == "__main__":
    test_post_local_sgd_keeps_the_mean_model_on_the_sgd_path()
    print("property holds")
