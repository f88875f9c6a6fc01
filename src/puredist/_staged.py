"""Run one collective per bucket over staging buffers: bounded memory, and no tensor
ever holds a partial result.

Each bucket of the plan (:mod:`puredist._buckets`) is copied into a staging buffer
(the *pack*), the collective runs on the buffer, and only once it has succeeded is
the result copied back into the tensors (the *write-back*). If a collective fails —
a peer died or froze, a timeout, an error in the backend — the tensors of that bucket
and of every later one are left untouched, and those of earlier buckets hold their
result: every element holds its value from before the call or its result, and
:class:`CollectiveError` says which.

Blocking runs (:func:`run_staged` without ``async_op``) reuse one staging pool of at
most ``bucket_cap_bytes`` per device, writing each bucket back as soon as it is done
(the copy into bucket ``k + 1`` overlaps the collective of bucket ``k``). Asynchronous
runs stage every bucket at once and write back only when :meth:`CollectiveHandle.wait`
has seen *every* collective succeed: all or nothing.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

import torch

from puredist._buckets import Bucket, plan_buckets

_ALIGN = 64  # bytes: every buffer in the pool starts on a cache line (and any dtype's alignment)

Launch = Callable[[torch.Tensor], object]
"""Starts the asynchronous collective on a staging buffer; returns its ``Work``."""

Scales = Callable[[torch.Tensor], "tuple[int | None, int | None]"]
"""``staging buffer -> (before, after)``: the divisions around a bucket's collective
(they depend on its dtype and device)."""


def no_scaling(buffer: torch.Tensor) -> tuple[None, None]:
    """:data:`Scales` of a collective that does not divide (a broadcast)."""
    return None, None


class CollectiveError(RuntimeError):
    """A collective failed part-way; no tensor holds a partial result.

    Attributes:
        completed_elements: for each tensor passed (in order), how many of its leading
            elements (in flat, row-major order; complex tensors counted in real
            components) hold the result; the others hold their values from before the
            call. All zeros: nothing changed.
        failed_bucket: the index of the bucket whose collective failed (``None``: the
            rank check before any bucket failed).
        buckets: how many buckets the call had.
        state: set by :func:`~puredist.outer_optimizer`'s ``update_`` when its
            lower-level averaging fails after the outer step was applied: the state
            to continue from.
    """

    def __init__(self, what: str, completed_elements: Sequence[int], totals: Sequence[int], failed_bucket: int | None, buckets: int, cause: BaseException):
        self.completed_elements = tuple(completed_elements)
        self.failed_bucket = failed_bucket
        self.buckets = buckets
        self.state = None
        where = "in the rank check" if failed_bucket is None else f"in bucket {failed_bucket + 1} of {buckets}"
        super().__init__(
            f"{what} failed {where} ({type(cause).__name__}: "
            f"{str(cause).strip().splitlines()[0] if str(cause).strip() else ''}). No tensor holds a partial "
            f"result: {_progress(self.completed_elements, totals)}. The process group may be broken; "
            "retrying on a working group is safe."
        )


def _ranges(positions: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for position in positions:
        if runs and runs[-1][1] == position - 1:
            runs[-1][1] = position
        else:
            runs.append([position, position])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _progress(completed: Sequence[int], totals: Sequence[int]) -> str:
    done = [i for i, (c, n) in enumerate(zip(completed, totals)) if c == n and n > 0]
    untouched = [i for i, c in enumerate(completed) if c == 0 and totals[i] > 0]
    parts = []
    if done:
        parts.append(f"tensors [{_ranges(done)}] hold the result")
    if untouched:
        parts.append(f"tensors [{_ranges(untouched)}] their values from before the call")
    parts += [
        f"tensor {i} the result in elements [0, {c}) and its old values after"
        for i, (c, n) in enumerate(zip(completed, totals)) if 0 < c < n
    ]
    return "; ".join(parts) if parts else "there was nothing to change"


def nothing_changed(tensors: Sequence[torch.Tensor], what: str, cause: BaseException) -> CollectiveError:
    """The error for a collective that failed before any bucket (the rank check)."""
    return CollectiveError(what, [0] * len(tensors), [t.numel() for t in tensors], None, 0, cause)


class _Bucket:
    """One bucket's staging buffer, its collective, and how to write it back.

    Args:
        position: the bucket's index in the plan.
        bucket: the pieces the buffer holds.
        tensors: the full tensor list the pieces index.
        staging: gives the staging buffer (``bucket.nbytes`` bytes, the tensors'
            dtype); not called for a bucket sent from the tensor's own storage.
        launch: starts the collective on the buffer.
        pack: copy the tensors' values into the buffer first (a broadcast receiver
            does not: the collective only writes it).
        scales: ``scales(buffer) -> (before, after)``: divide the buffer by ``before``
            ahead of the collective and by ``after`` once it is done (``None``: no).
        write_back: copy the result into the tensors (a broadcast source does not).
        release: called with the staging buffer once it is written back (not after a
            failure: the backend may still hold it).
    """

    def __init__(self, position: int, bucket: Bucket, tensors, staging: Callable[[], torch.Tensor], launch: Launch, *, pack: bool, scales: Scales, write_back: bool, release=None):
        self.position = position
        self.bucket = bucket
        self._targets = [_piece_of(tensors[p.index], p) for p in bucket.pieces]
        scale_before, self._scale_after = scales(self._targets[0])
        self._write_back = write_back
        self._release = release
        self._staging = None
        if pack and not write_back and scale_before is None and len(self._targets) == 1 and self._targets[0].is_contiguous():
            buffer, pack = self._targets[0].view(-1), False  # a source only reads: send from its own storage
        else:
            buffer = self._staging = staging()
        self._views = [view.view(target.shape) for view, target in zip(buffer.split([t.numel() for t in self._targets]), self._targets)]
        self._buffer = buffer
        if pack:
            torch._foreach_copy_(self._views, self._targets)
            if scale_before is not None:
                buffer.div_(scale_before)
        self._work = launch(buffer)

    def wait(self) -> None:
        """Block until the collective is done (raises what the backend raised)."""
        self._work.wait()

    def write_back(self) -> None:
        """Copy the result into the tensors (dividing on the way), then let go of
        the buffer."""
        if self._write_back and self._scale_after is not None:
            for target, view in zip(self._targets, self._views):
                torch.div(view, self._scale_after, out=target)
        elif self._write_back:
            torch._foreach_copy_(self._targets, self._views)
        if self._release is not None and self._staging is not None:
            self._release(self._staging)
        self._buffer = self._views = self._work = self._staging = None


def _piece_of(tensor: torch.Tensor, piece) -> torch.Tensor:
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        return tensor  # never cut: the piece is the whole tensor
    return tensor.view(-1)[piece.start : piece.stop]


class _Progress:
    """How many leading elements of each tensor hold the result so far."""

    def __init__(self, tensors: Sequence[torch.Tensor], what: str, buckets: int) -> None:
        self.totals = [t.numel() for t in tensors]
        self.completed = [0] * len(tensors)
        self.what = what
        self.buckets = buckets

    def written(self, bucket: Bucket) -> None:
        for piece in bucket.pieces:
            self.completed[piece.index] += piece.stop - piece.start

    def error(self, failed_bucket: int | None, cause: BaseException) -> CollectiveError:
        return CollectiveError(self.what, self.completed, self.totals, failed_bucket, self.buckets, cause)


class CollectiveHandle:
    """Collectives in flight; :meth:`wait` completes them all or writes nothing.

    The tensors must not be read or written until :meth:`wait` returns. If any of the
    collectives failed, :meth:`wait` raises :class:`CollectiveError`, no tensor is
    written, and the handle stays failed: every later :meth:`wait` raises the same
    error and :meth:`is_completed` stays ``False``.
    """

    def __init__(self, staged: Sequence[tuple[_Bucket, _Progress]] = ()) -> None:
        self._staged = list(staged)
        self._error: CollectiveError | None = None

    @classmethod
    def merged(cls, handles: Sequence["CollectiveHandle"]) -> "CollectiveHandle":
        """One handle for ``handles``' collectives, all or nothing together (the
        handles given are not to be waited on themselves)."""
        return cls([item for handle in handles for item in handle._staged])

    def is_completed(self) -> bool:
        """True once :meth:`wait` has returned normally (every result written)."""
        return self._error is None and not self._staged

    @property
    def error(self) -> CollectiveError | None:
        """The error a failed :meth:`wait` raised (``None`` while none did)."""
        return self._error

    def wait(self) -> None:
        """Wait for every collective, then write every result back — or, if one
        failed, write nothing and raise :class:`CollectiveError` (again on every call)."""
        if self._error is not None:
            raise self._error
        for bucket, progress in self._staged:
            try:
                bucket.wait()
            except Exception as cause:  # noqa: BLE001 - the backend's error, re-raised with what it left
                self._error = progress.error(bucket.position, cause)
                raise self._error from cause
        for bucket, progress in self._staged:
            bucket.write_back()
            progress.written(bucket.bucket)
        self._staged = []


class StagingPool:
    """Staging memory kept between runs (allocating it anew for every call would fault
    its pages in every time). Blocking runs share one buffer per device of at most
    ``capacity`` bytes, grown to what a call needs, handed out in issue order as a
    ring (buckets finish in issue order). Asynchronous runs :meth:`take` buffers of
    their own and :meth:`give_back` them once written back; up to ``capacity`` bytes of
    those are kept as spares. One pool serves one thread.

    After a failed run the buffers are dropped (the backend may still hold the failed
    collectives' views of them); the next run allocates new ones.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = _aligned(capacity)
        self._memory: dict[torch.device, torch.Tensor] = {}
        self._head: dict[torch.device, int] = {}
        self._spare: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
        self._spare_bytes = 0

    def take(self, nbytes: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """A buffer for an asynchronous run: a spare one of that size if kept (a fresh
        allocation faults its pages in every time), else a new one."""
        spares = self._spare.get((device, nbytes))
        if spares:
            self._spare_bytes -= nbytes
            return spares.pop().view(dtype)
        return torch.empty(nbytes, dtype=torch.uint8, device=device).view(dtype)

    def give_back(self, buffer: torch.Tensor) -> None:
        """Keep a buffer from :meth:`take` whose collective succeeded, for the next
        asynchronous run, while the spares stay within ``capacity`` bytes."""
        nbytes = buffer.numel() * buffer.element_size()
        if self._spare_bytes + nbytes <= self.capacity:
            self._spare.setdefault((buffer.device, nbytes), []).append(buffer.view(torch.uint8))
            self._spare_bytes += nbytes

    def reserve(self, nbytes: int, device: torch.device) -> int:
        """Make the buffer on ``device`` hold ``min(nbytes, capacity)`` bytes; return its size."""
        size = min(_aligned(nbytes), self.capacity)
        if device not in self._memory or self._memory[device].numel() < size:
            self._memory[device] = torch.empty(size, dtype=torch.uint8, device=device)
            self._head[device] = 0
        return self._memory[device].numel()

    def abandon(self) -> None:
        """Forget the buffers (a failed run's collectives may still write into them)."""
        self._memory, self._head = {}, {}

    def place(self, nbytes: int, device: torch.device, busy: Sequence[tuple[torch.device, int, int]]) -> int | None:
        """The offset where ``nbytes`` fits on ``device`` without overlapping ``busy``
        regions, or ``None`` until some of them are released."""
        size = self._memory[device].numel()
        head = self._head[device]
        offset = head if head + nbytes <= size else 0
        if any(d == device and offset < end and start < offset + nbytes for d, start, end in busy):
            return None
        self._head[device] = _aligned(offset + nbytes)
        return offset

    def buffer(self, device: torch.device, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self._memory[device][offset : offset + nbytes].view(dtype)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def run_staged(
    tensors: Sequence[torch.Tensor],
    bucket_cap_bytes: int,
    launch: Launch,
    *,
    what: str,
    async_op: bool,
    pack: bool,
    pool: StagingPool,
    scales: Scales = no_scaling,
    write_back: bool = True,
    alone_from: int | None = None,
) -> CollectiveHandle | None:
    """Issue ``launch`` over the bucket plan of ``tensors`` (buckets of half of
    ``bucket_cap_bytes``), in order, with the semantics of the module docstring.

    Args:
        tensors: checked tensors (dense, real, disjoint), the same layouts on every rank.
        bucket_cap_bytes: the staging memory of a blocking run.
        launch: starts one bucket's asynchronous collective.
        what: the operation, for errors.
        async_op: return a handle instead of blocking.
        pool: the staging memory.
        pack, scales, write_back: see :class:`_Bucket`. A bucket that is one contiguous
            piece, packed and not written back (a broadcast source), is sent from the
            tensor's own storage.
        alone_from: see :func:`~puredist._buckets.plan_buckets`.

    Returns:
        ``None``, or the :class:`CollectiveHandle` when ``async_op``.

    Raises:
        CollectiveError: (blocking runs) a collective failed; the error says which
            elements hold the result.
    """
    plan = plan_buckets(tensors, max(1, bucket_cap_bytes // 2), alone_from=alone_from)
    progress = _Progress(tensors, what, len(plan))
    options = dict(pack=pack, scales=scales, write_back=write_back)

    def staged(position: int, staging: Callable[[], torch.Tensor], release=None) -> _Bucket:
        return _Bucket(position, plan[position], tensors, staging, launch, **options, release=release)

    if async_op:
        launched: list[tuple[_Bucket, _Progress]] = []
        for position, bucket in enumerate(plan):
            first = tensors[bucket.pieces[0].index]
            take = lambda b=bucket, t=first: pool.take(b.nbytes, t.device, t.dtype)  # noqa: E731
            try:
                launched.append((staged(position, take, pool.give_back), progress))
            except Exception as cause:  # noqa: BLE001 - nothing was written: say so
                raise progress.error(position, cause) from cause
        return CollectiveHandle(launched)
    needed: dict[torch.device, int] = {}
    for bucket in plan:
        device = tensors[bucket.pieces[0].index].device
        needed[device] = needed.get(device, 0) + _aligned(bucket.nbytes)
    room = {device: pool.reserve(nbytes, device) for device, nbytes in needed.items()}
    pending: deque[tuple[_Bucket, tuple[torch.device, int, int]]] = deque()

    def failed(position: int, cause: BaseException) -> CollectiveError:
        pool.abandon()  # collectives still in flight may write into it
        return progress.error(position, cause)

    def finish_oldest() -> None:
        bucket, _ = pending.popleft()
        try:
            bucket.wait()
        except Exception as cause:  # noqa: BLE001 - re-raised with what was left
            raise failed(bucket.position, cause) from cause
        bucket.write_back()
        progress.written(bucket.bucket)

    for position, bucket in enumerate(plan):
        first = tensors[bucket.pieces[0].index]
        oversized = bucket.nbytes > room[first.device]  # one non-contiguous tensor larger than the cap
        while True:  # wait for room: in the pool, or (oversized) for everything in flight
            offset = None if oversized else pool.place(bucket.nbytes, first.device, [r for _, r in pending])
            if offset is not None or (oversized and not pending):
                break
            finish_oldest()
        try:
            if oversized:
                take, region = (lambda b=bucket: _fresh_buffer(b, tensors)), (first.device, 0, 0)
            else:
                take = lambda o=offset, b=bucket, t=first: pool.buffer(t.device, o, b.nbytes, t.dtype)  # noqa: E731
                region = (first.device, offset, offset + bucket.nbytes)
            pending.append((staged(position, take), region))
        except Exception as cause:  # noqa: BLE001 - packing or launching failed: say what was left
            raise failed(position, cause) from cause
    while pending:
        finish_oldest()
    return None


def _fresh_buffer(bucket: Bucket, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    first = tensors[bucket.pieces[0].index]
    return torch.empty(bucket.nbytes // first.element_size(), dtype=first.dtype, device=first.device)
