"""What the demo trains: a :class:`Task` bundles a model, its data and its optimizer.

The training loop (:mod:`puredist.demo.training`) is the same for every task: each
worker draws minibatches from its own shard, the loss is the cross-entropy of the
model's logits against integer targets (``logits.flatten(0, -2)`` against
``targets.flatten()``: a class per example for digits, a next character per position
for the language model), and the averaged model is evaluated on a held-out set common
to all workers.

This module must not know an algorithm: the training loop chooses how to synchronize.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import nn
from torch.func import functional_call

Batch = tuple[torch.Tensor, torch.Tensor]
"""``(inputs, integer targets)``."""


class Task(NamedTuple):
    """A demo workload.

    Attributes:
        name: the ``--task`` value.
        title: what is trained, for the plot's title and the banner.
        default_steps: training steps per algorithm unless ``--steps`` says otherwise.
        period: how many steps local methods run between averagings (DiLoCo's ``H``).
        warmup_steps: steps of purely local training before the local methods' first
            synchronization (DDP and ZeRO synchronize from the first step).
        make_model: ``seed -> nn.Module``; the same seed gives the same model on every rank.
        load: ``(seed, rank, world_size) -> (train, test)``: this rank's training shard
            (opaque to the loop) and the common held-out :data:`Batch`.
        sample: ``(train, generator) -> Batch``: one minibatch of this rank's shard.
        optimizer: the inner optimizer's name in both ``torch.optim`` and
            :mod:`puredist.optim` (``"SGD"``/``sgd``, ``"AdamW"``/``adamw``).
        optimizer_options: its hyper-parameters, the same keywords for both.
        data_passes: ``(steps, world_size) -> float``: the most times a worker passes
            over its shard in ``steps`` minibatches.
        outer_options: DiLoCo's outer Nesterov SGD's ``lr`` and ``momentum`` where the
            task tunes them (None: the paper's, :data:`puredist.demo.knobs.OUTER_OPTIONS`).
    """

    name: str
    title: str
    default_steps: int
    period: int
    warmup_steps: int
    make_model: Callable[[int], nn.Module]
    load: Callable[[int, int, int], tuple[Any, Batch]]
    sample: Callable[[Any, torch.Generator], Batch]
    optimizer: str
    optimizer_options: dict[str, Any]
    data_passes: Callable[[int, int], float]
    outer_options: dict[str, float] | None = None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats) over every target, whatever the leading dimensions."""
    return nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())


def held_out(model: nn.Module, params: dict[str, torch.Tensor], test: Batch) -> tuple[float, float]:
    """``(mean cross-entropy, accuracy)`` of ``model`` with ``params`` on ``test``;
    accuracy is the fraction of targets that are the logits' argmax."""
    inputs, targets = test
    with torch.no_grad():
        logits = functional_call(model, params, (inputs,))
    loss = cross_entropy(logits, targets).item()
    return loss, (logits.argmax(dim=-1) == targets).float().mean().item()
