"""What a DiLoCo study varies, as the demo's options: the period ``H``, the warm-up,
the inner and outer learning rates, the outer momentum, the codec's block size and the
sparse codec's values per chunk.

:class:`Knobs` holds them, ``None`` meaning the task's own value (or the demo's
default); :func:`knobs_task` applies the inner ones to a :class:`~puredist.demo.task.Task`
(every algorithm reads ``H``, the warm-up and the inner optimizer from it: DDP and
ZeRO too, so that a study changes one thing at a time) and :func:`outer_options`
gives the outer optimizer's. The ranges of single values are argparse's (the types
of :data:`KNOB_OPTIONS`); what depends on several options is checked where it is
decided, by building the algorithms asked for in the launcher, before any worker
starts (:func:`puredist.demo.training.refusal`).

This module must not train: it only says what the workers train with.
"""

from __future__ import annotations

import argparse
import math
from typing import NamedTuple

from puredist.demo import digits
from puredist.demo.task import Task

OUTER_OPTIONS = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
"""DiLoCo's outer Nesterov SGD, as the paper runs it."""
SPARSE_OUTER_OPTIONS = {"lr": 1.5, "momentum": 0.0, "nesterov": False}
"""``diloco_sparse``'s outer SGD, SparseLoCo's recipe: no momentum (each rank's error
feedback stands in for it) and a step above 1 (a value one rank of ``W`` sent counts
``1/W`` in the mean of the sparse payloads)."""
BLOCK_SIZE = 64
"""Values per fp32 scale of the int8, 4-bit and 2-bit codecs."""
TOP_K = 64
"""Values ``diloco_sparse`` sends of each chunk of 4096 (1.56 %, SparseLoCo's and Covenant-72B's)."""


class Knobs(NamedTuple):
    """The study's options; ``None``: the task's value (or the demo's default).

    Attributes:
        sync_every: ``H``, local steps between synchronizations (periodic, hierarchical,
            every DiLoCo variant).
        warmup_steps: local steps before the first synchronization.
        inner_lr: the inner optimizer's learning rate (every algorithm's).
        outer_lr, outer_momentum: DiLoCo's outer Nesterov SGD.
        block_size: values per scale of the int8, 4-bit and 2-bit payloads.
        top_k: values ``diloco_sparse`` sends of each chunk of 4096.
    """

    sync_every: int | None = None
    warmup_steps: int | None = None
    inner_lr: float | None = None
    outer_lr: float | None = None
    outer_momentum: float | None = None
    block_size: int | None = None
    top_k: int | None = None


def knobs_task(task: Task, knobs: Knobs) -> Task:
    """``task`` with the knobs that are given in place of its period, warm-up and
    inner learning rate."""
    options = task.optimizer_options if knobs.inner_lr is None else {**task.optimizer_options, "lr": knobs.inner_lr}
    return task._replace(
        period=task.period if knobs.sync_every is None else knobs.sync_every,
        warmup_steps=task.warmup_steps if knobs.warmup_steps is None else knobs.warmup_steps,
        optimizer_options=options,
    )


def outer_options(knobs: Knobs, task: Task, sparse: bool = False) -> dict:
    """The outer SGD's keywords: :data:`SPARSE_OUTER_OPTIONS` for ``diloco_sparse``
    (``sparse``), else :data:`OUTER_OPTIONS` then ``task``'s own
    (:attr:`Task.outer_options`); then the knobs given; Nesterov where there is a
    momentum (without one, plain SGD on the pseudo-gradient)."""
    defaults = SPARSE_OUTER_OPTIONS if sparse else {**OUTER_OPTIONS, **(task.outer_options or {})}
    given = {"lr": knobs.outer_lr, "momentum": knobs.outer_momentum}
    options = {**defaults, **{k: v for k, v in given.items() if v is not None}}
    return {**options, "nesterov": options["momentum"] > 0}


def block_size(knobs: Knobs) -> int:
    """The int8 and 4-bit codecs' values per scale: the knob, else :data:`BLOCK_SIZE`."""
    return BLOCK_SIZE if knobs.block_size is None else knobs.block_size


def top_k(knobs: Knobs) -> int:
    """``diloco_sparse``'s values per chunk of 4096: the knob, else :data:`TOP_K`."""
    return TOP_K if knobs.top_k is None else knobs.top_k


def _ranged(kind: type, low: float, high: float | None, *, low_open: bool = False, even: bool = False, what: str):
    """An argparse ``type``: a finite ``kind`` value from ``low`` (excluded if
    ``low_open``) up to ``high`` (excluded), even if asked; else argparse's one-line
    error (``argument --x: must be <what>, got <value>``, exit 2)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            expected = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        bad = (not math.isfinite(value) or (value <= low if low_open else value < low)
               or (high is not None and value >= high) or (even and value % 2))
        if bad:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    return parse


_STEPS = "a whole number of steps, at least "
_RATE = "a finite number above 0"
KNOB_OPTIONS = {
    "--sync-every": (_ranged(int, 1, None, what=_STEPS + "1"), "H",
                     "local steps between synchronizations of periodic, hierarchical and every DiLoCo variant "
                     "(default: the task's, 8 for digits, 16 for lm)"),
    "--warmup-steps": (_ranged(int, 0, None, what=_STEPS + "0"), "STEPS",
                       "local steps before the first synchronization (default: the task's, 16 for digits, 32 for lm)"),
    "--inner-lr": (_ranged(float, 0.0, None, low_open=True, what=_RATE), "LR",
                   "the inner optimizer's learning rate, for every algorithm (default: the task's)"),
    "--outer-lr": (_ranged(float, 0.0, None, low_open=True, what=_RATE), "LR",
                   f"DiLoCo's outer Nesterov SGD learning rate (default: the task's, {digits.TASK.outer_options['lr']} "
                   f"for digits, {OUTER_OPTIONS['lr']} for lm as in the paper)"),
    "--outer-momentum": (_ranged(float, 0.0, 1.0, what="a number in [0, 1)"), "M",
                         f"DiLoCo's outer Nesterov momentum (default: the task's, "
                         f"{digits.TASK.outer_options['momentum']} for digits, {OUTER_OPTIONS['momentum']} for lm; 0: "
                         "plain SGD)"),
    "--block-size": (_ranged(int, 2, None, even=True, what="an even whole number, at least 2 (4-bit packs two a byte)"),
                     "N", f"values per fp32 scale of diloco_int8's, diloco_int4's and diloco_int2's payloads (a multiple "
                          f"of 4 for diloco_int2; default {BLOCK_SIZE})"),
    "--top-k": (_ranged(int, 1, 4097, what="a whole number from 1 to 4096"), "K",
                f"values diloco_sparse sends of each chunk of 4096 (default {TOP_K}: 1.56 %%)"),
}
"""Each knob's option, in :class:`Knobs`' field order: its argparse ``type`` (the range
it is checked against), metavar and help."""
