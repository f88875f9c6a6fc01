"""The :class:`Collective` protocol and what every backend shares: the division rule
of a mean (:func:`divides_first`, :func:`block_mean`), the check that an argument is a
collective, and a rank's refusal told to its peers before it raises.

The mean is a sum and one division by the group size ``n``, in the tensor's dtype.
For dtypes whose range is narrower than fp32's (fp16; bf16, whose largest value is
just below fp32's) each value is divided *before* the sum, so the mean never overflows
when it is representable (fp16 40000 and 30000 average to 35008, not inf), as torch's
``average_parameters`` does; other dtypes are divided after the sum (by NCCL, its
native ``AVG``, which for floats sums each value times ``1/n`` rounded to the dtype:
the same where ``n`` is a power of two, within an ulp otherwise, and the same on
every rank).

This module must not import a backend (:mod:`puredist.collectives.distributed`,
:mod:`puredist.collectives.simulated`): they import it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from puredist._consistency import check_same_digests
from puredist._validation import Rule, check, check_each, is_integral
from puredist.staging import CollectiveHandle

__all__ = [
    "SUPPORTED_GROUP_SIZE", "Collective", "block_mean", "check_group_sizes", "check_is_collective", "divides_first",
    "group_size_rule", "refusing",
]


class Collective(Protocol):
    """What the averaging functions need from a backend.

    Attributes:
        world_size: number of ranks in the whole group.
        group_sizes: the group sizes ``mean_`` accepts (always includes
            ``world_size``).
        is_member: whether this process takes part (``False``: ``mean_`` is a no-op).
        simulated: whether the ranks are replicas simulated in one process (the
            messages say "replicas").
    """

    simulated: bool = False

    @property
    def world_size(self) -> int: ...

    @property
    def group_sizes(self) -> tuple[int, ...]: ...

    @property
    def is_member(self) -> bool: ...

    def mean_(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        group_size: int | None = None,
        async_op: bool = False,
        context: str = "",
    ) -> "CollectiveHandle | None":
        """Replace each tensor, in place, by its mean over the group of ``group_size``
        ranks this rank belongs to; with ``async_op`` return a handle to wait on.
        ``context`` (e.g. the schedule and step) must be equal on every rank."""
        ...

    def mean(
        self, tensors: Sequence[torch.Tensor], *, group_size: int | None = None, context: str = ""
    ) -> list[torch.Tensor]:
        """New tensors holding each tensor's mean over the group (the inputs are not
        written). Differentiable: the adjoint of a mean over a group is the mean of
        the incoming gradients over the same group."""
        ...

    def value_digests(self, tensors: Sequence[torch.Tensor], *, what: str, context: str = "") -> list[list[int]]:
        """Every rank's digests of the values of ``tensors``, one row per rank (one int
        per tensor, equal to the first row's exactly where the rank's values are the
        first rank's: across processes :func:`puredist._consistency.value_digest`; where
        every rank is in this process, 1 where they differ, else 0; a tensor the
        same on every rank by construction may read 0 on each), the same rows on every rank;
        ``[]`` where this rank has no peer to compare with. Where ranks can disagree on
        more than values, their tensors' layouts and ``context`` (as for :meth:`mean_`)
        are checked first, raising :class:`~puredist.RankMismatchError`."""
        ...

    def check_replicated(self, tensors: Sequence[torch.Tensor], *, what: str, context: str = "") -> None:
        """Raise :class:`~puredist.RankMismatchError` (on every rank) unless every rank
        holds the same values in ``tensors``: the one comparison of every backend's
        :meth:`value_digests` (a backend subclassing this protocol inherits it);
        ``what`` names the tensors in the message, ``context`` as for :meth:`mean_`."""
        check_same_digests(self.value_digests(tensors, what=what, context=context), len(tensors), what,
                           simulated=self.simulated)


_IS_COLLECTIVE = Rule(lambda v, b: callable(getattr(v, "mean_", None)), TypeError,
                      "Arg ``{arg}`` must be a puredist collective (DistributedCollective(group), "
                      "SimulatedCollective(R), ...), got {type}: {value!r}.")


def check_is_collective(collective: object) -> None:
    """Raise ``TypeError`` unless ``collective`` is a :class:`Collective` (has ``mean_``):
    a process group passed instead is the usual mistake."""
    check("collective", collective, _IS_COLLECTIVE)


def _is_group_size(value: object, bounds: dict) -> bool:
    return value is None or (is_integral(value) and value in bounds["sizes"])  # (numpy's ints too; not 2.0 or True)


def group_size_rule(allowed: str) -> Rule:
    """The rule of every backend's ``group_size``: ``None`` (the whole group) or one of
    the group sizes it averages within (the bound ``sizes``, for
    :func:`~puredist._validation.check`). ``allowed`` ends the message "Arg
    ``group_size`` 3 must ...": what the backend accepts, formatted with the bounds."""
    return Rule(_is_group_size, ValueError, "Arg ``{arg}`` {value} must " + allowed)


SUPPORTED_GROUP_SIZE = group_size_rule(  # (a collective with subgroups: DistributedCollective)
    "be a size of group the collective averages within, {sizes} (build it with DistributedCollective.with_subgroups).")


def check_group_sizes(collective: object, group_sizes: Sequence[int], *, arg: str) -> None:
    """Raise ``ValueError`` where ``collective`` (this rank a member) cannot average
    within one of ``group_sizes`` (from the argument named ``arg``); a rank outside the
    collective's group averages nothing, so has nothing to check."""
    if collective.is_member:
        check_each(arg, group_sizes, SUPPORTED_GROUP_SIZE, sizes=collective.group_sizes)


class refusing:  # (a context manager: named as contextlib.suppress is)
    """Tell the peers that this rank refuses, then raise: the checks of this rank's input
    before a collective run inside ::

        with refusing(collective, group_size=group_size, context=context):
            given = checked(tensors)  # raises TypeError or ValueError on bad input
        collective.mean_(given, group_size=group_size, context=context)

    A ``TypeError`` or ``ValueError`` leaving the block is this rank's refusal: it first
    goes through the rank check that the peers run next, over ``collective``'s group of
    ``group_size`` with ``context`` (the collective's ``refuse_on_all_ranks``, see
    :meth:`~puredist.collectives.distributed.DistributedCollective.refuse_on_all_ranks`), so that they raise
    :class:`~puredist.RankMismatchError` naming it at once instead of waiting for this
    rank until the backend's timeout; then it propagates unchanged (type, message,
    traceback). Any other exception propagates without telling anyone; a block that
    raises nothing costs one small object.

    ``group_size`` and ``context`` must be those of the peers' *next* rank check (the
    first collective of the operation refused); where the operation communicates
    nothing, no peer runs one: use no ``refusing`` then (telling would wait for peers
    that never come).

    Args:
        collective: the collective the operation runs on; one without
            ``refuse_on_all_ranks`` (one process: simulated, vmapped) tells nobody.
        group_size: the size of the group the peers check next (``None``: the whole group).
        context: that check's context: any object, formatted only when this rank
            refuses (pass a lazily formatted one where formatting costs).
    """

    __slots__ = ("collective", "context", "group_size")

    def __init__(self, collective: "Collective", *, group_size: int | None = None, context: object = "") -> None:
        self.collective = collective
        self.group_size = group_size
        self.context = context

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        refuse = getattr(self.collective, "refuse_on_all_ranks", None)
        if refuse is not None and kind is not None and issubclass(kind, (TypeError, ValueError)):
            refuse(f"{kind.__name__}: {error}", group_size=self.group_size, context=self.context)
        return False  # (the error propagates as it is)


def divides_first(dtype: torch.dtype) -> bool:
    """Whether a mean in ``dtype`` divides each value before the sum: for dtypes with
    a narrower range than fp32 (fp16), where the sum of representable values
    overflows long before their mean does."""
    return torch.finfo(dtype).max < torch.finfo(torch.float32).max


def block_mean(tensor: torch.Tensor, group_size: int) -> torch.Tensor:
    """The mean of a ``[R, *shape]`` tensor within each block of ``group_size``
    consecutive rows, broadcast back to every row of the block (a new contiguous
    tensor, every row its own memory), with the division rule of the module
    docstring. Differentiable."""
    blocks = tensor.unflatten(0, (tensor.shape[0] // group_size, group_size))
    if divides_first(tensor.dtype):
        means = (blocks / group_size).sum(dim=1, keepdim=True)
    else:
        means = blocks.sum(dim=1, keepdim=True) / group_size
    # contiguous: with one block, flatten would return a view whose rows share memory
    return means.expand_as(blocks).flatten(0, 1).contiguous()
