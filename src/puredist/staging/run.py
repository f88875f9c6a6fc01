"""Run one collective per bucket over staging buffers: bounded memory, and no tensor
ever holds a partial result.

Each bucket of the plan (:mod:`puredist.staging.plan`) is copied into a staging buffer
(the *pack*), the collective runs on the buffer, and only once it has succeeded is
the result copied back into the tensors (the *write-back*). If a collective fails —
a peer died or froze, a timeout, an error in the backend — the tensors of that bucket
and of every later one are left untouched, and those of earlier buckets hold their
result: every element holds its value from before the call or its result, and
:class:`~puredist.errors.CollectiveError` says which.

Blocking runs (:func:`run_staged` without ``async_op``) reuse one staging pool (:mod:`puredist.staging.pool`) of at
most ``bucket_cap_bytes`` per device (by default the pool's capacity, see
:func:`~puredist.staging.pool.default_bucket_cap_bytes`), writing each bucket back as soon as it is done
(the copy into bucket ``k + 1`` overlaps the collective of bucket ``k``). Asynchronous
runs stage every bucket at once and write back only when :meth:`CollectiveHandle.wait`
has seen *every* collective succeed: all or nothing.

This module must not check its inputs or talk to other ranks except through the
``launch`` and the ``gate`` it is given: callers pass checked tensors and have run the
rank check, or finish it in the gate.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from typing import Callable, Mapping, NamedTuple, Sequence

import torch

from puredist._layout import Layout, layout_of
from puredist.errors import CollectiveError
from puredist.staging.plan import BucketLayout, bucket_layouts, plan_buckets
from puredist.staging.pool import StagingPool, fresh_buffer, staging_bytes

Launch = Callable[[torch.Tensor], object]
"""Starts the asynchronous collective on a staging buffer; returns its ``Work``."""

Scales = Callable[[torch.Tensor], "tuple[int | None, int | None]"]
"""``staging buffer -> (before, after)``: the divisions around a bucket's collective
(they depend on its dtype and device)."""


def no_scaling(buffer: torch.Tensor) -> tuple[None, None]:
    """:data:`Scales` of a collective that does not divide (a broadcast)."""
    return None, None


class StagingOptions(NamedTuple):
    """What one run does: how its tensors are cut into buckets, and what it does with
    each of them (the same for all).

    Attributes:
        what: the operation, for errors.
        pack: copy the tensors' values into the buffer first (a broadcast receiver
            does not: the collective only writes it).
        scales: ``scales(buffer) -> (before, after)``: divide the buffer by ``before``
            ahead of the collective and by ``after`` once it is done (``None``: no).
        write_back: copy the result into the tensors (a broadcast source does not).
            A bucket that is one contiguous piece, packed and not written back, is
            sent from the tensor's own storage.
        bucket_cap_bytes: the staging memory of a blocking run, per device; buckets
            are half of it (``None``: the pool's capacity for each device).
        alone_from: see :func:`~puredist.staging.plan.plan_buckets`.
    """

    what: str
    pack: bool = True
    scales: Scales = no_scaling
    write_back: bool = True
    bucket_cap_bytes: int | None = None
    alone_from: int | None = None


class _BucketInFlight:
    """One bucket's staging buffer, its collective, and how to write it back: packed
    when made, its collective started by :meth:`start`.

    Args:
        bucket: the bucket.
        tensors: the full tensor list the pieces index.
        staging: gives the staging buffer (``bucket.planned.nbytes`` bytes, the tensors'
            dtype), its views and the call that releases it once it is written back
            (not after a failure: the backend may still hold it) or ``None``; not
            called for a bucket sent from the tensor's own storage.
        options: whether to pack, scale and write back.
    """

    def __init__(self, bucket: BucketLayout, tensors, staging: Callable[[], tuple[torch.Tensor, list, object]],
                 options: StagingOptions):
        self.bucket = bucket
        self._targets = bucket.targets(tensors)
        scale_before, self._scale_after = options.scales(self._targets[0])
        pack, write_back = options.pack, options.write_back
        self._write_back = write_back
        self._release = None
        if pack and not write_back and scale_before is None and len(self._targets) == 1 and self._targets[0].is_contiguous():
            # a source only reads: send from its own storage, detached (Gloo copies a CUDA
            # tensor's result back into the source too, at wait, in the caller's grad mode)
            buffer, pack = self._targets[0].detach().view(-1), False
            self._views = None
        else:
            buffer, self._views, self._release = staging()
        self._buffer = buffer
        if pack:
            with torch.no_grad():  # the staging views are multiple views of one buffer
                torch._foreach_copy_(self._views, self._targets)
            if scale_before is not None:
                buffer.div_(scale_before)
        self._work = None

    def discard(self) -> None:
        """Give the staging buffer back unsent (its collective is not to start)."""
        if self._release is not None:
            self._release()

    def start(self, launch: Launch) -> None:
        """Start the collective on the packed buffer."""
        self._work = launch(self._buffer)

    @property
    def position(self) -> int:
        return self.bucket.position

    def wait(self) -> None:
        """Block until the collective is done (raises what the backend raised)."""
        self._work.wait()

    def write_back(self) -> None:
        """Copy the result into the tensors (divided on the way, or the buffer divided
        first: see :attr:`BucketLayout.divides_into_targets`), then let go of the buffer."""
        if self._write_back:
            with torch.no_grad():
                if self._scale_after is not None and self.bucket.divides_into_targets:
                    for target, view in zip(self._targets, self._views):
                        torch.div(view, self._scale_after, out=target)
                else:
                    if self._scale_after is not None:
                        self._buffer.div_(self._scale_after)
                    torch._foreach_copy_(self._targets, self._views)
        if self._release is not None:
            self._release()
        self._buffer = self._views = self._work = self._release = self._targets = None


class _Progress:
    """How many buckets, in plan order, hold their result so far; the elements of
    each tensor they cover are counted only for an error."""

    def __init__(self, buckets: Sequence[BucketLayout], tensors: Sequence[torch.Tensor], what: str) -> None:
        self.buckets = buckets
        self.tensors = tensors
        self.what = what
        self.done = 0

    def written(self) -> None:
        self.done += 1

    def error(self, failed_bucket: int | None, cause: BaseException) -> CollectiveError:
        totals = [t.numel() for t in self.tensors]
        completed = [0] * len(totals)
        for bucket in self.buckets[: self.done]:
            for piece in bucket.planned.pieces:
                completed[piece.index] += piece.stop - piece.start
        return CollectiveError(self.what, completed, totals, failed_bucket, len(self.buckets), cause)


class CollectiveHandle:
    """Collectives in flight; :meth:`wait` completes them all or writes nothing.

    The tensors must not be read or written until :meth:`wait` returns. If any of the
    collectives failed, :meth:`wait` raises :class:`CollectiveError`, no tensor is
    written, and the handle stays failed: every later :meth:`wait` raises the same
    error and :meth:`is_completed` stays ``False``.
    """

    def __init__(self, staged: Sequence[tuple[_BucketInFlight, _Progress]] = ()) -> None:
        self._flights = list(staged)
        self._error: CollectiveError | None = None
        self._inference_mode = torch.is_inference_mode_enabled()  # the results are written back in the call's mode

    @classmethod
    def merged(cls, handles: Sequence["CollectiveHandle"]) -> "CollectiveHandle":
        """One handle for ``handles``' collectives, all or nothing together (the
        handles given are not to be waited on themselves)."""
        return cls([item for handle in handles for item in handle._flights])

    def is_completed(self) -> bool:
        """True once :meth:`wait` has returned normally (every result written)."""
        return self._error is None and not self._flights

    @property
    def error(self) -> CollectiveError | None:
        """The error a failed :meth:`wait` raised (``None`` while none did)."""
        return self._error

    def wait(self) -> None:
        """Wait for every collective, then write every result back (in the inference
        mode the collectives were started in) — or, if one failed, write nothing and
        raise :class:`CollectiveError` (again on every call). Should writing a result
        back fail, the error says which buckets were written."""
        if self._error is not None:
            raise self._error
        for flight, progress in self._flights:
            try:
                flight.wait()
            except Exception as cause:  # noqa: BLE001 - the backend's error, re-raised with what it left
                self._error = progress.error(flight.position, cause)
                raise self._error from cause
        # in the inference mode the run started in (inference tensors are written only in it), switched only
        # where it differs (leaving it turns grad mode on)
        mode = self._inference_mode
        with contextlib.nullcontext() if mode == torch.is_inference_mode_enabled() else torch.inference_mode(mode):
            for flight, progress in self._flights:
                try:
                    flight.write_back()
                except Exception as cause:  # noqa: BLE001 - say what was written: the buckets before
                    self._error = progress.error(flight.position, cause)
                    raise self._error from cause
                progress.written()
        self._flights = []


def run_staged(
    tensors: Sequence[torch.Tensor],
    launch: Launch,
    options: StagingOptions,
    *,
    pool: StagingPool,
    async_op: bool,
    layout: Layout | None = None,
    gate: Callable[[], None] | None = None,
) -> CollectiveHandle | None:
    """Issue ``launch`` over the bucket plan of ``tensors``, in order, with the
    semantics of the module docstring.

    Args:
        tensors: checked tensors (dense, real, disjoint), the same layouts on every rank.
        launch: starts one bucket's asynchronous collective.
        options: the buckets' size, and what is done with each (:class:`StagingOptions`).
        pool: the staging memory.
        async_op: return a handle instead of blocking.
        layout: their :class:`~puredist._layout.Layout`, which keeps the plan (``None``:
            looked up).
        gate: called once the first bucket is packed, before any collective starts
            (the rank check's second half: its round trip overlaps the packing). What
            it raises propagates as it is: nothing was sent or written. Should
            anything fail before (the plan, the staging memory, the first packing), the
            gate is called first and its error wins: a rank check left unfinished would
            leave the peers waiting in it.

    Returns:
        ``None``, or the :class:`CollectiveHandle` when ``async_op``.

    Raises:
        CollectiveError: (blocking runs) a collective failed; the error says which
            elements hold the result.
    """
    run = (_Run if async_op else _BlockingRun)(tensors, launch, options, pool, gate)
    try:
        layout = layout if layout is not None else layout_of(tensors)
        cap, alone_from = options.bucket_cap_bytes, options.alone_from
        caps = cap if cap is not None else pool.policy
        buckets = layout.derived(("buckets", caps, alone_from), lambda: _planned(tensors, cap, alone_from, pool))
        if async_op:
            return run.handle(buckets)
        needed = layout.derived(("staging bytes", caps, alone_from), lambda: staging_bytes(buckets))
        run.complete(buckets, {device: pool.reserve(nbytes, device) for device, nbytes in needed.items()})
        return None
    except Exception:  # (not an interrupt: the check may wait for its peers)
        run.pass_gate()  # (the check's own error, if any, wins)
        raise


def _planned(tensors: Sequence[torch.Tensor], bucket_cap_bytes: int | None, alone_from: int | None,
             pool: StagingPool) -> tuple[BucketLayout, ...]:
    """The buckets of ``tensors``: half of ``bucket_cap_bytes`` each (else half of the
    pool's capacity on their device), with their layouts."""
    def bucket_bytes(device: torch.device) -> int:
        return max(1, (bucket_cap_bytes if bucket_cap_bytes is not None else pool.capacity(device)) // 2)

    return bucket_layouts(tensors, plan_buckets(tensors, bucket_bytes, alone_from=alone_from))


class _Run:
    """One asynchronous call of :func:`run_staged`: the gate until it is passed, and
    each bucket packed into a buffer of its own and started; base of
    :class:`_BlockingRun`."""

    def __init__(self, tensors: Sequence[torch.Tensor], launch: Launch, options: StagingOptions, pool: StagingPool,
                 gate: Callable[[], None] | None) -> None:
        self.tensors = tensors
        self.launch = launch
        self.options = options
        self.pool = pool
        self.progress: _Progress | None = None  # (set once the buckets are known)
        self._gate = gate

    def pass_gate(self) -> None:
        """Call the gate unless it was called (what it raises propagates as it is:
        nothing was sent)."""
        gate, self._gate = self._gate, None
        if gate is not None:
            gate()

    def failed(self, position: int, cause: BaseException) -> CollectiveError:
        """The error for a failure at bucket ``position``, saying what was written."""
        return self.progress.error(position, cause)

    def start(self, bucket: BucketLayout, staging: Callable) -> _BucketInFlight:
        """``bucket`` packed (the gate passed after the first) and its collective started."""
        try:
            flight = _BucketInFlight(bucket, self.tensors, staging, self.options)
        except Exception as cause:  # noqa: BLE001 - packing failed: say what was left
            raise self.failed(bucket.position, cause) from cause
        try:
            self.pass_gate()
        except BaseException:
            flight.discard()
            raise
        try:
            flight.start(self.launch)
        except Exception as cause:  # noqa: BLE001 - launching failed: say what was left
            raise self.failed(bucket.position, cause) from cause
        return flight

    def handle(self, buckets: Sequence[BucketLayout]) -> CollectiveHandle:
        """Every bucket started, each in a buffer :meth:`StagingPool.take` gives."""
        self.progress = _Progress(buckets, self.tensors, self.options.what)
        launched = [(self.start(bucket, functools.partial(self.pool.take, bucket)), self.progress)
                    for bucket in buckets]
        self.pass_gate()  # (no bucket: nothing to send)
        return CollectiveHandle(launched)


class _BlockingRun(_Run):
    """One blocking call of :func:`run_staged`: buckets placed in the pool's ring in
    plan order, each written back as soon as its collective is done."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.pending: deque[tuple[_BucketInFlight, tuple[torch.device, int, int]]] = deque()

    def failed(self, position: int, cause: BaseException) -> CollectiveError:
        self.pool.abandon()  # collectives still in flight may write into it
        return super().failed(position, cause)

    def finish_oldest(self) -> None:
        """Wait for the oldest bucket in flight and write it back."""
        flight, _ = self.pending.popleft()
        try:
            flight.wait()
            flight.write_back()
        except Exception as cause:  # noqa: BLE001 - re-raised with what was left
            raise self.failed(flight.position, cause) from cause
        self.progress.written()

    def complete(self, buckets: Sequence[BucketLayout], room: Mapping[torch.device, int]) -> None:
        """Run every bucket, with ``room[device]`` bytes of the pool's ring on its device."""
        self.progress = _Progress(buckets, self.tensors, self.options.what)
        for bucket in buckets:
            nbytes = bucket.planned.nbytes
            oversized = nbytes > room[bucket.device]  # one non-contiguous tensor larger than the cap
            while True:  # wait for room: in the pool, or (oversized) for everything in flight
                offset = None if oversized else self.pool.place(nbytes, bucket.device, [r for _, r in self.pending])
                if offset is not None or (oversized and not self.pending):
                    break
                self.finish_oldest()
            if oversized:
                staging, region = functools.partial(fresh_buffer, bucket), (bucket.device, 0, 0)
            else:
                staging = functools.partial(self._ring, bucket, offset)
                region = (bucket.device, offset, offset + nbytes)
            self.pending.append((self.start(bucket, staging), region))
        self.pass_gate()
        while self.pending:
            self.finish_oldest()

    def _ring(self, bucket: BucketLayout, offset: int) -> tuple[torch.Tensor, list[torch.Tensor], None]:
        """The pool's ring buffer at ``offset`` for ``bucket`` (nothing to release)."""
        return (*self.pool.staged(bucket, offset), None)
