"""Outer optimization: local SGD with an outer optimizer (DiLoCo), as a pure transform.

Every rank keeps a *global* copy of the parameters: their value at the last
synchronization. Every ``sync_every`` steps the ranks average the pseudo-gradient
``global - local``, take one step of an *outer* optimizer (any functional optimizer
of :mod:`puredist.optim`) on the global copy with it, and write the new global
parameters into the local ones, in place. With outer ``sgd(lr=1)`` (no momentum) this
is exactly periodic model averaging: ``g - mean(g - l) = mean(l)``. The documented
DiLoCo recipe is ``sgd(lr=0.7, momentum=0.9, nesterov=True)``.

Options (static, checked by :func:`outer_optimizer`):

- ``comm_dtype``: the pseudo-gradient is all-reduced in this dtype (e.g. bf16, half the
  bytes of fp32); the outer step runs in the global copy's dtype.
- ``global_dtype``: the global copy and the outer state are kept in this dtype (e.g. an
  fp32 master copy for bf16 parameters, as INTELLECT-1 does; torchft keeps the
  parameters' dtype): the pseudo-gradient ``global - local`` is taken in it, and the
  new global parameters are rounded to the parameters' dtype only when written back.
- ``compressor``: instead, the pseudo-gradient is averaged with a
  :class:`~puredist.compression.Compressor`'s payloads (int8, 4-bit, top-k) and error
  feedback: each rank's residual (what its payloads have not sent yet) is part of the
  state and of the checkpoint. The compressed averaging completes when it starts (the
  ``delay`` still decides when it is applied).
- ``global_device``: where the global copy and the outer state live (e.g. ``"cpu"``).
- ``fragments``: the parameter leaves are cut into this many contiguous fragments of
  about equal size; fragment ``f`` synchronizes ``f * sync_every // fragments`` steps
  after fragment 0, so no synchronization sends the whole model.
- ``delay``: the all-reduce started at step ``k`` is applied at step ``k + delay``
  (``0 <= delay < sync_every``), overlapping the communication with ``delay`` local
  steps; the local progress made meanwhile is kept: ``local <- global_new + (local -
  local_at_k)``. With ``delay=0`` the update is synchronous: ``local <- global_new``.
- ``lower_levels``: ``{period: group_size}`` — hierarchical averaging below the outer
  step: at step ``k`` (after warm-up) the largest of these periods dividing ``k``
  averages, within blocks of its group size, the fragments that are neither starting a
  synchronization at ``k`` nor have one in flight (plain averaging, no outer optimizer:
  the global copy and the outer state change only at outer synchronizations, so they
  stay identical on every rank; and an in-flight fragment's local progress stays its own).

Schedule: fragment ``f`` synchronizes at step ``k`` iff ``k - warmup_steps - offset_f >=
0`` and is a multiple of ``sync_every`` (torch's periodic rule for ``f = 0``). The global
copy starts as the initial parameters, which must be the same on every rank (as DDP's
initial broadcast makes them; ``init`` does not communicate). A fragment's *first*
synchronization only establishes the synchronized point — plain averaging,
``g <- g - mean(g - l) = mean(l)``, the outer state untouched — so that the progress of
the warm-up is not taken as one outer step; the outer optimizer steps from the second on.

The state, :class:`OuterState`, holds the step, the global copy, the outer optimizer's
per-parameter states and the synchronizations in flight; :attr:`OuterTransform.state_dict`
and :attr:`OuterTransform.load_state_dict` turn it into a flat dict of fixed keys (the
same for any state of one transform), which ``torch.save`` and
``torch.distributed.checkpoint`` both store.
"""

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist

from puredist.tree import PyTree, clone_leaves, tree_leaves, tree_unflatten
from puredist._validation import check_hierarchy_periods, check_period, check_warmup_steps
from puredist._dtensors import is_dtensor, like, local_shard
from puredist._inputs import Checked, checked_like, is_transformed, transforms_active
from puredist.averaging import _float_leaves
from puredist.collectives import Collective, CollectiveError, CollectiveHandle
from puredist.compression import Compressor, compressed_mean
from puredist.replicas import VmapCollective
from puredist.optim import Optimizer, clone_states, copies
from puredist.schedules import hierarchical_schedule
from puredist._docs import fields_documented


def _pinned_if_host_of_gpu(copy: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    """``copy`` in page-locked memory when it is a host copy of a GPU tensor (copies
    between the two then run without blocking the host)."""
    if copy.device.type == "cpu" and leaf.device.type == "cuda" and not is_dtensor(leaf):
        return copy.pin_memory()
    return copy


def _fetched(tensors: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` on the devices and in the dtypes of ``targets``. GPU tensors bound
    for the host are copied into page-locked memory without blocking, then one wait
    for the stream covers them all: the host's one wait of a synchronization with a
    host global copy (it is about to compute with the values)."""
    staged, streams = [], set()
    for tensor, target in zip(tensors, targets):
        if target.device.type == "cpu" and tensor.device.type == "cuda" and not is_dtensor(tensor):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            staged.append(host.copy_(tensor, non_blocking=True))
            streams.add(torch.cuda.current_stream(tensor.device))
        else:
            staged.append(tensor)
    for stream in streams:
        stream.synchronize()
    return [t.to(device=g.device, dtype=g.dtype) for t, g in zip(staged, targets)]


class _SyncContext(NamedTuple):
    """The rank-check context of one synchronization, formatted only when checked."""

    config: str
    fragment: int
    start_step: int

    def __str__(self) -> str:
        return f"{self.config} sync of fragment {self.fragment} started at step {self.start_step}"


@fields_documented
class InFlight(NamedTuple):
    """One fragment's synchronization, started and not yet applied.

    Attributes:
        apply_step: the step at which the averaged pseudo-gradient is applied.
        fragment: the fragment's index.
        pseudo_grads: the fragment's pseudo-gradients, averaged in place by the
            collective (final once ``handle`` is waited on), in the comm dtype.
        snapshot: the fragment's local parameters when it started (``()`` when
            ``delay == 0``: nothing runs in between).
        handle: the collective's handle.
    """

    apply_step: int
    fragment: int
    pseudo_grads: tuple[torch.Tensor, ...]
    snapshot: tuple[torch.Tensor, ...]
    handle: CollectiveHandle


@fields_documented
class OuterState(NamedTuple):
    """State of an outer-optimization transform.

    Attributes:
        step: how many times ``update``/``update_`` ran.
        global_params: the global copy, one tensor per parameter leaf.
        outer_state: the outer optimizer's per-parameter states, aligned with the leaves.
        in_flight: synchronizations started and not yet applied, in start order.
        residuals: with a ``compressor``, this rank's error-feedback residual per leaf
            (fp32); else ``()``.
    """

    step: int
    global_params: tuple[torch.Tensor, ...]
    outer_state: tuple
    in_flight: tuple[InFlight, ...]
    residuals: tuple[torch.Tensor, ...] = ()


@fields_documented
class OuterTransform(NamedTuple):
    """``init``, pure ``update``, in-place ``update_``, and the checkpoint pair.

    ``state_dict(state, *, rank)`` completes any collective in flight (every rank must
    call it at the same step) and returns a flat dict; keys of values that differ
    between ranks (the snapshots of in-flight synchronizations) carry ``rank``, the
    others are identical on every rank. ``load_state_dict(state, saved, *, rank)``
    returns the state saved, with ``state`` (any state of this transform on this rank,
    e.g. a fresh ``init``) as the template.

    Attributes:
        init: ``init(params) -> OuterState``: step 0, the global copy, fresh outer state.
        update: ``update(params, state, *, collective) -> (params, state)``: pure (and
            under ``torch.func`` transforms for synchronous, uncompressed syncs).
        update_: ``update_(params, state, *, collective) -> state``: in place.
        state_dict: ``state_dict(state, *, rank) -> dict``: the checkpoint.
        load_state_dict: ``load_state_dict(state, saved, *, rank) -> OuterState``: checked first.
    """

    init: Callable[[PyTree], OuterState]
    update: Callable[..., tuple[PyTree, OuterState]]
    update_: Callable[..., OuterState]
    state_dict: Callable[..., dict[str, Any]]
    load_state_dict: Callable[..., OuterState]


def _describe_leaf(leaves: Sequence[torch.Tensor], i: int) -> str:
    return f"shape {tuple(leaves[i].shape)}, {leaves[i].dtype}" if i < len(leaves) else "none"


def _entry(value: object) -> str:
    """A checkpoint entry, described without its values."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and {value.dtype}"
    return f"{type(value).__name__} {value!r}" if isinstance(value, bool) else type(value).__name__


def _world_size() -> int:
    """The default process group's size, or -1 outside one (simulated ranks)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else -1


def split_fragments(sizes: Sequence[int], count: int) -> tuple[tuple[int, ...], ...]:
    """Cut leaf indices ``0..len(sizes)-1`` into ``count`` non-empty contiguous runs of
    about equal total size: a run ends once the running total reaches its share
    ``(f + 1) * total / count``, leaving at least one leaf for every later run."""
    fragments: list[tuple[int, ...]] = []
    total, running, start = sum(sizes), 0, 0
    for index, size in enumerate(sizes):
        running += size
        remaining_leaves = len(sizes) - index - 1
        remaining_runs = count - len(fragments) - 1
        share_reached = running * count >= (len(fragments) + 1) * total
        if remaining_runs > 0 and (share_reached or remaining_leaves == remaining_runs):
            fragments.append(tuple(range(start, index + 1)))
            start = index + 1
    fragments.append(tuple(range(start, len(sizes))))
    return tuple(fragments)


def _check_options(sync_every, warmup_steps, delay, fragments, comm_dtype, global_dtype) -> None:
    for name, dtype in (("comm_dtype", comm_dtype), ("global_dtype", global_dtype)):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"Arg ``{name}`` must be a floating-point torch.dtype or None, got {dtype!r}.")
    check_period(sync_every, arg="sync_every")
    check_warmup_steps(warmup_steps)
    for name, value, low, high in (("delay", delay, 0, sync_every - 1), ("fragments", fragments, 1, sync_every)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"Arg ``{name}`` must be an int in [{low}, {high}] for sync_every={sync_every}, got {value!r}.")


def outer_optimizer(
    outer: Optimizer,
    *,
    sync_every: int,
    warmup_steps: int = 0,
    delay: int = 0,
    fragments: int = 1,
    comm_dtype: torch.dtype | None = None,
    global_device: torch.device | str | None = None,
    global_dtype: torch.dtype | None = None,
    lower_levels: Mapping[int, int] | None = None,
    compressor: Compressor | None = None,
) -> OuterTransform:
    """Build the outer-optimization transform (see the module docstring).

    Args:
        outer: the outer optimizer, e.g. ``puredist.sgd(0.7, momentum=0.9, nesterov=True)``.
        sync_every: inner steps between two synchronizations of a fragment (``H``).
        warmup_steps: steps before fragment 0's first synchronization.
        delay: steps between starting and applying a synchronization, ``< sync_every``.
        fragments: how many staggered fragments, ``<= sync_every``.
        comm_dtype: dtype of the all-reduced pseudo-gradient (``None``: the global
            copy's).
        global_device: device of the global copy and outer state (``None``: the
            parameter's).
        global_dtype: dtype of the global copy and outer state (``None``: the
            parameter's); e.g. an fp32 master copy for bf16 parameters.
        lower_levels: ``{period: group_size}`` plain averaging below the outer step.
        compressor: average the pseudo-gradients with this compressor and error
            feedback (exclusive with ``comm_dtype``).

    Raises:
        ValueError, TypeError: bad options (named, with their value); at ``init``, more
            fragments than parameter leaves; at update, a lower-level group size the
            collective cannot average within.
    """
    _check_options(sync_every, warmup_steps, delay, fragments, comm_dtype, global_dtype)
    if compressor is not None and not isinstance(compressor, Compressor):
        raise TypeError(f"Arg ``compressor`` must be a puredist Compressor (e.g. int8_blocks()), got {compressor!r}.")
    if compressor is not None and comm_dtype is not None:
        raise ValueError(
            f"Args ``compressor`` ({compressor.name}) and ``comm_dtype`` ({comm_dtype}) are exclusive: the compressor "
            "decides the payload."
        )
    lower = dict(lower_levels or {})
    if lower:
        check_hierarchy_periods(tuple(lower), arg="lower_levels")
    lower_level = hierarchical_schedule(tuple(lower), warmup_steps) if lower else (lambda step: None)
    lower_sizes = tuple(lower.values())
    offsets = [f * sync_every // fragments for f in range(fragments)]
    config = (
        f"outer_optimizer({outer.config or 'an optimizer built by hand'}, sync_every={sync_every}, "
        f"warmup_steps={warmup_steps}, delay={delay}, "
        f"fragments={fragments}, comm_dtype={comm_dtype}, global_dtype={global_dtype}, lower_levels={lower}"
        + (f", compressor={compressor.name})" if compressor is not None else ")")
    )

    def due_fragments(step: int) -> list[int]:
        return [
            f for f in range(fragments)
            if step - warmup_steps - offsets[f] >= 0 and (step - warmup_steps - offsets[f]) % sync_every == 0
        ]

    def layout(leaves: Sequence[torch.Tensor]) -> tuple[tuple[int, ...], ...]:
        if fragments > len(leaves):
            raise ValueError(f"Arg ``fragments`` {fragments} exceeds the {len(leaves)} parameter leaves.")
        if isinstance(leaves, Checked):  # the same leaves every step: cut once
            return leaves.layout.derived(("fragments", fragments), lambda: layout(list(leaves)))
        return split_fragments([leaf.numel() for leaf in leaves], fragments)

    # where the global copy is the parameters' own device and dtype and is sent as it is, the pseudo-gradients
    # and the write-back are multi-tensor kernels over whole fragments (else one conversion per leaf)
    same_place = global_device is None and global_dtype is None and comm_dtype is None and compressor is None

    def init(params: PyTree) -> OuterState:
        """Step 0: a copy of ``params`` as the global copy, fresh outer-optimizer state."""
        leaves, _ = _float_leaves(params, in_place=True)
        layout(leaves)
        global_params = tuple(
            _pinned_if_host_of_gpu(
                leaf.detach().to(
                    device=global_device if global_device is not None else leaf.device,
                    dtype=global_dtype or leaf.dtype, copy=True,
                ),
                leaf,
            )
            for leaf in leaves
        )
        residuals = (  # rank-local: a DTensor's residual is its local shard's
            tuple(torch.zeros_like(local_shard(leaf), dtype=torch.float32) for leaf in leaves) if compressor else ()
        )
        return OuterState(0, global_params, tuple(outer.init(list(global_params))), (), residuals)

    def check_params(leaves: Sequence[torch.Tensor], state: OuterState) -> None:
        """Raise ``ValueError``, before anything is communicated, unless ``leaves`` are
        the parameters ``state`` was made for: as many, of the same shapes (and dtypes,
        where the global copy keeps the parameters' own). Leaves are paired by position,
        so another tree (a frozen embedding left out) would pair unrelated tensors."""
        globals_ = state.global_params
        same = len(leaves) == len(globals_) and [t.shape for t in leaves] == [g.shape for g in globals_]
        if same and global_dtype is None:
            same = [t.dtype for t in leaves] == [g.dtype for g in globals_]
        if same:
            return
        differing = next(
            (i for i, (leaf, g) in enumerate(zip(leaves, globals_))
             if leaf.shape != g.shape or (global_dtype is None and leaf.dtype != g.dtype)),
            min(len(leaves), len(globals_)),
        )
        raise ValueError(
            f"Arg ``params`` has {len(leaves)} leaves; the state was made by init for {len(globals_)}, and leaf "
            f"{differing} differs (params: "
            f"{_describe_leaf(leaves, differing)}, state: {_describe_leaf(globals_, differing)}). Pass the "
            "parameters init was given (the same tree), or init a state for these."
        )

    def check_collective(collective: Collective) -> None:
        missing = [g for g in lower_sizes if g not in collective.group_sizes]
        if collective.is_member and missing:
            raise ValueError(
                f"The collective cannot average within groups of sizes {missing} from arg "
                f"``lower_levels``; it supports {collective.group_sizes}."
            )

    def pseudo_gradient(global_param: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
        """``global - leaf`` in the global copy's dtype (an fp32 master's difference is
        fp32), on the leaf's device, in the dtype it is sent in. A pinned host copy goes
        up without blocking: the host writes it only after its next wait; a copy down
        to the host blocks, as the host computes with it at once."""
        difference = global_param.to(leaf.device, non_blocking=leaf.is_cuda) - leaf.to(global_param.dtype)
        return difference.to(comm_dtype or global_param.dtype)

    def is_first_sync(fragment: int, start_step: int) -> bool:
        """Whether the synchronization of ``fragment`` started at ``start_step`` is its
        first, which only establishes the synchronized point (plain averaging)."""
        return start_step == warmup_steps + offsets[fragment]

    def start(leaves, state: OuterState, fragment: int, indices, collective: Collective, residuals: list) -> InFlight:
        """Start ``fragment``'s synchronization; with a compressor it completes here,
        and its residuals in ``residuals`` are replaced."""
        with torch.no_grad():
            locals_ = [leaves[i] for i in indices]
            if same_place and leaves.layout.plain:
                globals_ = [state.global_params[i] for i in indices]
                # the differences' strides follow both operands': their layout is kept per layout of the leaves too
                pseudo = checked_like(globals_, torch._foreach_sub(globals_, locals_), why=("foreach_sub", leaves.layout))
            else:
                pseudo = tuple(pseudo_gradient(state.global_params[i], leaves[i].detach()) for i in indices)
            snapshot = tuple(copies(locals_)) if delay else ()
            if compressor is None:
                handle = issue(pseudo, state.step, fragment, collective)
                return InFlight(state.step + delay, fragment, tuple(pseudo), snapshot, handle)
            context = f"{config} sync of fragment {fragment} started at step {state.step}"
            means, left = compressed_mean(list(pseudo), tuple(residuals[i] for i in indices), compressor, collective,
                                          context=context)
        for i, residual in zip(indices, left):
            residuals[i] = residual
        return InFlight(state.step + delay, fragment, tuple(means), snapshot, CollectiveHandle())

    def issue(pseudo, start_step: int, fragment: int, collective: Collective) -> CollectiveHandle:
        """Average ``pseudo`` in place: in the background with a delay, else at once
        (bounded staging memory; a failure raises here, before anything is applied)."""
        context = _SyncContext(config, fragment, start_step)
        if delay:
            return collective.mean_(pseudo, async_op=True, context=context)
        collective.mean_(pseudo, context=context)
        return CollectiveHandle()

    def apply(leaves, global_params: list, outer_state: list, item: InFlight, indices) -> None:
        targets = [global_params[i] for i in indices]
        fast = same_place and leaves.layout.plain
        grads = list(item.pseudo_grads) if fast else _fetched(item.pseudo_grads, targets)
        with torch.no_grad():
            if is_first_sync(item.fragment, item.apply_step - delay):
                # the fragment's first synchronization only establishes the synchronized
                # point: plain averaging, g - mean(g - l) = mean(l); the outer optimizer
                # starts from there (else all of warm-up would be one outer step)
                torch._foreach_sub_(targets, grads)
            else:
                stepped = outer.update_(targets, grads, [outer_state[i] for i in indices])
                for k, i in enumerate(indices):
                    outer_state[i] = stepped[k]
            if fast:
                locals_ = [leaves[i] for i in indices]
                if item.snapshot:  # keep the local progress made while the all-reduce ran
                    torch._foreach_sub_(locals_, item.snapshot)
                    torch._foreach_add_(locals_, targets)
                else:
                    torch._foreach_copy_(locals_, targets)
                return
            for k, i in enumerate(indices):
                local = leaves[i].detach()
                # from a pinned host copy without blocking: the host writes it again only after
                # the wait in _fetched of a later synchronization, which orders after this copy
                if item.snapshot:  # keep the local progress made while the all-reduce ran
                    local.sub_(item.snapshot[k].to(local.device)).add_(
                        targets[k].to(local.device, local.dtype, non_blocking=local.is_cuda))
                else:
                    local.copy_(targets[k], non_blocking=local.is_cuda)

    def update_(params: PyTree, state: OuterState, *, collective: Collective) -> OuterState:
        """In place (see :class:`OuterTransform`). Raises before applying anything if a
        synchronization fails: the state passed in stays valid and un-applied (a
        failed synchronization in it is issued again, on ``collective``, by the next
        ``update_`` with it)."""
        leaves, _ = _float_leaves(params, in_place=True)
        check_params(leaves, state)
        fragment_leaves = layout(leaves)
        check_collective(collective)
        if state.step == 0:
            collective.check_replicated(
                list(state.global_params),
                what=f"{config}: the initial parameters (the global copy made by init)",
                context=f"{config} initial check at step 0",
            )
        in_flight = [
            item._replace(handle=issue(item.pseudo_grads, item.apply_step - delay, item.fragment, collective))
            if item.handle.error is not None else item
            for item in state.in_flight
        ]
        due = due_fragments(state.step)
        residuals = list(state.residuals)
        for f in due:
            in_flight.append(start(leaves, state, f, fragment_leaves[f], collective, residuals))
        applying = [item for item in in_flight if item.apply_step == state.step]
        waiting = [item for item in in_flight if item.apply_step != state.step]
        for item in applying:
            item.handle.wait()  # all of them before any is applied: a failure applies nothing
        global_params, outer_state = list(state.global_params), list(state.outer_state)
        for item in applying:
            apply(leaves, global_params, outer_state, item, fragment_leaves[item.fragment])
        new_state = OuterState(state.step + 1, tuple(global_params), tuple(outer_state), tuple(waiting), tuple(residuals))
        level = lower_level(state.step)
        busy = set(due) | {item.fragment for item in waiting}
        idle = [leaves[i] for f, indices in enumerate(fragment_leaves) if f not in busy for i in indices]
        if level is not None and idle:
            try:
                collective.mean_(idle, group_size=lower_sizes[level], context=f"{config} lower level at step {state.step}")
            except CollectiveError as error:
                error.state = new_state  # the outer step was applied: continue from this state
                raise
        return new_state

    def traced_update(params: PyTree, state: OuterState, collective: Collective) -> tuple[PyTree, OuterState]:
        """:func:`update` under ``torch.func`` transforms: out of place and
        differentiable (the collective's ``mean``, the outer optimizer's pure
        ``update``), for synchronous, uncompressed synchronizations."""
        if delay or compressor is not None or state.in_flight:
            raise NotImplementedError(
                f"{config}: under torch.func transforms the outer update runs synchronous, uncompressed "
                "synchronizations only (delay=0, no compressor): a delayed one is carried in the state by handles "
                "and snapshots that no transform can map, a compressor's payloads are not differentiable."
            )
        leaves, spec = _float_leaves(params, in_place=False)
        check_params(leaves, state)
        fragment_leaves = layout(leaves)
        check_collective(collective)
        if state.step == 0:
            check_initial_copy(state, collective)
        global_params, outer_state, new_leaves = list(state.global_params), list(state.outer_state), list(leaves)
        due = due_fragments(state.step)
        for f in due:
            indices = fragment_leaves[f]
            pseudo = [pseudo_gradient(global_params[i], leaves[i]) for i in indices]
            means = collective.mean(pseudo, context=f"{config} sync of fragment {f} started at step {state.step}")
            targets = [global_params[i] for i in indices]
            grads = [m.to(g.dtype) for m, g in zip(means, targets)]
            if is_first_sync(f, state.step):  # plain averaging (see apply)
                targets = [t - g for t, g in zip(targets, grads)]
            else:
                targets, stepped = outer.update(targets, grads, tuple(outer_state[i] for i in indices))
                for k, i in enumerate(indices):
                    outer_state[i] = stepped[k]
            for k, i in enumerate(indices):
                global_params[i] = targets[k]
                new_leaves[i] = targets[k].to(leaves[i].device, leaves[i].dtype, copy=True)  # never the global copy
        level = lower_level(state.step)
        idle = [i for f, indices in enumerate(fragment_leaves) if f not in due for i in indices]
        if level is not None and idle:
            means = collective.mean([new_leaves[i] for i in idle], group_size=lower_sizes[level],
                                    context=f"{config} lower level at step {state.step}")
            for i, mean in zip(idle, means):
                new_leaves[i] = mean
        new_state = OuterState(state.step + 1, tuple(global_params), tuple(outer_state), (), state.residuals)
        return tree_unflatten(spec, new_leaves), new_state

    def check_initial_copy(state: OuterState, collective: Collective) -> None:
        """Step 0 under a transform: the initial check reads the global copy on the host,
        which only an unmapped copy allows (under ``vmap``, one copy shared by every
        replica is replicated by construction)."""
        if any(is_transformed(t) for t in state.global_params):
            raise NotImplementedError(
                f"{config}: at step 0 the global copy made by init is checked to be the same on every rank, on the "
                "host, which a torch.func transform hides when it maps the copy: pass the state of init unmapped "
                "(vmap in_dims=None: one copy for every replica), or take step 0 outside the transform."
            )
        if not isinstance(collective, VmapCollective):
            with torch._C._DisableFuncTorch():  # plain tensors, read on the host as eagerly
                collective.check_replicated(
                    list(state.global_params),
                    what=f"{config}: the initial parameters (the global copy made by init)",
                    context=f"{config} initial check at step 0",
                )

    def update(params: PyTree, state: OuterState, *, collective: Collective) -> tuple[PyTree, OuterState]:
        """Pure: first completes the input state's collectives in flight (their buffers
        belong to the collective until then), then works on copies. Under ``torch.func``
        transforms (``vmap`` with a :class:`~puredist.VmapCollective`, ``grad``) it runs
        out of place and differentiably, for ``delay=0`` without a compressor; the
        state keeps its structure (``puredist.tree.vmap_axes(state)`` maps it)."""
        if transforms_active() and any(is_transformed(t) for t in tree_leaves(params)):
            return traced_update(params, state, collective)
        for item in state.in_flight:
            if item.handle.error is None:  # a failed one is issued again by update_
                item.handle.wait()
        leaves, spec = _float_leaves(params, in_place=True)
        copies = clone_leaves(leaves)
        cloned = OuterState(
            state.step,
            tuple(torch.empty_like(t, pin_memory=t.is_pinned()).copy_(t) for t in state.global_params),  # stays pinned
            tuple(clone_states(state.outer_state)),
            tuple(
                item._replace(
                    pseudo_grads=tuple(t.clone() for t in item.pseudo_grads),
                    snapshot=tuple(t.clone() for t in item.snapshot),
                )
                for item in state.in_flight
            ),
            tuple(t.clone() for t in state.residuals),
        )
        return tree_unflatten(spec, copies), update_(copies, cloned, collective=collective)

    def state_dict(state: OuterState, *, rank: int) -> dict[str, Any]:
        """A flat dict of ``state`` for ``torch.save`` or DCP (completes collectives in
        flight: every rank calls it at the same step)."""
        fragment_leaves = layout(state.global_params)
        saved: dict[str, Any] = {"step": state.step, "config": config, "world_size": _world_size()}
        for i, (global_param, leaf_state) in enumerate(zip(state.global_params, state.outer_state)):
            saved[f"global.{i}"] = global_param
            for field, value in leaf_state._asdict().items():
                saved[f"outer.{i}.{field}.present"] = value is not None
                saved[f"outer.{i}.{field}"] = value if value is not None else torch.zeros_like(global_param)
        by_fragment = {item.fragment: item for item in state.in_flight}
        for f, indices in enumerate(fragment_leaves):
            item = by_fragment.get(f)
            if item is not None:
                item.handle.wait()
            saved[f"in_flight.{f}.apply_step"] = item.apply_step if item is not None else -1
            for k, i in enumerate(indices):
                shaped = state.global_params[i].to(dtype=comm_dtype or state.global_params[i].dtype)
                saved[f"in_flight.{f}.pseudo_grad.{k}"] = item.pseudo_grads[k] if item else torch.zeros_like(shaped)
                if delay:  # rank-local: a DTensor's snapshot is saved as this rank's shard, a plain tensor
                    snapshot = item.snapshot[k] if item else torch.zeros_like(state.global_params[i])
                    saved[f"in_flight.{f}.snapshot.{k}.rank{rank}"] = local_shard(snapshot)
        for i, residual in enumerate(state.residuals):  # differ between ranks
            saved[f"residual.{i}.rank{rank}"] = residual
        return saved

    def load_state_dict(state: OuterState, saved: Mapping[str, Any], *, rank: int) -> OuterState:
        """The state ``saved`` holds, validated against this transform and ``state``
        (a template, e.g. ``init``)."""
        fragment_leaves = layout(state.global_params)
        check_saved(state, saved, fragment_leaves, rank)
        global_params = tuple(
            saved[f"global.{i}"].to(device=g.device, dtype=g.dtype, copy=True).pin_memory() if g.is_pinned()
            else saved[f"global.{i}"].to(device=g.device, dtype=g.dtype, copy=True)
            for i, g in enumerate(state.global_params)
        )
        def restored(i: int, field: str, template: torch.Tensor | None) -> torch.Tensor | None:
            if not saved.get(f"outer.{i}.{field}.present", False):  # (a field added since: absent, None)
                return None
            device = template.device if template is not None else global_params[i].device
            return saved[f"outer.{i}.{field}"].to(device=device, copy=True)

        outer_state = tuple(
            type(leaf_state)(**{field: restored(i, field, value) for field, value in leaf_state._asdict().items()})
            for i, leaf_state in enumerate(state.outer_state)
        )
        in_flight = []
        for f, indices in enumerate(fragment_leaves):
            apply_step = int(saved[f"in_flight.{f}.apply_step"])
            if apply_step < 0:
                continue
            in_flight.append(InFlight(
                apply_step,
                f,
                tuple(saved[f"in_flight.{f}.pseudo_grad.{k}"].clone() for k in range(len(indices))),
                tuple(
                    like(state.global_params[i], saved[f"in_flight.{f}.snapshot.{k}.rank{rank}"].clone())
                    for k, i in enumerate(indices)
                ) if delay else (),
                CollectiveHandle(),  # completed before it was saved
            ))
        in_flight.sort(key=lambda item: item.apply_step)
        residuals = tuple(
            saved[f"residual.{i}.rank{rank}"].to(device=r.device, dtype=torch.float32, copy=True)
            for i, r in enumerate(state.residuals)
        )
        return OuterState(int(saved["step"]), global_params, outer_state, tuple(in_flight), residuals)

    def check_saved(state: OuterState, saved: Mapping[str, Any], fragment_leaves, rank: int) -> None:
        """Raise ``ValueError`` unless ``saved`` is a state of this very transform that
        can be loaded on ``rank`` (nothing is built before it passes): first what says
        whose checkpoint it is (configuration, optimizer, world size), then that every
        entry is there, then the values that must agree (step, shapes, steps in flight),
        then every entry's kind."""
        check_origin(state, saved, fragment_leaves, rank)
        expected = state_dict(state, rank=rank)  # this transform's entries, from the template
        check_entries(expected, saved, kinds=False)
        step = saved["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"Arg ``saved``: ``step`` must be a non-negative int, got {step!r}.")
        for i, template in enumerate(state.global_params):
            shape = tuple(saved[f"global.{i}"].shape)
            if shape != tuple(template.shape):
                raise ValueError(f"Arg ``saved``: ``global.{i}`` has shape {shape}, the parameter has {tuple(template.shape)}.")
        for i, template in enumerate(state.residuals):
            shape = tuple(saved[f"residual.{i}.rank{rank}"].shape)
            if shape != tuple(template.shape):
                raise ValueError(
                    f"Arg ``saved``: rank {rank}'s residual {i} has shape {shape}, this rank's shard {tuple(template.shape)}: "
                    "it was saved at another sharding. A compressed run resumes at the layout it was saved at."
                )
        for f, indices in enumerate(fragment_leaves):
            apply_step = int(saved[f"in_flight.{f}.apply_step"])
            if apply_step >= 0 and not step <= apply_step <= step + delay:
                raise ValueError(
                    f"Arg ``saved``: fragment {f}'s synchronization in flight applies at step {apply_step}, "
                    f"outside [{step}, {step + delay}] for the saved step {step}."
                )
            started = apply_step - delay
            if apply_step >= 0 and not (started < step and f in due_fragments(started)):
                raise ValueError(
                    f"Arg ``saved``: fragment {f}'s synchronization in flight applies at step {apply_step}, so it "
                    f"started at step {started}: not one of its synchronizations before the saved step {step}."
                )
        check_entries(expected, saved, kinds=True)

    def check_origin(state: OuterState, saved: Mapping[str, Any], fragment_leaves, rank: int) -> None:
        """Raise ``ValueError`` where ``saved`` comes from another transform, another
        outer optimizer, or a world size whose rank-local entries this rank lacks."""
        if saved.get("config") != config:
            raise ValueError(
                f"Arg ``saved`` was saved by {saved.get('config', 'something else')!r}; this transform is "
                f"{config!r}: the schedules and payloads differ, so it cannot continue that run."
            )
        fields = set(state.outer_state[0]._fields) if state.outer_state else set()
        saved_fields = {key.split(".")[2] for key in saved if key.startswith("outer.0.") and key.endswith(".present")}
        if saved_fields - fields:
            raise ValueError(
                f"Arg ``saved`` holds outer-optimizer state with fields {sorted(saved_fields)}; this transform's "
                f"outer optimizer keeps {sorted(fields)}: it is a checkpoint of another optimizer."
            )
        for i, leaf_state in enumerate(state.outer_state):
            if getattr(leaf_state, "step", None) is not None and not saved.get(f"outer.{i}.step.present", False):
                raise ValueError(
                    f"Arg ``saved`` holds no step count for parameter {i}'s outer state: it was saved by an outer "
                    "optimizer that keeps none (without a schedule or dampening), which this one needs."
                )
        saved_world, world = saved.get("world_size", -1), _world_size()
        if state.residuals and saved_world >= 0 and world >= 0 and saved_world != world:
            raise ValueError(
                f"Arg ``saved`` was saved at world size {saved_world}, this run has {world}: each rank's error-feedback "
                "residuals are its own (what its payloads have not sent yet), so a compressed run resumes at the "
                "world size it was saved at."
            )
        if state.residuals and f"residual.0.rank{rank}" not in saved:
            raise ValueError(
                f"Arg ``saved`` holds no error-feedback residuals of rank {rank}: it was saved at a smaller world "
                "size. Each rank's residuals are its own; a compressed run resumes at the world size it was saved at."
            )
        for f in range(len(fragment_leaves)):
            in_flight = saved.get(f"in_flight.{f}.apply_step", -1)
            if delay and in_flight != -1 and f"in_flight.{f}.snapshot.0.rank{rank}" not in saved:
                raise ValueError(
                    f"Arg ``saved`` holds no snapshot of rank {rank} for fragment {f}'s synchronization in flight: "
                    "it was saved at a smaller world size. A checkpoint loads at another world size only when no "
                    "delayed synchronization is in flight (save at a step where none is, e.g. a multiple of "
                    "sync_every that applies no delay)."
                )

    def check_entries(expected: Mapping[str, Any], saved: Mapping[str, Any], *, kinds: bool) -> None:
        """Every entry of ``expected`` (this transform's checkpoint of the template) is in
        ``saved`` (``kinds``: and of
        the same kind: a tensor of the same shape, and dtype but for a snapshot, which is
        in the parameter's; the same Python type; each outer-state field present where
        this optimizer's state has it). Absent may be only ``world_size`` (older
        checkpoints), a field this optimizer's state does not have either (with its
        presence flag), and other ranks' snapshots where none is in flight."""
        for key, template in expected.items():
            if key not in saved:
                field_absent = key.endswith(".present") and not template or (
                    key.startswith("outer.") and not expected.get(f"{key}.present", True)
                )
                # another world size: the snapshots of other ranks (none in flight: checked before)
                idle_snapshot = ".snapshot." in key and saved.get(f"in_flight.{key.split('.')[1]}.apply_step") == -1
                if key == "world_size" or field_absent or idle_snapshot:
                    continue
                raise ValueError(f"Arg ``saved`` lacks ``{key}``, which this transform's checkpoint holds.")
            if not kinds:
                continue
            value = saved[key]
            if isinstance(template, torch.Tensor):
                same = isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(template.shape) and (
                    value.dtype == template.dtype or ".snapshot." in key
                )
            else:
                same = type(value) is type(template) and (not key.endswith(".present") or value == template)
            if not same:
                raise ValueError(
                    f"Arg ``saved``: ``{key}`` is {_entry(value)}, where this transform's checkpoint holds "
                    f"{_entry(template)}: it is not a state of this transform for these parameters."
                )

    return OuterTransform(init, update, update_, state_dict, load_state_dict)
