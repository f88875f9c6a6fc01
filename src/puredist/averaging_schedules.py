"""When to average: pure functions from a step counter to a decision.

Both of torch's rules are offered, each under its own name, because they differ
whenever ``warmup_steps`` is not a multiple of the period:

- :func:`periodic_schedule` (torch's ``PeriodicModelAverager``): average at step ``k``
  iff ``k >= warmup_steps and (k - warmup_steps) % period == 0``; the period is
  counted from the end of the warm-up, so the first averaging is at ``warmup_steps``.
- :func:`hierarchical_schedule` (torch's ``HierarchicalModelAverager``): at step
  ``k >= warmup_steps`` the *largest* period dividing ``k`` itself (not
  ``k - warmup_steps``) wins; ``None`` when no period divides ``k``.

Steps are Python ints so the decision is taken on the host, identically on every
rank, without a device synchronization.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from puredist._validation import (
    check_hierarchy_periods,
    check_period,
    check_warmup_steps,
)

__all__ = ["periodic_schedule", "hierarchical_schedule"]


def periodic_schedule(period: int, warmup_steps: int = 0) -> Callable[[int], bool]:
    """Return ``averages(step) -> bool`` for post-local SGD's periodic averaging.

    Args:
        period: steps between two averagings (``>= 1``).
        warmup_steps: steps before the first averaging (``>= 0``).

    Returns:
        ``averages(step)``, true iff ``step >= warmup_steps`` and
        ``(step - warmup_steps) % period == 0``.

    Raises:
        ValueError: ``period < 1`` or ``warmup_steps < 0``.
        TypeError: either is not an int.
    """
    check_period(period)
    check_warmup_steps(warmup_steps)

    def averages(step: int) -> bool:
        return step >= warmup_steps and (step - warmup_steps) % period == 0

    return averages


def hierarchical_schedule(
    periods: Sequence[int], warmup_steps: int = 0
) -> Callable[[int], int | None]:
    """Return ``level(step) -> index | None`` for hierarchical SGD.

    Args:
        periods: strictly increasing positive periods, one per level of the
            hierarchy, lowest (most frequent, smallest group) first.
        warmup_steps: steps before the first averaging (``>= 0``).

    Returns:
        ``level(step)``: the index into ``periods`` of the largest period dividing
        ``step`` when ``step >= warmup_steps``, else ``None`` (no averaging).

    Raises:
        ValueError: empty, non-positive or not strictly increasing ``periods``, or
            ``warmup_steps < 0``.
        TypeError: ``periods`` is not a sequence.
    """
    if not isinstance(periods, Iterable):
        raise TypeError(f"Arg ``periods`` must be a sequence of ints, got {periods!r}.")
    periods = tuple(periods)
    check_hierarchy_periods(periods, arg="periods")
    check_warmup_steps(warmup_steps)
    levels_high_to_low = tuple(reversed(range(len(periods))))

    def level(step: int) -> int | None:
        if step < warmup_steps:
            return None
        for index in levels_high_to_low:
            if step % periods[index] == 0:
                return index
        return None

    return level
