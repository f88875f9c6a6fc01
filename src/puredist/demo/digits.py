"""The quick task: a small MLP on scikit-learn's handwritten digits (shipped inside
scikit-learn, nothing downloaded), plain SGD with momentum.

This module must not download anything: the data ships with scikit-learn.
"""

from __future__ import annotations

import torch
from torch import nn

from puredist.demo.task import Batch, Task

BATCH_SIZE = 32


def load(seed: int, rank: int, world_size: int) -> tuple[Batch, Batch]:
    """This rank's training shard and the common held-out set (20 %), as tensors."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    features = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    held_out = len(labels) // 5
    test, train = order[:held_out], order[held_out:]
    mine = train[rank::world_size]
    return (features[mine], labels[mine]), (features[test], labels[test])


def sample(train: Batch, generator: torch.Generator) -> Batch:
    """``BATCH_SIZE`` examples of the shard, drawn with replacement."""
    features, labels = train
    batch = torch.randint(len(labels), (BATCH_SIZE,), generator=generator)
    return features[batch], labels[batch]


def data_passes(steps: int, world_size: int) -> float:
    """The examples ``steps`` minibatches draw over the smallest shard's size (the most
    passes any worker makes, counting draws with replacement)."""
    from sklearn.datasets import load_digits

    examples = len(load_digits().target)
    return steps * BATCH_SIZE / ((examples - examples // 5) // world_size)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


TASK = Task(
    name="digits",
    title="an MLP on handwritten digits",
    default_steps=300,
    period=8,
    warmup_steps=16,
    make_model=make_model,
    load=load,
    sample=sample,
    optimizer="sgd",
    optimizer_options={"lr": 0.05, "momentum": 0.9},
    data_passes=data_passes,
    outer_options={"lr": 1.0, "momentum": 0.5},  # from a sweep of the outer lr and momentum (docs/benchmarks.md)
)
