"""puredist: communication-efficient distributed training as pure functions over
explicit state, with drop-in replacements for torch's classes in
:mod:`puredist.classic`."""

from puredist._consistency import RankMismatchError
from puredist.averaging import (
    Averager,
    AveragerState,
    average,
    average_,
    hierarchical_averager,
    periodic_averager,
)
from puredist.collectives import (
    DEFAULT_BUCKET_CAP_BYTES,
    AveragingHandle,
    Collective,
    DistributedCollective,
    SimulatedCollective,
)
from puredist.schedules import hierarchical_schedule, periodic_schedule

__all__ = [
    "Averager",
    "AveragerState",
    "AveragingHandle",
    "Collective",
    "DEFAULT_BUCKET_CAP_BYTES",
    "DistributedCollective",
    "RankMismatchError",
    "SimulatedCollective",
    "average",
    "average_",
    "hierarchical_averager",
    "hierarchical_schedule",
    "periodic_averager",
    "periodic_schedule",
]
