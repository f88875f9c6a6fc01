"""Drop-in for ``torch.distributed.algorithms.model_averaging.hierarchical_model_averager``.

This module must not average by itself: it calls puredist's hierarchical averager.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch.distributed as dist

from puredist._validation import as_int, check_hierarchy_group_sizes, check_hierarchy_periods, warn_if_max_period_is_one
from puredist.averaging import hierarchical_averager_warning_at
from puredist.classic.averagers import _CoreAverager
from puredist.collectives import DistributedCollective, subgroup
from puredist.averaging_schedules import hierarchical_schedule

__all__ = ["HierarchicalModelAverager"]

logger = logging.getLogger(__name__)


class HierarchicalModelAverager(_CoreAverager):
    """Hierarchical model averaging (hierarchical SGD), torch's class re-built on the
    pure core.

    At step ``k >= warmup_steps`` the largest period in ``period_group_size_dict``
    dividing ``k`` wins, and the ranks average within blocks of that period's group
    size (created with ``dist.new_subgroups``, as torch does).

    Args:
        period_group_size_dict: ordered ``{period: group_size}``; periods strictly
            increasing, every size a divisor of the group's size, the last size equal
            to it.
        warmup_steps (int): steps before averaging starts.
        process_group: the overall group (``None``: the default group).

    Attributes:
        period_process_group_dict: ``OrderedDict`` from period to this rank's process
            group at that level, as in torch. Subgroups are made on first use and
            reused by later averagers over the same group (torch makes new ones for
            every averager and never frees them: 9 file descriptors and 6 threads
            each at 4 ranks).

    Raises:
        ValueError: empty dict, non-positive or unordered periods, a size that does
            not divide the group, a last size other than the group's size, negative
            warmup — all before any subgroup is created.
    """

    def __init__(self, period_group_size_dict=None, warmup_steps=0, process_group=None):
        super().__init__(process_group)
        hierarchy = {as_int(period): as_int(size) for period, size in (period_group_size_dict or {}).items()}
        check_hierarchy_periods(tuple(hierarchy), arg="period_group_size_dict")  # torch's names in messages
        self._hierarchy = hierarchy
        # in torch's order: the warning (at the caller's line), the group sizes, the warm-up
        warn_if_max_period_is_one(tuple(hierarchy), stacklevel=2)
        overall_group_size = dist.get_world_size(group=self.process_group)
        check_hierarchy_group_sizes(
            tuple(hierarchy.values()), overall_group_size, arg="period_group_size_dict", whole="arg ``process_group``"
        )
        self._schedule(warmup_steps, stacklevel=None)

        self.period_process_group_dict = OrderedDict()
        logger.info("Model averaging hierarchy:")
        for period, group_size in hierarchy.items():
            logger.info(
                "\tEach group that has %s processes average parameters every %s iterations, "
                "if no higher-level averaging.",
                group_size,
                period,
            )
            if group_size != overall_group_size:
                self.period_process_group_dict[period] = subgroup(self.process_group, group_size)
            else:
                self.period_process_group_dict[period] = self.process_group
        self._collective = DistributedCollective(
            self.process_group,
            subgroups={hierarchy[p]: g for p, g in self.period_process_group_dict.items()},
        )

    def _schedule(self, warmup_steps, *, stacklevel: int | None) -> None:
        warmup_steps = as_int(warmup_steps)
        self._averager = hierarchical_averager_warning_at(self._hierarchy, warmup_steps, stacklevel=stacklevel)
        levels = hierarchical_schedule(tuple(self._hierarchy), warmup_steps)
        self._due = lambda step: levels(step) is not None
        self._warmup_steps = warmup_steps

    @property
    def warmup_steps(self) -> int:
        """Steps before averaging starts. Settable, as torch's (which reads it at every
        call): the schedule from the current step on, checked as when built. (The
        hierarchy is fixed when built.)"""
        return self._warmup_steps

    @warmup_steps.setter
    def warmup_steps(self, warmup_steps) -> None:
        self._schedule(warmup_steps, stacklevel=None)
