"""Staging memory kept between runs: one bounded buffer per device for blocking runs,
spare buffers for asynchronous ones, and the stream fences that keep a GPU's reused
memory from being written while a collective still reads it.

This module must not plan buckets or communicate: it hands out memory for the
:class:`~puredist.staging.plan.BucketLayout` it is given.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from puredist.staging.plan import BucketLayout

_ALIGN = 64  # bytes: every buffer in the pool starts on a cache line (and any dtype's alignment)

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
        self._views: dict[tuple[int, int], tuple[BucketLayout, torch.Tensor, list[torch.Tensor]]] = {}
        self._last_stream: dict[torch.device, object] = {}  # a GPU's stream that last used its blocking buffer

    def take(self, bucket: BucketLayout) -> tuple[torch.Tensor, list[torch.Tensor], Callable[[], None]]:
        """A buffer for an asynchronous run of ``bucket``, its views, and the
        call that gives it back once written: a spare one of that size if kept (a fresh
        allocation faults its pages in every time), with the views it had for this
        bucket, else a new one."""
        nbytes = bucket.planned.nbytes
        spares = self._spare.get((bucket.device, nbytes))
        if spares:
            self._spare_bytes[bucket.device] -= nbytes
            spare = spares.pop()
            _after(spare.stream)
        else:
            spare = _Spare(_staging_memory(nbytes, torch.uint8, bucket.device))
        return (*spare.staged(bucket), lambda: self._give_back(spare))

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

    def staged(self, bucket: BucketLayout, offset: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The buffer at ``offset`` for ``bucket`` and its views shaped like the
        bucket's targets: made at the first run of a layout, then reused (a blocking
        run places the same plan at the same offsets every time)."""
        cached = self._views.get((id(bucket), offset))
        if cached is not None and cached[0] is bucket:
            return cached[1], cached[2]
        buffer = self.buffer(bucket.device, offset, bucket.planned.nbytes, bucket.dtype)
        views = bucket.views(buffer)
        if len(self._views) >= _MAX_CACHED_VIEWS:
            self._views = {}
        self._views[(id(bucket), offset)] = (bucket, buffer, views)
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
        self._views: dict[int, tuple[BucketLayout, torch.Tensor, list[torch.Tensor]]] = {}

    def staged(self, bucket: BucketLayout) -> tuple[torch.Tensor, list[torch.Tensor]]:
        cached = self._views.get(id(bucket))
        if cached is None or cached[0] is not bucket:
            buffer = self.memory.view(bucket.dtype)
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views = {}
            cached = self._views[id(bucket)] = (bucket, buffer, bucket.views(buffer))
        return cached[1], cached[2]


_MAX_CACHED_VIEWS = 4096
"""Buckets whose staging views a pool keeps (the layout is kept with them, so its id stays its own)."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def fresh_buffer(bucket: BucketLayout) -> tuple[torch.Tensor, list[torch.Tensor], None]:
    """A staging buffer of ``bucket``'s size that no pool keeps, and its views (one
    bucket larger than the pool's capacity: a non-contiguous tensor, never cut)."""
    buffer = _staging_memory(bucket.planned.nbytes // bucket.dtype.itemsize, bucket.dtype, bucket.device)
    return buffer, bucket.views(buffer), None


def staging_bytes(buckets: Sequence[BucketLayout]) -> dict[torch.device, int]:
    """The staging memory per device that a blocking run of ``buckets`` would use at most."""
    needed: dict[torch.device, int] = {}
    for bucket in buckets:
        needed[bucket.device] = needed.get(bucket.device, 0) + _aligned(bucket.planned.nbytes)
    return needed
