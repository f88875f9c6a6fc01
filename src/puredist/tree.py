"""Pytree utilities with puredist's policy: the one place puredist touches optree.

Public, so that a user's own optimizer or transform flattens parameter trees exactly
as puredist's functions do (``from puredist.tree import tree_flatten, tree_map``).
Every tree operation in the package goes through this module so that one policy
holds everywhere:

- ``dict`` keys keep their insertion order (as ``nn.Module.named_parameters()`` and
  torch's own pytree do), not optree's default sorted order. Two ranks that build
  their parameter dict the same way therefore flatten it in the same order, and the
  order matches the order torch's averagers use.
- ``None`` is an empty node, never a leaf: a ``None`` in a parameter tree (for
  example a missing bias) is skipped by every operation.

Under ``torch.compile`` the same policy is kept with ``torch.utils._pytree``, which
Dynamo traces without a graph break (optree's insertion-order switch is a lock it
cannot enter, and without it optree sorts dict keys).
"""

from __future__ import annotations

from typing import Any, Callable

import optree
import torch
import torch.utils._pytree as torch_pytree

from puredist._layout import PLAIN_TYPES

_NAMESPACE = "puredist"

PyTree = Any

__all__ = ["PyTree", "tree_flatten", "tree_leaves", "tree_map", "tree_unflatten", "clone_leaves", "vmap_axes"]


class _TracedSpec:
    """The spec of a tree flattened while compiling: torch's spec, in which ``None``
    is a leaf, and which of its leaves are kept."""

    def __init__(self, spec: torch_pytree.TreeSpec, kept: list[bool]) -> None:
        self.spec, self.kept = spec, kept

    def flatten_up_to(self, other: PyTree) -> list[Any]:
        """``other``'s subtrees where this tree has leaves (e.g. per-parameter states)."""
        try:
            leaves = self.spec.flatten_up_to(other)
        except (ValueError, TypeError) as error:  # (no tensor formatted: the compiler cannot)
            raise ValueError(f"Expected a tree of structure {self.spec}, got a {type(other).__name__} of another "
                             "structure.") from error
        if any(leaf is not None for leaf, kept in zip(leaves, self.kept) if not kept):  # as eager: None matches None
            raise ValueError(f"Expected a tree of structure {self.spec}, got one with a value where it has None.")
        return [leaf for leaf, kept in zip(leaves, self.kept) if kept]

    def unflatten(self, leaves: list[Any]) -> PyTree:
        remaining = iter(leaves)
        return torch_pytree.tree_unflatten([next(remaining) if kept else None for kept in self.kept], self.spec)


def tree_flatten(tree: PyTree) -> tuple[list[Any], Any]:
    """Flatten ``tree`` into its leaves (insertion order, ``None`` skipped) and spec."""
    if torch.compiler.is_compiling():
        leaves, spec = torch_pytree.tree_flatten(tree)
        kept = [leaf is not None for leaf in leaves]
        return [leaf for leaf in leaves if leaf is not None], _TracedSpec(spec, kept)
    kind = type(tree)
    if (kind is list or kind is tuple) and set(map(type, tree)) <= PLAIN_TYPES:
        return list(tree), _flat_spec(kind, len(tree))
    if kind is dict and set(map(type, tree)) <= _STR and set(map(type, tree.values())) <= PLAIN_TYPES:
        return list(tree.values()), _flat_spec(dict, tuple(tree))
    with optree.dict_insertion_ordered(True, namespace=_NAMESPACE):
        return optree.tree_flatten(tree, none_is_leaf=False, namespace=_NAMESPACE)


_STR = {str}  # (keys that are equal only when they are the same key: 1, 1.0 and True are not)
_FLAT_SPECS: dict[tuple, optree.PyTreeSpec] = {}
_FLAT_SPECS_KEPT = 64


def _flat_spec(kind: type, shape: int | tuple) -> optree.PyTreeSpec:
    """optree's spec of a ``list``/``tuple`` of ``shape`` leaves or a ``dict`` with the
    string keys ``shape``, each entry a tensor: what :func:`tree_flatten` returns for the
    common parameter containers without optree's look at every leaf's type (a
    parameter list's spec depends on its length only). The last 64 are kept."""
    key = (kind, shape)
    spec = _FLAT_SPECS.get(key)
    if spec is None:
        if len(_FLAT_SPECS) >= _FLAT_SPECS_KEPT:
            del _FLAT_SPECS[next(iter(_FLAT_SPECS))]
        stand_in = dict.fromkeys(shape, 0) if kind is dict else kind([0] * shape)
        with optree.dict_insertion_ordered(True, namespace=_NAMESPACE):
            spec = _FLAT_SPECS[key] = optree.tree_structure(stand_in, none_is_leaf=False, namespace=_NAMESPACE)
    return spec


def tree_leaves(tree: PyTree) -> list[Any]:
    """The leaves of ``tree`` in the order :func:`tree_flatten` gives them."""
    return tree_flatten(tree)[0]


def tree_unflatten(spec: Any, leaves: list[Any]) -> PyTree:
    """Rebuild a tree of the structure ``spec`` (from :func:`tree_flatten`) from ``leaves``."""
    if isinstance(spec, _TracedSpec):
        return spec.unflatten(leaves)
    return optree.tree_unflatten(spec, leaves)


def tree_map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """Apply ``fn`` leaf-wise over ``tree`` (and ``rest``, of the same structure)."""
    leaves, spec = tree_flatten(tree)
    others = [spec.flatten_up_to(other) for other in rest]
    return tree_unflatten(spec, [fn(*args) for args in zip(leaves, *others)])


def clone_leaves(leaves: list[Any]) -> list[Any]:
    """Fresh tensors with the leaves' values (detached, ``requires_grad`` kept): the
    outputs of the pure functions, which never write into their inputs."""
    return [leaf.detach().clone().requires_grad_(leaf.requires_grad) for leaf in leaves]


def vmap_axes(tree: PyTree, axis: int = 0) -> PyTree:
    """``tree``'s structure with ``axis`` for each tensor and ``None`` for everything
    else (Python numbers, ``None``): the ``in_dims``/``out_dims`` that
    ``torch.func.vmap`` needs for a tree holding static data (an averager's step), or
    a starting point for unmapping some tensors, e.g. an optimizer's step counts:
    ``axes = [a._replace(step=None) for a in vmap_axes(state)]``, then
    ``vmap(opt.update, in_dims=(0, 0, axes), out_dims=(0, axes))``.

    A transform's state keeps one structure from ``init`` on (an averager's, DiLoCo's),
    so the axes of one replica's ``init`` serve every step, and make the stacked
    state in one line (the step, a Python int, unmapped)::

        axes = vmap_axes(diloco.init(params_of_one_replica))
        state = vmap(diloco.init, out_dims=axes)(stacked_params)
        step = vmap(lambda p, s: diloco.update(p, s, collective=VmapCollective(R)),
                    in_dims=(0, axes), out_dims=(0, axes))  # step 0 included"""
    return torch_pytree.tree_map(lambda leaf: axis if isinstance(leaf, torch.Tensor) else None, tree)
