"""puredist: communication-efficient distributed training as pure functions over
explicit state, with drop-in replacements for torch's classes in
:mod:`puredist.classic`.

Where to start:

- a collective, the explicit argument every function takes:
  :class:`~puredist.collectives.DistributedCollective` (real ranks, Gloo or NCCL),
  :class:`~puredist.collectives.SimulatedCollective` and :class:`~puredist.VmapCollective`
  (many ranks in one process) — :mod:`puredist.collectives`;
- averaging and its schedules: :func:`average_`, :func:`periodic_averager`,
  :func:`hierarchical_averager` — :mod:`puredist.averaging`;
- DiLoCo and local SGD with an outer optimizer: :func:`outer_optimizer` — :mod:`puredist.outer`;
- the functional optimizers :func:`sgd`, :func:`adam`, :func:`adamw` — :mod:`puredist.optim`;
- ZeRO: :func:`zero` with a plan from :func:`plan_zero` — :mod:`puredist.zero_step`,
  :mod:`puredist.zero_plan`;
- compressed averaging with error feedback: :mod:`puredist.compression`;
- when the averagers average, as plain functions of the step: :mod:`puredist.averaging_schedules`;
- a collective inside ``torch.func.vmap``: :mod:`puredist.collectives` (``VmapCollective``);
- fault tolerance over torchft: :mod:`puredist.ft`;
- for your own tests and transforms: hypothesis strategies in :mod:`puredist.testing`,
  tree functions in :mod:`puredist.tree`;
- torch's classes, same names and signatures: :mod:`puredist.classic`.

This module only re-exports them.
"""

from importlib.metadata import PackageNotFoundError, version

from puredist.averaging import (
    Averager,
    AveragerState,
    average,
    average_,
    averaged_tensors,
    hierarchical_averager,
    periodic_averager,
)
from puredist.errors import RankMismatchError
from puredist.compression import (
    CompressedAverager,
    CompressionState,
    Compressor,
    chunked_top_k,
    compressed_averager,
    int2_blocks,
    int4_blocks,
    int8_blocks,
    top_k,
)
from puredist.collectives import (
    DEFAULT_BUCKET_CAP_BYTES,
    DEFAULT_DEVICE_BUCKET_CAP_BYTES,
    CollectiveError,
    CollectiveHandle,
    Collective,
    DistributedCollective,
    SimulatedCollective,
    VmapCollective,
)
from puredist.optim import Optimizer, adam, adamw, sgd
from puredist.outer import OuterState, OuterTransform, outer_optimizer
from puredist.averaging_schedules import hierarchical_schedule, periodic_schedule
from puredist.zero_plan import ZeroPlan, plan_zero
from puredist.zero_step import Zero, ZeroState, zero

try:
    __version__ = version("puredist")
except PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"

__all__ = [
    "Averager",
    "AveragerState",
    "CollectiveError",
    "CollectiveHandle",
    "Collective",
    "DEFAULT_BUCKET_CAP_BYTES",
    "DEFAULT_DEVICE_BUCKET_CAP_BYTES",
    "DistributedCollective",
    "RankMismatchError",
    "SimulatedCollective",
    "VmapCollective",
    "average",
    "average_",
    "averaged_tensors",
    "hierarchical_averager",
    "hierarchical_schedule",
    "periodic_averager",
    "periodic_schedule",
    "Optimizer",
    "sgd",
    "adam",
    "adamw",
    "ZeroPlan",
    "plan_zero",
    "Zero",
    "ZeroState",
    "zero",
    "OuterState",
    "OuterTransform",
    "outer_optimizer",
    "CompressedAverager",
    "CompressionState",
    "Compressor",
    "chunked_top_k",
    "compressed_averager",
    "int2_blocks",
    "int4_blocks",
    "int8_blocks",
    "top_k",
]
