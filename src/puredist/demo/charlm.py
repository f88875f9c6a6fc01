"""The language task: a character-level GPT on the Python standard library's own sources.

The corpus is the ``.py`` files of the running interpreter's standard library (about
8.4M characters with CPython 3.11; nothing downloaded), less what distributions ship
apart or build per machine (:data:`SKIPPED`: the test suites, ``tkinter``, ``idlelib``,
``lib2to3``, ``distutils``, ``ensurepip``, the codec tables of ``encodings``,
``site-packages``, the build's ``_sysconfigdata``), in an order fixed by each file's
path (:func:`sources`). Its text is therefore the same on every machine with the same
CPython release, unless a distribution patched one of the files. The vocabulary is
fixed (:data:`VOCABULARY`: tab, newline and printable ASCII; any other character is
one code). The last ``HELD_OUT_FRACTION`` of the text is held out; the rest is cut
into one contiguous shard per worker, which the worker reads front to back
(:func:`sample`), so that within a pass no character is read twice.

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
HELD_OUT_FRACTION = 0.05
EVAL_WINDOWS = 256
VOCABULARY = "\x00\t\n" + "".join(chr(c) for c in range(32, 127))
"""The characters the model knows; code 0 (``"\\x00"``) stands for every other one."""
SKIPPED = frozenset({
    "site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",  # not the standard library's code
    "idlelib", "tkinter", "turtledemo", "lib2to3", "distutils", "ensurepip",  # packaged apart by some distributions
    "encodings",  # codec tables
})
"""Folders of the standard library left out of the corpus (and ``config-*``, the build's)."""
SKIPPED_FILES = ("turtle.py", "_sysconfigdata")
"""Files left out: ``turtle.py`` (packaged with ``tkinter``), ``_sysconfigdata*`` (the build's)."""


def sources(root: str | None = None) -> list[str]:
    """The corpus's files: paths relative to the standard library's folder ``root``
    (default: the running interpreter's), ordered by the SHA-256 of the path, a
    shuffle that is the same on every machine and keeps every file's place when
    another is added or removed."""
    import hashlib
    import os
    import sysconfig

    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for folder, folders, files in os.walk(root):
        folders[:] = [f for f in folders if f not in SKIPPED and not f.startswith("config-")]
        found += [os.path.relpath(os.path.join(folder, name), root) for name in files
                  if name.endswith(".py") and not name.startswith(SKIPPED_FILES)]
    return sorted(found, key=lambda path: hashlib.sha256(path.replace(os.sep, "/").encode()).hexdigest())


@functools.cache
def corpus() -> tuple[torch.Tensor, str]:
    """``(codes, vocabulary)``: the files of :func:`sources`, each ending in a newline,
    joined and encoded (uint8, an index into :data:`VOCABULARY`)."""
    import os
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    texts = []
    for path in sources(root):
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as file:
            texts.append(file.read().rstrip("\n") + "\n")
    return encode("".join(texts), VOCABULARY), VOCABULARY


def encode(text: str, vocabulary: str) -> torch.Tensor:
    """``text`` as uint8 indices into ``vocabulary`` (whose characters are ASCII, at most
    256 of them), a character it lacks as 0."""
    points = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).long()
    table = torch.zeros(128, dtype=torch.uint8)
    table[torch.tensor([ord(c) for c in vocabulary])] = torch.arange(len(vocabulary), dtype=torch.uint8)
    return torch.where(points < 128, table[points.clamp(max=127)], 0)


class Stream:
    """A worker's shard, read front to back: ``rows`` equal parts, one per window of a
    minibatch, each cut into windows of ``context + 1`` characters that do not overlap.

    Attributes:
        shard: the worker's contiguous part of the training text (uint8 codes).
        size: the windows' and minibatch's :class:`Size`.
        read: minibatches read so far (the next one is the windows at this index).
    """

    def __init__(self, shard: torch.Tensor, size: Size) -> None:
        self.shard, self.size, self.read = shard, size, 0
        self.windows_per_row = len(shard) // size.batch_size // (size.context + 1)

    def passes(self, steps: int) -> float:
        """How many times ``steps`` minibatches pass over the shard."""
        return steps / self.windows_per_row


def load(seed: int, rank: int, world_size: int, size: Size = SMALL) -> tuple[Stream, Batch]:
    """This rank's :class:`Stream` of its contiguous shard of the training text and the
    held-out batch: ``EVAL_WINDOWS`` evenly spaced windows of ``size.context``
    characters of the held-out tail (``seed`` does not change the split)."""
    codes = corpus()[0]
    split = int(len(codes) * (1 - HELD_OUT_FRACTION))
    train, tail = codes[:split], codes[split:].long()
    shard = len(train) // world_size
    starts = torch.linspace(0, len(tail) - size.context - 1, EVAL_WINDOWS).long()
    windows = torch.stack([tail[s: s + size.context + 1] for s in starts.tolist()])
    return Stream(train[rank * shard: (rank + 1) * shard], size), (windows[:, :-1], windows[:, 1:])


def sample(stream: Stream, generator: torch.Generator | None = None) -> Batch:
    """The next minibatch of ``stream``: window ``stream.read`` of each of its rows
    (characters and the ones after them), starting over at a row's end; ``generator``
    is not used (every run reads the same windows in the same order)."""
    length = stream.size.context + 1
    rows = stream.shard[: stream.size.batch_size * stream.windows_per_row * length].view(stream.size.batch_size, -1, length)
    windows = rows[:, stream.read % stream.windows_per_row].long()
    stream.read += 1
    return windows[:, :-1], windows[:, 1:]


def data_passes(steps: int, world_size: int, size: Size = SMALL) -> float:
    """The most times a worker passes over its shard in ``steps`` minibatches."""
    return load(0, 0, world_size, size)[0].passes(steps)


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
    return CharGPT(len(VOCABULARY), size)


def _task(name: str, size: Size, title: str, lr: float) -> Task:
    return Task(
        name=name,
        title=title,
        default_steps=320,
        period=16,
        warmup_steps=32,
        make_model=functools.partial(make_model, size=size),
        load=functools.partial(load, size=size),
        sample=sample,
        optimizer="adamw",
        optimizer_options={"lr": lr, "betas": (0.9, 0.95), "weight_decay": 0.01},
        data_passes=functools.partial(data_passes, size=size),
    )


TASK = _task("lm", SMALL, "a character-level GPT on the Python standard library's sources", 3e-3)
LARGE_TASK = _task("lm-large", LARGE, "a 19M-parameter character-level GPT on the Python standard library's sources", 1e-3)
