"""The lossy codes of compressed averaging: a :class:`Compressor` turns a flat fp32
tensor into a small payload and back (block-wise int8 and 4-bit, top-k).

This module must not communicate or keep state between calls: a code is two pure
functions of a tensor.
"""

import functools
import math
from typing import Callable, NamedTuple

import torch

from puredist._docs import fields_documented
from puredist._validation import EVEN, FRACTION, INSTANCE, POSITIVE_INT, check

Payload = tuple[torch.Tensor, ...]


@fields_documented
class Compressor(NamedTuple):
    """A lossy code for flat fp32 tensors.

    Attributes:
        name: what it is, with its settings (part of the rank check).
        encode: ``encode(x) -> payload`` for a 1-D fp32 tensor; the payload's tensor
            shapes depend only on ``x.numel()``.
        decode: ``decode(payload, numel) -> x'``, a 1-D fp32 tensor; non-finite
            somewhere where the payload's floating-point tensors are NaN (how a chunk's
            owner refuses, :mod:`puredist.compression.phases`).
    """

    name: str
    encode: Callable[[torch.Tensor], Payload]
    decode: Callable[[Payload, int], torch.Tensor]


def _blocks(x: torch.Tensor, block_size: int, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` zero-padded into rows of ``block_size``, and each row's scale divisor. A
    block longer than ``x`` shrinks to ``x`` (rounded up to a ``multiple``): the same
    one scale, without sending the padding."""
    block = min(block_size, max(multiple, -(-x.numel() // multiple) * multiple))
    padded = torch.nn.functional.pad(x, (0, -x.numel() % block)).view(-1, block)
    return padded, padded.abs().amax(dim=1, keepdim=True)


def _quantized(x: torch.Tensor, block_size: int, levels: int, largest: float,
               multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Integers in ``[-levels, levels]`` per block and the fp32 scales: a block holding
    an inf or NaN has a non-finite scale, so that it decodes non-finite (clamped to
    ``largest``, an inf became ``levels`` steps and its block-mates 0: a finite mean
    hid it)."""
    padded, absmax = _blocks(x, block_size, multiple)
    # (largest: _largest_scale(levels); absmax = FLT_MAX: 127 * scale is inf)
    scales = torch.where(torch.isfinite(absmax), (absmax / levels).clamp(max=largest), absmax)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(padded / safe).clamp(-levels, levels), scales


@functools.cache
def _largest_scale(levels: int) -> float:
    """The largest fp32 scale whose ``levels`` multiple is finite in fp32 (decoding
    multiplies by it: ``FLT_MAX / levels`` rounded to fp32 may round up)."""
    scale = torch.tensor(torch.finfo(torch.float32).max / levels, dtype=torch.float32)
    while not torch.isfinite(scale * levels):
        scale = torch.nextafter(scale, torch.zeros(()))
    return scale.item()


def int8_blocks(block_size: int = 128) -> Compressor:
    """Block-wise absmax int8: ``round(x / scale)`` with ``scale = absmax / 127``.

    Raises:
        ValueError: ``block_size < 1``.
    """
    check("block_size", block_size, POSITIVE_INT)
    largest = _largest_scale(127)  # (here, not in the step: a compiled step traces no host loop)

    def encode(x: torch.Tensor) -> Payload:
        q, scales = _quantized(x, block_size, 127, largest)
        return q.to(torch.int8), scales.flatten()

    def decode(payload: Payload, numel: int) -> torch.Tensor:
        q, scales = payload
        return (q.float() * scales[:, None]).flatten()[:numel]

    return Compressor(f"int8_blocks({block_size})", encode, decode)


def int4_blocks(block_size: int = 128) -> Compressor:
    """Block-wise absmax 4-bit: integers in ``[-7, 7]``, two a byte.

    Raises:
        ValueError: ``block_size`` not a positive even int.
    """
    check("block_size", block_size, POSITIVE_INT, EVEN, why="two values a byte")
    largest = _largest_scale(7)

    def encode(x: torch.Tensor) -> Payload:
        q, scales = _quantized(x, block_size, 7, largest, multiple=2)
        nibbles = (q + 8).to(torch.uint8).view(-1, 2)
        return nibbles[:, 0] | (nibbles[:, 1] << 4), scales.flatten()

    def decode(payload: Payload, numel: int) -> torch.Tensor:
        packed, scales = payload
        block = 2 * packed.numel() // max(scales.numel(), 1)  # (a block each scale)
        nibbles = torch.stack((packed & 15, packed >> 4), dim=1).view(-1, max(block, 2))
        return ((nibbles.float() - 8) * scales[:, None]).flatten()[:numel]

    return Compressor(f"int4_blocks({block_size})", encode, decode)


def top_k(fraction: float) -> Compressor:
    """The ``ceil(fraction * n)`` entries of largest magnitude (values fp32, indices
    int32); ties broken by ``torch.topk``.

    Raises:
        ValueError: ``fraction`` not in ``(0, 1]``.
    """
    check("fraction", fraction, FRACTION)

    def encode(x: torch.Tensor) -> Payload:
        k = max(1, math.ceil(round(fraction * x.numel(), 9))) if x.numel() else 0  # 0.07 * 100 is 7, not 8
        indices = x.abs().topk(k, sorted=False).indices
        return x[indices], indices.to(torch.int32)

    def decode(payload: Payload, numel: int) -> torch.Tensor:
        values, indices = payload
        return values.new_zeros(numel).index_put_((indices.long(),), values)  # (under vmap: a row per replica)

    return Compressor(f"top_k({fraction})", encode, decode)


IS_COMPRESSOR = {"kind": Compressor, "a": "a puredist Compressor (e.g. int8_blocks())"}
"""The bounds of the rule ``INSTANCE`` (or ``INSTANCE_OR_NONE``) for a compressor."""


def check_compressor(compressor: object) -> None:
    """Raise ``TypeError`` unless ``compressor`` is a :class:`Compressor`."""
    check("compressor", compressor, INSTANCE, **IS_COMPRESSOR)
