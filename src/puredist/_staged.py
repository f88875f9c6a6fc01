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
most ``bucket_cap_bytes`` per device (by default the pool's capacity, see
:func:`default_bucket_cap_bytes`), writing each bucket back as soon as it is done
(the copy into bucket ``k + 1`` overlaps the collective of bucket ``k``). Asynchronous
runs stage every bucket at once and write back only when :meth:`CollectiveHandle.wait`
has seen *every* collective succeed: all or nothing.

This module must not check its inputs or talk to other ranks except through the
``launch`` and the ``gate`` it is given: callers pass checked tensors and have run the
rank check, or finish it in the gate.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Callable, Mapping, NamedTuple, Sequence

import torch

from puredist._buckets import Bucket, plan_buckets
from puredist._layout import Layout, layout_of

_ALIGN = 64  # bytes: every buffer in the pool starts on a cache line (and any dtype's alignment)

Launch = Callable[[torch.Tensor], object]
"""Starts the asynchronous collective on a staging buffer; returns its ``Work``."""

Scales = Callable[[torch.Tensor], "tuple[int | None, int | None]"]
"""``staging buffer -> (before, after)``: the divisions around a bucket's collective
(they depend on its dtype and device)."""


HOST_BUCKET_CAP_BYTES = 32 * 2**20
"""The default staging memory for host tensors: 32 MiB."""

DEVICE_BUCKET_CAP_BYTES = 256 * 2**20
"""The default staging memory for tensors that go over NCCL: 256 MiB. There each
collective's launch costs tens of microseconds of host time (about 60 us per NCCL
all-reduce measured with torch 2.11 on an H100, where a copy moves 3 TB/s), so a
few large buckets keep the host ahead of the device: 30M fp32 parameters travel in one
bucket, 137M in five. (Gloo moves a GPU's tensors through host copies: smaller buckets
let the copies of one overlap the reduction of another.)"""


def default_bucket_cap_bytes(backend: str | None) -> int:
    """The staging memory for the tensors that ``backend`` reduces when none is given:
    :data:`DEVICE_BUCKET_CAP_BYTES` for NCCL, :data:`HOST_BUCKET_CAP_BYTES` otherwise."""
    return DEVICE_BUCKET_CAP_BYTES if backend == "nccl" else HOST_BUCKET_CAP_BYTES


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

    def __init__(self, what: str, completed_elements: Sequence[int], totals: Sequence[int], failed_bucket: int | None,
                 buckets: int, cause: BaseException, *, stage: str = "the rank check",
                 advice: str = "The process group may be broken; retrying on a working group is safe."):
        self.completed_elements = tuple(completed_elements)
        self.failed_bucket = failed_bucket
        self.buckets = buckets
        self.state = None
        where = f"in {stage}" if failed_bucket is None else f"in bucket {failed_bucket + 1} of {buckets}"
        super().__init__(
            f"{what} failed {where} ({type(cause).__name__}: "
            f"{str(cause).strip().splitlines()[0] if str(cause).strip() else ''}). No tensor holds a partial "
            f"result: {_progress(self.completed_elements, totals)}. {advice}"
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


def nothing_changed(tensors: Sequence[torch.Tensor], what: str, cause: BaseException, *,
                    stage: str = "the rank check") -> CollectiveError:
    """The error for a collective that failed with nothing written: before any bucket
    (the rank check), or at another ``stage`` that writes only once it has succeeded
    (a torchft step's quorum, all-reduce or vote)."""
    return CollectiveError(what, [0] * len(tensors), [t.numel() for t in tensors], None, 0, cause, stage=stage)


class BucketSpec(NamedTuple):
    """One bucket of a plan, with what its runs need, derived once per layout.

    Attributes:
        position: the bucket's index in the plan.
        bucket: its pieces and size.
        device, dtype: of every piece (a bucket holds one of each).
        numels, shapes: of each piece's staging view (a whole tensor's shape; a cut
            piece is flat).
        cuts: ``(position in the bucket, tensor index, start, stop)`` of the pieces
            that are cut out of a tensor (at most the first and the last).
        indices: each piece's tensor index, in buffer order.
        divides_into_targets: a division after the collective writes its quotient
            straight into the targets (one pass over the bytes instead of two) rather
            than dividing the buffer and copying it (one kernel per bucket instead of
            one per piece): for pieces of :data:`_FOLD_BYTES` or more on average,
            where the bytes cost more than the launches.
    """

    position: int
    bucket: Bucket
    device: torch.device
    dtype: torch.dtype
    numels: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    cuts: tuple[tuple[int, int, int, int], ...]
    divides_into_targets: bool
    indices: tuple[int, ...]

    def targets(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors (or flat ranges of them) this bucket's pieces are, in buffer order."""
        targets = list(map(tensors.__getitem__, self.indices))  # (in C: no Python work per piece)
        for k, index, start, stop in self.cuts:
            targets[k] = targets[k].detach().view(-1)[start:stop]
        return targets

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Views of a staging ``buffer`` shaped like the targets (written under ``no_grad``)."""
        with torch.no_grad():
            return [flat.view(shape) for flat, shape in zip(buffer.split(self.numels), self.shapes)]


def bucket_specs(tensors: Sequence[torch.Tensor], plan: Sequence[Bucket]) -> tuple[BucketSpec, ...]:
    """The :class:`BucketSpec` of each bucket of ``plan`` over ``tensors``."""
    specs = []
    for position, bucket in enumerate(plan):
        first = tensors[bucket.pieces[0].index]
        numels, shapes, cuts = [], [], []
        for k, piece in enumerate(bucket.pieces):
            tensor = tensors[piece.index]
            whole = piece.start == 0 and piece.stop == tensor.numel()
            numels.append(piece.stop - piece.start)
            shapes.append(tuple(tensor.shape) if whole else (piece.stop - piece.start,))
            if not whole:
                cuts.append((k, piece.index, piece.start, piece.stop))
        folds = bucket.nbytes >= _FOLD_BYTES * len(bucket.pieces)
        specs.append(BucketSpec(position, bucket, first.device, first.dtype, tuple(numels), tuple(shapes), tuple(cuts),
                                folds, tuple(piece.index for piece in bucket.pieces)))
    return tuple(specs)


class _Bucket:
    """One bucket's staging buffer, its collective, and how to write it back: packed
    when made, its collective started by :meth:`start`.

    Args:
        spec: the bucket.
        tensors: the full tensor list the pieces index.
        staging: gives the staging buffer (``spec.bucket.nbytes`` bytes, the tensors'
            dtype), its views and the call that releases it once it is written back
            (not after a failure: the backend may still hold it) or ``None``; not
            called for a bucket sent from the tensor's own storage.
        pack: copy the tensors' values into the buffer first (a broadcast receiver
            does not: the collective only writes it).
        scales: ``scales(buffer) -> (before, after)``: divide the buffer by ``before``
            ahead of the collective and by ``after`` once it is done (``None``: no).
        write_back: copy the result into the tensors (a broadcast source does not).
    """

    def __init__(self, spec: BucketSpec, tensors, staging: Callable[[], tuple[torch.Tensor, list, object]],
                 *, pack: bool, scales: Scales, write_back: bool):
        self.spec = spec
        self._targets = spec.targets(tensors)
        scale_before, self._scale_after = scales(self._targets[0])
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
        return self.spec.position

    def wait(self) -> None:
        """Block until the collective is done (raises what the backend raised)."""
        self._work.wait()

    def write_back(self) -> None:
        """Copy the result into the tensors (divided on the way, or the buffer divided
        first: see :attr:`BucketSpec.divides_into_targets`), then let go of the buffer."""
        if self._write_back:
            with torch.no_grad():
                if self._scale_after is not None and self.spec.divides_into_targets:
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

    def __init__(self, specs: Sequence[BucketSpec], numels: Callable[[], list[int]], what: str) -> None:
        self.specs = specs
        self.numels = numels
        self.what = what
        self.done = 0

    def written(self) -> None:
        self.done += 1

    def error(self, failed_bucket: int | None, cause: BaseException) -> CollectiveError:
        totals = self.numels()
        completed = [0] * len(totals)
        for spec in self.specs[: self.done]:
            for piece in spec.bucket.pieces:
                completed[piece.index] += piece.stop - piece.start
        return CollectiveError(self.what, completed, totals, failed_bucket, len(self.specs), cause)


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
        self._inference_mode = torch.is_inference_mode_enabled()  # the results are written back in the call's mode

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
        """Wait for every collective, then write every result back (in the inference
        mode the collectives were started in) — or, if one failed, write nothing and
        raise :class:`CollectiveError` (again on every call). Should writing a result
        back fail, the error says which buckets were written."""
        if self._error is not None:
            raise self._error
        for bucket, progress in self._staged:
            try:
                bucket.wait()
            except Exception as cause:  # noqa: BLE001 - the backend's error, re-raised with what it left
                self._error = progress.error(bucket.position, cause)
                raise self._error from cause
        # in the inference mode the run started in (inference tensors are written only in it), switched only
        # where it differs (leaving it turns grad mode on)
        mode = self._inference_mode
        with contextlib.nullcontext() if mode == torch.is_inference_mode_enabled() else torch.inference_mode(mode):
            for bucket, progress in self._staged:
                try:
                    bucket.write_back()
                except Exception as cause:  # noqa: BLE001 - say what was written: the buckets before
                    self._error = progress.error(bucket.position, cause)
                    raise self._error from cause
                progress.written()
        self._staged = []


class StagingPool:
    """Staging memory kept between runs (allocating it anew for every call would fault
    its pages in every time). Blocking runs share one buffer per device of at most
    ``capacity`` bytes (``None``: :func:`default_bucket_cap_bytes` of the backend that
    reduces the device's tensors, from ``backends``: ``{device type: backend name}``),
    grown to what a call needs, handed out in issue order as a ring (buckets finish in
    issue order). Asynchronous runs :meth:`take` buffers of their own, given back once
    written back; up to ``capacity`` bytes of those are kept as spares per device. One
    pool serves one thread.

    After a failed run the buffers are dropped (the backend may still hold the failed
    collectives' views of them); the next run allocates new ones.

    On a GPU a run returns before its work is done (NCCL orders the current stream
    after the collective; the host does not wait). Work on one stream runs in order,
    but a run issued on another stream would write a buffer the last run's collective
    may still read: so a buffer handed out on another stream than the one that last
    used it makes the new stream wait for the old one first.
    """

    def __init__(self, capacity: int | None = None, *, backends: Mapping[str, str] | None = None) -> None:
        self._capacity = capacity
        self._backends = dict(backends or {})
        self.policy = (capacity, tuple(sorted(self._backends.items())))  # what decides the caps: a plan's key
        self._memory: dict[torch.device, torch.Tensor] = {}
        self._head: dict[torch.device, int] = {}
        self._spare: dict[tuple[torch.device, int], list[_Spare]] = {}
        self._spare_bytes: dict[torch.device, int] = {}  # per device, each within its capacity
        self._views: dict[tuple[int, int], tuple[BucketSpec, torch.Tensor, list[torch.Tensor]]] = {}
        self._last_stream: dict[torch.device, object] = {}  # a GPU's stream that last used its blocking buffer

    def take(self, spec: BucketSpec) -> tuple[torch.Tensor, list[torch.Tensor], Callable[[], None]]:
        """A buffer for an asynchronous run of ``spec``'s bucket, its views, and the
        call that gives it back once written: a spare one of that size if kept (a fresh
        allocation faults its pages in every time), with the views it had for this
        bucket, else a new one."""
        nbytes = spec.bucket.nbytes
        spares = self._spare.get((spec.device, nbytes))
        if spares:
            self._spare_bytes[spec.device] -= nbytes
            spare = spares.pop()
            _after(spare.stream)
        else:
            spare = _Spare(_staging_memory(nbytes, torch.uint8, spec.device))
        return (*spare.staged(spec), lambda: self._give_back(spare))

    def capacity(self, device: torch.device) -> int:
        """The most staging memory kept on ``device``, in bytes."""
        if self._capacity is not None:
            return _aligned(self._capacity)
        return _aligned(default_bucket_cap_bytes(self._backends.get(device.type)))

    def _give_back(self, spare: "_Spare") -> None:
        """Keep a buffer from :meth:`take` whose collective succeeded, for the next
        asynchronous run, while the spares stay within ``capacity`` bytes."""
        nbytes, device = spare.memory.numel(), spare.memory.device
        spare.stream = _stream_of(device)  # its write-back's
        kept = self._spare_bytes.get(device, 0)
        if kept + nbytes <= self.capacity(device):
            self._spare.setdefault((device, nbytes), []).append(spare)
            self._spare_bytes[device] = kept + nbytes
        else:
            _free_after(spare.memory, spare.stream)

    def reserve(self, nbytes: int, device: torch.device) -> int:
        """Make the buffer on ``device`` hold ``min(nbytes, capacity)`` bytes; return its size."""
        size = min(_aligned(nbytes), self.capacity(device))
        if device not in self._memory or self._memory[device].numel() < size:
            if device in self._memory:
                _free_after(self._memory[device], self._last_stream.get(device))
            self._memory[device] = _staging_memory(size, torch.uint8, device)
            self._views = {}
        else:
            _after(self._last_stream.get(device))
        self._last_stream[device] = _stream_of(device)
        self._head[device] = 0  # a blocking run starts when the last one has finished: it starts the ring anew
        return self._memory[device].numel()

    def abandon(self) -> None:
        """Forget the buffers (a failed run's collectives may still write into them)."""
        for device, memory in self._memory.items():
            _free_after(memory, self._last_stream.get(device))
        self._memory, self._head, self._views = {}, {}, {}

    def staged(self, spec: BucketSpec, offset: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The buffer at ``offset`` for ``spec``'s bucket and its views shaped like the
        bucket's targets: made at the first run of a layout, then reused (a blocking
        run places the same plan at the same offsets every time)."""
        cached = self._views.get((id(spec), offset))
        if cached is not None and cached[0] is spec:
            return cached[1], cached[2]
        buffer = self.buffer(spec.device, offset, spec.bucket.nbytes, spec.dtype)
        views = spec.views(buffer)
        if len(self._views) >= _MAX_CACHED_VIEWS:
            self._views = {}
        self._views[(id(spec), offset)] = (spec, buffer, views)
        return buffer, views

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


def _staging_memory(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new staging buffer: never an inference tensor (made inside inference mode it
    would be one, which torch lets no one write outside it, where the buffer is
    reused or its results written back)."""
    with torch.inference_mode(False):
        return torch.empty(numel, dtype=dtype, device=device)


def _stream_of(device: torch.device):
    """The current CUDA stream of ``device`` (``None`` elsewhere: host work is in order)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _free_after(memory: torch.Tensor, stream) -> None:
    """Let go of ``memory``, last used on ``stream``: torch's caching allocator then
    hands it out again only once ``stream``'s work so far is done (it would otherwise
    at once, on the stream it was allocated on). Nothing where ``stream`` is ``None``."""
    if stream is not None:
        memory.record_stream(stream)


def _after(stream) -> None:
    """Make the current stream of ``stream``'s device wait for ``stream``'s work so far
    (nothing where it is ``None`` or the current one)."""
    if stream is not None:
        current = torch.cuda.current_stream(stream.device)
        if current != stream:
            current.wait_stream(stream)


class _Spare:
    """The staging memory of an asynchronous run, kept with its views per bucket and
    the stream that last wrote from it."""

    __slots__ = ("memory", "stream", "_views")

    def __init__(self, memory: torch.Tensor) -> None:
        self.memory = memory
        self.stream = None
        self._views: dict[int, tuple[BucketSpec, torch.Tensor, list[torch.Tensor]]] = {}

    def staged(self, spec: BucketSpec) -> tuple[torch.Tensor, list[torch.Tensor]]:
        cached = self._views.get(id(spec))
        if cached is None or cached[0] is not spec:
            buffer = self.memory.view(spec.dtype)
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views = {}
            cached = self._views[id(spec)] = (spec, buffer, spec.views(buffer))
        return cached[1], cached[2]


_FOLD_BYTES = 1 << 18
"""Average piece size from which a bucket divides into its targets (256 KiB: a pass
over them costs more than a kernel launch per piece on any device)."""

_MAX_CACHED_VIEWS = 4096
"""Buckets whose staging views a pool keeps (the spec is kept with them, so its id stays its own)."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def run_staged(
    tensors: Sequence[torch.Tensor],
    bucket_cap_bytes: int | None,
    launch: Launch,
    *,
    layout: Layout | None = None,
    what: str,
    async_op: bool,
    pack: bool,
    pool: StagingPool,
    scales: Scales = no_scaling,
    write_back: bool = True,
    alone_from: int | None = None,
    gate: Callable[[], None] | None = None,
) -> CollectiveHandle | None:
    """Issue ``launch`` over the bucket plan of ``tensors`` (buckets of half of
    ``bucket_cap_bytes``), in order, with the semantics of the module docstring.

    Args:
        tensors: checked tensors (dense, real, disjoint), the same layouts on every rank.
        bucket_cap_bytes: the staging memory of a blocking run, per device (``None``:
            the pool's capacity for each).
        launch: starts one bucket's asynchronous collective.
        layout: their :class:`~puredist._layout.Layout`, which keeps the plan (``None``:
            looked up).
        what: the operation, for errors.
        async_op: return a handle instead of blocking.
        pool: the staging memory.
        pack, scales, write_back: see :class:`_Bucket`. A bucket that is one contiguous
            piece, packed and not written back (a broadcast source), is sent from the
            tensor's own storage.
        alone_from: see :func:`~puredist._buckets.plan_buckets`.
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
    gates = [gate] if gate is not None else []
    try:
        return _run_staged(tensors, bucket_cap_bytes, launch, layout, what, async_op, pack, pool, scales,
                           write_back, alone_from, gates)
    except Exception:  # (not an interrupt: the check may wait for its peers)
        if gates:
            gates.pop()()  # (the check's own error, if any, wins)
        raise


def _run_staged(tensors, bucket_cap_bytes, launch, layout, what, async_op, pack, pool, scales, write_back,
                alone_from, gates: list[Callable[[], None]]) -> CollectiveHandle | None:
    """:func:`run_staged`'s body; ``gates`` holds the gate until it is passed."""
    def bucket_bytes(device: torch.device) -> int:
        return max(1, (bucket_cap_bytes if bucket_cap_bytes is not None else pool.capacity(device)) // 2)

    caps = bucket_cap_bytes if bucket_cap_bytes is not None else pool.policy
    layout = layout if layout is not None else layout_of(tensors)
    specs = layout.derived(
        ("buckets", caps, alone_from),
        lambda: bucket_specs(tensors, plan_buckets(tensors, bucket_bytes, alone_from=alone_from)),
    )
    progress = _Progress(specs, lambda: [t.numel() for t in tensors], what)

    def through_gate() -> None:
        if gates:
            gates.pop()()  # (raises as it is: nothing was sent)

    def started(spec: BucketSpec, staging: Callable, failed: Callable[[int, BaseException], CollectiveError]) -> _Bucket:
        """``spec``'s bucket packed (the gate passed after the first) and its collective started."""
        try:
            bucket = _Bucket(spec, tensors, staging, pack=pack, scales=scales, write_back=write_back)
        except Exception as cause:  # noqa: BLE001 - packing failed: say what was left
            raise failed(spec.position, cause) from cause
        try:
            through_gate()
        except BaseException:
            bucket.discard()
            raise
        try:
            bucket.start(launch)
        except Exception as cause:  # noqa: BLE001 - launching failed: say what was left
            raise failed(spec.position, cause) from cause
        return bucket

    if async_op:
        launched = [(started(spec, lambda spec=spec: pool.take(spec), progress.error), progress) for spec in specs]
        through_gate()  # (no bucket: nothing to send)
        return CollectiveHandle(launched)
    needed = layout.derived(("staging bytes", caps, alone_from), lambda: _staging_bytes(specs))
    room = {device: pool.reserve(nbytes, device) for device, nbytes in needed.items()}
    pending: deque[tuple[_Bucket, tuple[torch.device, int, int]]] = deque()

    def failed(position: int, cause: BaseException) -> CollectiveError:
        pool.abandon()  # collectives still in flight may write into it
        return progress.error(position, cause)

    def finish_oldest() -> None:
        bucket, _ = pending.popleft()
        try:
            bucket.wait()
            bucket.write_back()
        except Exception as cause:  # noqa: BLE001 - re-raised with what was left
            raise failed(bucket.position, cause) from cause
        progress.written()

    for spec in specs:
        nbytes = spec.bucket.nbytes
        oversized = nbytes > room[spec.device]  # one non-contiguous tensor larger than the cap
        while True:  # wait for room: in the pool, or (oversized) for everything in flight
            offset = None if oversized else pool.place(nbytes, spec.device, [r for _, r in pending])
            if offset is not None or (oversized and not pending):
                break
            finish_oldest()
        if oversized:
            take, region = (lambda spec=spec: _fresh_buffer(spec)), (spec.device, 0, 0)
        else:
            take = lambda spec=spec, offset=offset: (*pool.staged(spec, offset), None)  # noqa: E731
            region = (spec.device, offset, offset + nbytes)
        pending.append((started(spec, take, failed), region))
    through_gate()
    while pending:
        finish_oldest()
    return None


def _staging_bytes(specs: Sequence[BucketSpec]) -> dict[torch.device, int]:
    """The staging memory per device that a blocking run of ``specs`` would use at most."""
    needed: dict[torch.device, int] = {}
    for spec in specs:
        needed[spec.device] = needed.get(spec.device, 0) + _aligned(spec.bucket.nbytes)
    return needed


def _fresh_buffer(spec: BucketSpec) -> tuple[torch.Tensor, list[torch.Tensor], None]:
    buffer = _staging_memory(spec.bucket.nbytes // spec.dtype.itemsize, spec.dtype, spec.device)
    return buffer, spec.views(buffer), None
