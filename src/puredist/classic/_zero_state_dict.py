"""The checkpoints of :class:`~puredist.classic.ZeroRedundancyOptimizer`: what a
saved parameter state of one of torch's optimizers may hold, checked at load on every
rank before anything changes.

This module must not communicate.
"""

from __future__ import annotations

from typing import Any

import torch

_NOT_CONSOLIDATED = (
    "Optimizer state has not been consolidated on this rank. Please call "
    "`consolidate_state_dict(to={rank})` on all ranks beforehand if you meant to save the global state."
)

_KNOWN_STATE: dict[type, tuple[frozenset[str], frozenset[str]]] = {
    # class: (state fields shaped like the parameter, scalar state fields)
    torch.optim.SGD: (frozenset({"momentum_buffer"}), frozenset()),
    torch.optim.Adam: (frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}), frozenset({"step"})),
    torch.optim.AdamW: (frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}), frozenset({"step"})),
    torch.optim.Adagrad: (frozenset({"sum"}), frozenset({"step"})),
    torch.optim.Adadelta: (frozenset({"square_avg", "acc_delta"}), frozenset({"step"})),
    torch.optim.RMSprop: (frozenset({"square_avg", "momentum_buffer", "grad_avg"}), frozenset({"step"})),
    torch.optim.Rprop: (frozenset({"prev", "step_size"}), frozenset({"step"})),
    torch.optim.Adamax: (frozenset({"exp_avg", "exp_inf"}), frozenset({"step"})),
    torch.optim.NAdam: (frozenset({"exp_avg", "exp_avg_sq"}), frozenset({"step", "mu_product"})),
    torch.optim.RAdam: (frozenset({"exp_avg", "exp_avg_sq"}), frozenset({"step"})),
}
"""Per-parameter state layouts of torch's optimizers, to recognise a checkpoint of
another optimizer at load. Subclasses and other optimizers are not checked by field."""


def _check_saved_entry(entry: dict[str, Any], param: torch.Tensor, index: int, optimizer_class: type) -> None:
    """Raise ``ValueError`` unless ``entry`` can be a state of ``optimizer_class``
    for ``param`` (checked by field for torch's own optimizers)."""
    if optimizer_class not in _KNOWN_STATE:
        return
    shaped, scalars = _KNOWN_STATE[optimizer_class]
    unknown = sorted(set(entry) - shaped - scalars)
    if unknown:
        raise ValueError(
            f"Arg ``state_dict``: the state of parameter {index} has {unknown}, which "
            f"{optimizer_class.__name__} does not keep ({sorted(shaped | scalars)}): a checkpoint of another optimizer?"
        )
    for field in shaped & set(entry):
        value = entry[field]
        if isinstance(value, torch.Tensor) and value.shape != param.shape:
            raise ValueError(
                f"Arg ``state_dict``: ``{field}`` of parameter {index} has shape {tuple(value.shape)}, "
                f"the parameter {tuple(param.shape)}."
            )
