"""The per-parameter state that torch's optimizers keep, and what a load into one is
checked against before anything changes (:func:`check_loadable`): the checkpoints of
:class:`~puredist.classic.ZeroRedundancyOptimizer` and
:class:`~puredist.classic.PostLocalSGDOptimizer`, whose local optimizers are torch's.

This module must not change an optimizer or communicate: it reads a state dict.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from puredist._inputs import check_saved_entries
from puredist._validation import Rule, check


class _Kept(NamedTuple):
    """The state one of torch's optimizers keeps per parameter once it has stepped it.

    Attributes:
        shaped: the fields shaped like the parameter.
        scalars: the scalar fields.
        settings: ``(field, setting)``: a field kept only where its group's
            ``setting`` is true (Adam's ``max_exp_avg_sq`` with ``amsgrad``).
    """

    shaped: frozenset[str]
    scalars: frozenset[str] = frozenset({"step"})
    settings: tuple[tuple[str, str], ...] = ()

    def fields(self, group: dict[str, Any]) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
        """``(shaped, scalars, kept)`` for a parameter of ``group`` (its settings): what
        :func:`~puredist._inputs.check_saved_entries` reads; ``kept``: the fields its
        state holds all of once stepped."""
        dropped = {field for field, setting in self.settings if not group.get(setting)}
        return self.shaped, self.scalars, (self.shaped | self.scalars) - dropped


_ADAM = _Kept(frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}), settings=(("max_exp_avg_sq", "amsgrad"),))
_KEPT: dict[type, _Kept] = {  # as torch 2.13's optimizers keep them after a step
    torch.optim.SGD: _Kept(frozenset({"momentum_buffer"}), frozenset(), (("momentum_buffer", "momentum"),)),
    torch.optim.Adam: _ADAM,
    torch.optim.AdamW: _ADAM,
    torch.optim.Adagrad: _Kept(frozenset({"sum"})),
    torch.optim.Adadelta: _Kept(frozenset({"square_avg", "acc_delta"})),
    torch.optim.RMSprop: _Kept(frozenset({"square_avg", "momentum_buffer", "grad_avg"}),
                               settings=(("momentum_buffer", "momentum"), ("grad_avg", "centered"))),
    torch.optim.Rprop: _Kept(frozenset({"prev", "step_size"})),
    torch.optim.Adamax: _Kept(frozenset({"exp_avg", "exp_inf"})),
    torch.optim.NAdam: _Kept(frozenset({"exp_avg", "exp_avg_sq"}), frozenset({"step", "mu_product"})),
    torch.optim.RAdam: _Kept(frozenset({"exp_avg", "exp_avg_sq"})),
}
"""Per-parameter state of torch's optimizers, to recognise at a load a checkpoint of
another optimizer, or one lacking a field (a step would raise ``KeyError`` there).
Subclasses and other optimizers are not checked by field."""

_GROUPS = (  # v: (saved param groups, this optimizer's); torch's messages
    Rule(lambda v, b: len(v[0]) == len(v[1]), ValueError, "loaded state dict has a different number of parameter groups"),
    Rule(lambda v, b: all(len(s["params"]) == len(g["params"]) for s, g in zip(*v)), ValueError,
         "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"),
)


def check_loadable(state_dict: dict[str, Any], param_groups: Sequence[dict[str, Any]], optimizer_class: type) -> None:
    """Raise ``ValueError`` unless an ``optimizer_class`` over ``param_groups`` can load
    ``state_dict`` (``torch.optim``'s format): as many groups, each of as many
    parameters (torch's messages), and, where the class is one of torch's, every saved
    parameter entry fits its parameter under its saved group's settings
    (:func:`~puredist._inputs.check_saved_entries`: no foreign field, none missing, the
    shapes). Every entry is checked, so every rank given the same dict decides alike."""
    check("state_dict", (state_dict["param_groups"], param_groups), *_GROUPS)
    check_saved_entries(_entries(state_dict, param_groups, _KEPT.get(optimizer_class)), optimizer_class.__name__)


def _entries(state_dict: dict[str, Any], param_groups: Sequence[dict[str, Any]], kept: _Kept | None) -> list[tuple]:
    """``(saved entry, parameter, fields)`` of every parameter, numbered across the
    groups (an absent entry: ``{}``); none where ``kept`` is ``None`` (not checked)."""
    if kept is None:
        return []
    return [(state_dict["state"].get(saved_id) or {}, param, kept.fields(saved))
            for saved, group in zip(state_dict["param_groups"], param_groups)
            for saved_id, param in zip(saved["params"], group["params"])]
