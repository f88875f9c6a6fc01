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

The errors a run raises are in :mod:`puredist.errors`. What a user of puredist meets of
staging is the handle of an asynchronous averaging, :class:`~puredist.CollectiveHandle`:
the one name this package exports; the
collectives import the rest from its modules.
"""

from puredist.staging.run import CollectiveHandle

__all__ = ["CollectiveHandle"]
