"""Schedules against brute-force references of torch's two rules."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from puredist import hierarchical_schedule, periodic_schedule


def brute_force_periodic_steps(period, warmup, horizon):
    """The averaging steps, listed by walking forward from the warm-up."""
    return set(range(warmup, horizon, period))


def brute_force_hierarchical_level(periods, warmup, step):
    """Every level whose period divides the step, the highest one wins."""
    if step < warmup:
        return None
    matching = [i for i, p in enumerate(periods) if step % p == 0]
    return max(matching) if matching else None


@given(period=st.integers(1, 12), warmup=st.integers(0, 30), horizon=st.integers(0, 120))
def test_periodic_matches_brute_force(period, warmup, horizon):
    averages = periodic_schedule(period, warmup)
    assert {k for k in range(horizon) if averages(k)} == brute_force_periodic_steps(period, warmup, horizon)


@given(
    periods=st.lists(st.integers(1, 16), min_size=1, max_size=4, unique=True).map(sorted),
    warmup=st.integers(0, 30),
    step=st.integers(0, 500),
)
def test_hierarchical_matches_brute_force(periods, warmup, step):
    assert hierarchical_schedule(periods, warmup)(step) == brute_force_hierarchical_level(periods, warmup, step)


def test_the_two_rules_differ_when_warmup_is_not_a_multiple_of_the_period():
    # torch's periodic rule counts from the end of the warm-up, the hierarchical one from 0
    periodic = periodic_schedule(4, warmup_steps=3)
    hierarchical = hierarchical_schedule([4], warmup_steps=3)
    assert [k for k in range(12) if periodic(k)] == [3, 7, 11]
    assert [k for k in range(12) if hierarchical(k) is not None] == [4, 8]


@pytest.mark.parametrize(
    "period, warmup, error, match",
    [
        (0, 0, ValueError, "period.*positive.*got 0"),
        (-3, 0, ValueError, "period.*got -3"),
        (2, -1, ValueError, "warmup_steps.*non-negative.*got -1"),
        (2.5, 0, TypeError, "period.*int.*2.5"),
        (2, True, TypeError, "warmup_steps.*int"),
    ],
)
def test_periodic_rejects_bad_configuration(period, warmup, error, match):
    with pytest.raises(error, match=match):
        periodic_schedule(period, warmup)


@pytest.mark.parametrize(
    "periods, match",
    [
        ([], "must not be empty"),
        ([0, 2], "minimum period.*positive.*got 0"),
        ([4, 2], "strictly increasing.*\\[4, 2\\]"),
        ([2, 2], "strictly increasing"),
    ],
)
def test_hierarchical_rejects_bad_periods(periods, match):
    with pytest.raises(ValueError, match=match):
        hierarchical_schedule(periods)


def test_hierarchical_names_periods_that_are_not_a_sequence():
    with pytest.raises(TypeError, match=r"Arg ``periods`` must be a sequence of ints, got 5"):
        hierarchical_schedule(5)


def test_errors_name_the_argument_of_the_function_called():
    import puredist
    from puredist import SimulatedCollective

    cases = [
        (lambda: puredist.outer_optimizer(puredist.sgd(lr=1.0), sync_every=0), "``sync_every``"),
        (lambda: puredist.outer_optimizer(puredist.sgd(lr=1.0), sync_every=4, lower_levels={2: 2, 1: 4}),
         "``lower_levels``"),
        (lambda: puredist.hierarchical_averager({}), "``period_group_sizes``"),
        (lambda: puredist.hierarchical_schedule([2, 1]), "``periods``"),
        (lambda: puredist.hierarchical_averager({2: 2, 4: 2}).update([torch.ones(4, 1)], puredist.AveragerState(0),
                                                                     collective=SimulatedCollective(4)),
         "``period_group_sizes`` 2 must be equal to the size of the collective 4"),
    ]
    for build, named in cases:
        with pytest.raises(ValueError) as raised:
            build()
        assert named in str(raised.value), str(raised.value)
        assert "process_group" not in str(raised.value) and "period_group_size_dict" not in str(raised.value)
