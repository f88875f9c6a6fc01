"""Drop-in for ``torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook``.

``hook_with_zero_step`` and ``hook_with_zero_step_interleaved`` wrap a DDP
communication hook (e.g. ``allreduce_hook``) so that the ZeRO step of each bucket
runs during DDP's backward. Differences on purpose:

- They work on Gloo. Every collective (the wrapped hook's all-reduce, the ZeRO
  step's broadcasts) is issued from the training thread, in bucket order, the same
  on every rank: a bucket's step waits for its all-reduce on the training thread,
  never in a future's callback on a backend thread.
- No lost iterations: the plan is fixed when the hook is built, from the bucket
  layout DDP settles on after its first iteration (predicted: gradients ready in
  reverse registration order), so the very first backward already updates. In the
  first iteration DDP uses one bucket for everything, and a model whose gradients
  come in another order gets other buckets: ownership is per parameter, so updates
  stay exact; only "one owner per bucket" is then approximate.
- ``find_unused_parameters=True`` is refused at construction: DDP then leaves the
  ``.grad`` of unused parameters untouched while their bucket slots hold zeros, and
  a step on those zeros would still move them (momentum, weight decay). With
  ``static_graph=True`` a parameter unused on this rank but used on another gets its
  (averaged) ``.grad`` from DDP only at DDP's own end of the backward, after every
  hook ran: the step then runs after it, from the ``.grad`` DDP set, so that exactly
  the parameters the plain optimizer would step are stepped (no interleaving).
- Parameters DDP ignores (``_set_params_and_buffers_to_ignore_for_model``) are
  refused at construction: their gradients never reach the hook.
- ``Join`` is refused with the overlap (DDP's join hook calls the communication hook
  outside any backward pass); the non-overlapped optimizer supports it.

``hook_with_zero_step`` steps every bucket once the backward computation is over, in
one call of the local optimizer (overlapping the outstanding all-reduces and the
broadcasts);
``hook_with_zero_step_interleaved`` steps bucket ``i`` as soon as the hook for bucket
``i + 1`` runs, overlapping the step with the rest of the backward computation.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.
from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from puredist._validation import Rule, check
from puredist.classic.zero_redundancy_optimizer import ZeroRedundancyOptimizer
from puredist.collectives import CollectiveHandle
from puredist.zero_plan import plan_zero, reverse_order_buckets
from puredist.zero_step import wait_for_owners

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]



def _first_bucket_bytes_cap(ddp: DistributedDataParallel) -> int:
    config = getattr(ddp, "_bucket_config", None)  # where recent torch keeps it
    return config.first_bucket_bytes_cap if config is not None else dist._DEFAULT_FIRST_BUCKET_BYTES


def _slot_strides(param: torch.Tensor) -> tuple[int, ...]:
    """The strides of a parameter's gradient in its bucket slot: DDP lays a
    non-overlapping dense parameter's slot out in the parameter's own strides (a
    transposed weight, a channels-last convolution), any other contiguously.
    ``empty_like`` picks the same (fixed when DDP is built, as DDP's buckets are)."""
    return torch.empty_like(param, device="meta").stride()


class _OverlappedIteration:
    """The buckets of one backward: their all-reduce futures, steps and broadcasts."""

    def __init__(self, zero: ZeroRedundancyOptimizer, interleaved: bool, after_ddp: bool) -> None:
        self._zero = zero
        self._interleaved = interleaved
        self._after_ddp = after_ddp
        self._launched: deque[tuple[torch.futures.Future, list[int], list[bool]]] = deque()
        self._broadcasts: list[CollectiveHandle] = []
        self._stepped: list[int] = []  # the parameters of the buckets stepped so far
        self._finish_queued = False
        self._shapes = [(p.shape, _slot_strides(p)) for p in zero._all_params]

    def bucket_launched(self, future: torch.futures.Future, indices: list[int]) -> None:
        if not self._finish_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._finish_queued = True
        # as DDP + a plain optimizer: a parameter without .grad (unused, e.g. with
        # static_graph) is not stepped, though its bucket slot holds zeros
        params = self._zero._all_params
        self._launched.append((future, indices, [params[i].grad is not None for i in indices]))
        while self._interleaved and not self._after_ddp and len(self._launched) > 1:
            self._step(self._launched.popleft())

    def _step(self, *buckets: tuple[torch.futures.Future, list[int], list[bool]]) -> None:
        """Step the parameters of ``buckets`` (each ``(future, indices, has_grad)``)
        with their reduced gradients, in one call of the local optimizer, and start
        their owners' broadcasts."""
        params = self._zero._all_params
        grads: list[torch.Tensor | None] = [None] * len(params)
        stepped: list[int] = []
        for future, indices, has_grad in buckets:
            reduced = future.wait()
            flat = reduced[0] if isinstance(reduced, (list, tuple)) else reduced
            pieces = flat.split([params[i].numel() for i in indices])
            for i, piece, used in zip(indices, pieces, has_grad):
                if used:
                    grads[i] = piece.as_strided(*self._shapes[i], piece.storage_offset())
            stepped.extend(indices)
        self._broadcasts.append(self._zero._step_(grads, stepped))
        self._stepped.extend(stepped)

    def _finish(self) -> None:
        """At the end of the backward: step the buckets left, together (one call of
        the local optimizer, whose fixed cost a GPU's host pays per call; with a
        static graph, after DDP's own end of backward, queued after this callback)."""
        self._finish_queued = False
        if self._after_ddp:
            torch.autograd.Variable._execution_engine.queue_callback(self._step_with_ddps_grads)
            return
        if self._launched:
            self._step(*self._launched)
            self._launched.clear()
        self._end()

    def _step_with_ddps_grads(self) -> None:
        """Step every bucket's parameters with the ``.grad`` DDP left them, as the plain
        optimizer would, and broadcast them."""
        indices = [i for _, bucket, _ in self._launched for i in bucket]
        self._launched.clear()
        self._broadcasts.append(self._zero._step_([p.grad for p in self._zero._all_params], indices))
        self._stepped.extend(indices)
        self._end()

    def _end(self) -> None:
        handle, stepped = CollectiveHandle.merged(self._broadcasts), self._stepped  # received: all or nothing
        self._broadcasts, self._stepped = [], []
        zero = self._zero
        wait_for_owners(handle, zero._all_params, stepped, zero._plan, zero.rank, "A ZeRO step overlapped with DDP")
        zero._end_iteration()


_OVERLAPPED = Rule(lambda v, b: v._overlap_with_ddp, ValueError,  # torch's
                   "ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp=True` to use this hook properly")
_NO_UNUSED = Rule(lambda v, b: not v.find_unused_parameters, ValueError,
                  "The ZeRO overlap hooks do not support DDP(find_unused_parameters=True): DDP leaves unused "
                  "parameters' .grad untouched while their bucket slots hold zeros, so the step cannot tell "
                  "them apart. Use find_unused_parameters=False, or the non-overlapped ZeroRedundancyOptimizer.")
_NOT_IGNORED = Rule(lambda v, b: not v, ValueError,  # v: the names of the parameters ``zero`` holds that DDP ignores
                    "Arg ``{arg}`` optimizes parameters DDP ignores ({names}): their gradients never reach "
                    "the hook, so they would never be stepped. Optimize them with an optimizer of their own.")
_EACH_ONCE = Rule(  # v: the index in ``zero`` of each parameter DDP trains (-1: not in ``zero``), sorted
    lambda v, b: v[:1] != [-1] and len(set(v)) == len(v) and not b["trains_frozen"], ValueError,
    "Arg ``{arg}`` must optimize the parameters of ``ddp`` that require grad, each once (and may hold "
    "parameters that do not).")


def _hook_with_zero(hook, ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer, shard_buckets: bool, interleaved: bool):
    check("zero", zero, _OVERLAPPED)
    check("ddp", ddp, _NO_UNUSED)
    params = zero._all_params
    index_of = {id(p): i for i, p in enumerate(params)}
    ignored = [name for name, p in ddp.module.named_parameters() if name in ddp.parameters_to_ignore
               and p.requires_grad and id(p) in index_of]
    check("zero", ignored, _NOT_IGNORED, names=", ".join(ignored))
    ddp_params = [p for name, p in ddp.module.named_parameters() if p.requires_grad and name not in ddp.parameters_to_ignore]
    trained = sorted(index_of.get(id(p), -1) for p in ddp_params)
    frozen = set(range(len(params))) - set(trained)  # never in DDP's buckets, never stepped (as in torch)
    check("zero", trained, _EACH_ONCE, trains_frozen=any(params[i].requires_grad for i in frozen))
    layout = reverse_order_buckets(
        [p.numel() * p.element_size() for p in ddp_params], ddp.bucket_bytes_cap, _first_bucket_bytes_cap(ddp)
    )
    buckets = [[index_of[id(ddp_params[k])] for k in bucket] for bucket in layout] + ([sorted(frozen)] if frozen else [])
    zero._adopt_plan(
        plan_zero(
            [0 if i in frozen else p.numel() for i, p in enumerate(params)],  # (the frozen ones weigh nothing)
            zero._collective.world_size,
            strategy="split_buckets" if shard_buckets else "whole_buckets",
            buckets=buckets,
        )
    )
    iteration = _OverlappedIteration(zero, interleaved, after_ddp=bool(getattr(ddp, "static_graph", False)))

    def hook_with_zero_fn(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future = hook(state, bucket)
        iteration.bucket_launched(future, [index_of[id(p)] for p in bucket.parameters()])
        return future

    return hook_with_zero_fn


def hook_with_zero_step(
    hook: Callable[[Any, dist.GradBucket], torch.futures.Future],
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool = False,
) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """Wrap ``hook`` so that ``zero``'s step runs inside ``ddp``'s backward, after
    the last gradient bucket is computed.

    Args:
        hook: the DDP communication hook to wrap (it still runs, unchanged).
        ddp: the DDP module.
        zero: a :class:`ZeroRedundancyOptimizer` built with ``overlap_with_ddp=True``
            over ``ddp``'s trainable parameters (and any of its frozen ones, e.g.
            ``ddp.parameters()``: never stepped, as in torch).
        shard_buckets: ``False``: each bucket (of DDP's settled layout) is owned by
            one rank, buckets balanced largest-first; ``True``: each bucket's
            parameters are spread over ranks.

    Returns:
        The hook to pass to ``ddp.register_comm_hook``.

    Raises:
        ValueError: ``zero`` not built with ``overlap_with_ddp=True``;
            ``find_unused_parameters=True``; parameters differ from ``ddp``'s (or
            include some DDP ignores).
        RuntimeError: ``zero`` already stepped or loaded state.
    """
    return _hook_with_zero(hook, ddp, zero, shard_buckets, interleaved=False)


def hook_with_zero_step_interleaved(
    hook: Callable[[Any, dist.GradBucket], torch.futures.Future],
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool = False,
) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """As :func:`hook_with_zero_step`, but bucket ``i``'s step runs when the hook
    for bucket ``i + 1`` is called, interleaved with the backward computation."""
    return _hook_with_zero(hook, ddp, zero, shard_buckets, interleaved=True)
