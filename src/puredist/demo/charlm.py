"""The language task: a character-level GPT on CPython's own documentation.

The corpus is ``pydoc_data.topics`` (the text ``help()`` shows, shipped with every
CPython: about 465k characters of English prose and code; nothing downloaded), its
topics joined in key order. The last tenth is held out; the rest is cut into one
contiguous shard per worker. The vocabulary is the corpus's own characters.

The model is a decoder-only transformer: token and learned position embeddings,
pre-norm blocks of causal multi-head self-attention
(:func:`torch.nn.functional.scaled_dot_product_attention`) and a GELU MLP, a final
LayerNorm and a linear head. Two sizes: ``lm`` (``SMALL``, about 0.43M
parameters, minutes on a CPU) and ``lm-large`` (``LARGE``, about 19M parameters
on windows four times longer: a size worth a GPU). The inner optimizer is AdamW, as
in DiLoCo.

This module must not download anything: the corpus ships with Python.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import nn

from puredist.demo.task import Batch, Task



class Size(NamedTuple):
    """A model's size and the windows it trains on.

    Attributes:
        context: characters per window (the positions the model has).
        width, layers, heads: the transformer's.
        batch_size: windows per minibatch.
    """

    context: int
    width: int
    layers: int
    heads: int
    batch_size: int


SMALL = Size(context=64, width=128, layers=2, heads=4, batch_size=16)
LARGE = Size(context=256, width=512, layers=6, heads=8, batch_size=32)
HELD_OUT_FRACTION = 0.1
EVAL_WINDOWS = 64


@functools.cache
def corpus() -> tuple[str, str]:
    """``(text, vocabulary)``: the joined topics and their sorted distinct characters."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[key] for key in sorted(topics))
    return text, "".join(sorted(set(text)))


def encode(text: str, vocabulary: str) -> torch.Tensor:
    index = {char: i for i, char in enumerate(vocabulary)}
    return torch.tensor([index[char] for char in text], dtype=torch.int64)


def load(seed: int, rank: int, world_size: int, size: Size = SMALL) -> tuple[torch.Tensor, Batch]:
    """This rank's contiguous shard of the training text (encoded) and the held-out
    batch: ``EVAL_WINDOWS`` evenly spaced windows of ``size.context`` characters of
    the held-out tail (``seed`` does not change the split)."""
    text, vocabulary = corpus()
    codes = encode(text, vocabulary)
    split = int(len(codes) * (1 - HELD_OUT_FRACTION))
    train, tail = codes[:split], codes[split:]
    shard = len(train) // world_size
    starts = torch.linspace(0, len(tail) - size.context - 1, EVAL_WINDOWS).long()
    windows = torch.stack([tail[s: s + size.context + 1] for s in starts.tolist()])
    return train[rank * shard: (rank + 1) * shard], (windows[:, :-1], windows[:, 1:])


def sample(train: torch.Tensor, generator: torch.Generator, size: Size = SMALL) -> Batch:
    """``size.batch_size`` random windows of the shard: characters and the ones after them."""
    starts = torch.randint(len(train) - size.context, (size.batch_size,), generator=generator)
    windows = torch.stack([train[s: s + size.context + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class CharGPT(nn.Module):
    """``(batch, length) character codes -> (batch, length, vocabulary) logits`` of the
    next character; position ``t`` sees positions ``<= t`` only."""

    def __init__(self, vocabulary: int, size: Size = SMALL) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocabulary, size.width)
        self.positions = nn.Embedding(size.context, size.width)
        self.blocks = nn.Sequential(*(Block(size.width, size.heads) for _ in range(size.layers)))
        self.norm = nn.LayerNorm(size.width)
        self.head = nn.Linear(size.width, vocabulary)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(codes.shape[1], device=codes.device)
        return self.head(self.norm(self.blocks(self.tokens(codes) + self.positions(positions))))


def make_model(seed: int, size: Size = SMALL) -> nn.Module:
    torch.manual_seed(seed)
    return CharGPT(len(corpus()[1]), size)


def _task(name: str, size: Size, title: str, lr: float) -> Task:
    return Task(
        name=name,
        title=title,
        default_steps=320,
        period=16,
        warmup_steps=32,
        make_model=functools.partial(make_model, size=size),
        load=functools.partial(load, size=size),
        sample=functools.partial(sample, size=size),
        optimizer="adamw",
        optimizer_options={"lr": lr, "betas": (0.9, 0.95), "weight_decay": 0.01},
    )


TASK = _task("lm", SMALL, "a character-level GPT on CPython's documentation", 3e-3)
LARGE_TASK = _task("lm-large", LARGE, "a 19M-parameter character-level GPT on CPython's documentation", 1e-3)
