"""The one place puredist touches optree.

Every tree operation in the package goes through this module so that one policy
holds everywhere:

- ``dict`` keys keep their insertion order (as ``nn.Module.named_parameters()`` and
  torch's own pytree do), not optree's default sorted order. Two ranks that build
  their parameter dict the same way therefore flatten it in the same order, and the
  order matches the order torch's averagers use.
- ``None`` is an empty node, never a leaf: a ``None`` in a parameter tree (for
  example a missing bias) is skipped by every operation.
"""

from __future__ import annotations

from typing import Any, Callable

import optree

_NAMESPACE = "puredist"

PyTree = Any


def tree_flatten(tree: PyTree) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` into its leaves (insertion order, ``None`` skipped) and spec."""
    with optree.dict_insertion_ordered(True, namespace=_NAMESPACE):
        return optree.tree_flatten(tree, none_is_leaf=False, namespace=_NAMESPACE)


def tree_leaves(tree: PyTree) -> list[Any]:
    """The leaves of ``tree`` in the order :func:`tree_flatten` gives them."""
    return tree_flatten(tree)[0]


def tree_unflatten(spec: optree.PyTreeSpec, leaves: list[Any]) -> PyTree:
    """Rebuild a tree of the structure ``spec`` from ``leaves``."""
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
