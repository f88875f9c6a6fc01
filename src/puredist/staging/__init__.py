"""Staging: how a collective reduces a list of tensors in bounded buckets, so that no
tensor ever holds a partial result (each element its old value or the result).

One concern a module:

- :mod:`puredist.staging.plan`: how a list of tensors is cut into buckets of one device
  and dtype (:class:`~puredist.staging.plan.PlannedBucket`, its pieces), and what each
  bucket's staging needs, derived once per layout
  (:class:`~puredist.staging.plan.BucketLayout`);
- :mod:`puredist.staging.pool`: the bounded staging memory kept between runs
  (:class:`~puredist.staging.pool.StagingPool`) and its stream fences;
- :mod:`puredist.staging.run`: stage, reduce and write back, bucket by bucket
  (:func:`~puredist.staging.run.run_staged`, its options one
  :class:`~puredist.staging.run.StagingOptions`), and the handle of an asynchronous run
  (:class:`~puredist.CollectiveHandle`).

The errors a run raises are in :mod:`puredist.errors`. This package only re-exports.
"""

from puredist.staging.plan import BucketLayout, PlannedBucket, Piece, bucket_layouts, plan_buckets
from puredist.staging.pool import (
    DEVICE_BUCKET_CAP_BYTES,
    HOST_BUCKET_CAP_BYTES,
    StagingPool,
    default_bucket_cap_bytes,
)
from puredist.staging.run import CollectiveHandle, Launch, Scales, StagingOptions, no_scaling, run_staged

__all__ = [
    "DEVICE_BUCKET_CAP_BYTES",
    "HOST_BUCKET_CAP_BYTES",
    "BucketLayout",
    "CollectiveHandle",
    "Launch",
    "Piece",
    "PlannedBucket",
    "Scales",
    "StagingOptions",
    "StagingPool",
    "bucket_layouts",
    "default_bucket_cap_bytes",
    "no_scaling",
    "plan_buckets",
    "run_staged",
]
