"""Bind a transform's options to its functions, keeping their names and docstrings.

The constructors (:func:`~puredist.outer_optimizer`, :func:`~puredist.zero`) check
their options once and return NamedTuples of functions; the functions are written at
module level with the options as an explicit first argument, so each can be read and
tested alone, and :func:`bound` makes the callables the NamedTuple holds.

This module must not hold state: a bound function is the function and its first
argument, nothing more.
"""

from __future__ import annotations

import functools
from typing import Callable


def bound(function: Callable, first: object) -> Callable:
    """``function`` with ``first`` as its first argument, keeping its name and docstring."""
    partial = functools.partial(function, first)
    partial.__name__, partial.__doc__ = function.__name__, function.__doc__
    return partial


def options_of(function: Callable) -> object:
    """The options a function made by :func:`bound` was bound to (its first argument)."""
    return function.args[0]
