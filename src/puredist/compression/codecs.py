"""The lossy codes of compressed averaging: a :class:`Compressor` turns a flat fp32
tensor into a small payload and back (block-wise int8, 4-bit and 2-bit, top-k, and
SparseLoCo's chunked top-k with a sign bit a value).

This module must not communicate or keep state between calls: a code is two pure
functions of a tensor.
"""

import functools
import math
from typing import Callable, NamedTuple

import torch

from puredist._docs import fields_documented
from puredist._validation import EVEN, FRACTION, INSTANCE, MULTIPLE, POSITIVE_INT, RANGE, check

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
        gathered: how the payloads are averaged: ``False``, in two phases over chunk
            owners (the owner's mean compressed again); ``True``, every rank's whole
            payload gathered by every rank and the decoded payloads averaged (one
            phase, ``W - 1`` payloads sent a rank: for sparse payloads, whose mean is
            not sparse and would lose most of itself compressed again).
    """

    name: str
    encode: Callable[[torch.Tensor], Payload]
    decode: Callable[[Payload, int], torch.Tensor]
    gathered: bool = False


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
def _largest_scale(levels: float) -> float:
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


def int2_blocks(block_size: int = 128) -> Compressor:
    """Block-wise absmax 2-bit: 4 levels, ``(q - 1.5) * scale`` for ``q`` in ``0..3``
    with ``scale = absmax / 1.5`` (no zero: a value is within half a step, ``absmax /
    3``, of its level), four a byte.

    Raises:
        ValueError: ``block_size`` not a positive multiple of 4.
    """
    check("block_size", block_size, POSITIVE_INT, MULTIPLE, of=4, why="four values a byte")
    largest = _largest_scale(1.5)

    def encode(x: torch.Tensor) -> Payload:
        padded, absmax = _blocks(x, block_size, 4)
        scales = torch.where(torch.isfinite(absmax), (absmax / 1.5).clamp(max=largest), absmax)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = (torch.floor(padded / safe) + 2).clamp(0, 3).to(torch.uint8).view(-1, 4)
        packed = codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)  # value i at bits 2i
        return packed, scales.flatten()

    def decode(payload: Payload, numel: int) -> torch.Tensor:
        packed, scales = payload
        codes = torch.stack([(packed >> shift) & 3 for shift in (0, 2, 4, 6)], dim=1).view(max(scales.numel(), 1), -1)
        return ((codes.float() - 1.5) * scales[:, None]).flatten()[:numel]

    return Compressor(f"int2_blocks({block_size})", encode, decode)


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


def _bits_packed(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers below ``2 ** bits`` (1-D), ``bits`` each, packed into bytes
    (uint8, little-endian: value ``i``'s bit ``b`` is bit ``i * bits + b`` of the stream)."""
    shifts = torch.arange(bits, device=values.device)
    stream = ((values.long().unsqueeze(-1) >> shifts) & 1).flatten()
    stream = torch.nn.functional.pad(stream, (0, -stream.numel() % 8)).view(-1, 8)
    return (stream << torch.arange(8, device=values.device)).sum(-1).to(torch.uint8)


def _bits_unpacked(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` values of :func:`_bits_packed`'s ``packed`` (int64)."""
    stream = ((packed.long().unsqueeze(-1) >> torch.arange(8, device=packed.device)) & 1).flatten()
    return (stream[: count * bits].view(count, bits) << torch.arange(bits, device=packed.device)).sum(-1)


class _Chunks(NamedTuple):
    """How :func:`chunked_top_k` cuts ``numel`` values: ``count`` chunks of ``length``
    (the last zero-padded), ``kept`` values sent from each, their indices in ``bits`` bits."""

    count: int
    length: int
    kept: int
    bits: int


def _chunks(numel: int, k: int, chunk_size: int) -> _Chunks:
    count = -(-numel // chunk_size)
    length = -(-numel // max(count, 1))
    kept = min(length, -(-k * length // chunk_size))
    return _Chunks(count, length, kept, max(1, (length - 1).bit_length()))


def chunked_top_k(k: int = 64, chunk_size: int = 4096) -> Compressor:
    """SparseLoCo's sparse payload (Sarfi et al. 2025), averaged by gathering.

    The flat tensor is cut into ``ceil(n / chunk_size)`` chunks of equal length (at
    most ``chunk_size``; the last zero-padded); each sends its ``k`` values of largest
    magnitude (``ceil(k * length / chunk_size)`` from a shorter chunk): their indices
    within the chunk, ``ceil(log2(length))`` bits each (at least 1), in order of
    magnitude; a sign bit each; and two fp32 magnitudes, the mean magnitude of the
    larger half of them and of the rest. A zero among them (a chunk with fewer non-zero
    values than it keeps) is sent as the chunk's first index again and decodes to 0;
    the halves are of the non-zero values. A value decodes to its sign times its half's mean: 4 levels, 2
    bits of value (its half is its place in the order), 13 bits a value with 12-bit
    indices (``chunk_size`` 4096) and 8 bytes a chunk: at ``k = 64`` (1.56 %), 1/146 of
    fp32's bytes. A chunk holding an inf or NaN decodes non-finite there (its
    magnitudes are).

    Averaged by gathering (:attr:`Compressor.gathered`): every rank decodes every
    rank's payload, as SparseLoCo does; compressed again by a chunk's owner, the mean
    of ``W`` sparse payloads, up to ``W k`` values a chunk, would keep ``k``.

    Raises:
        ValueError: ``k`` or ``chunk_size`` not a positive int, or ``k > chunk_size``.
    """
    check("k", k, POSITIVE_INT)
    check("chunk_size", chunk_size, POSITIVE_INT)
    check("k", k, RANGE, low=1, high=chunk_size, where=" (values sent of each chunk of ``chunk_size``)")

    def encode(x: torch.Tensor) -> Payload:
        count, length, kept, bits = _chunks(x.numel(), k, chunk_size)
        rows = torch.nn.functional.pad(x, (0, count * length - x.numel())).view(count, length)
        top = rows.abs().topk(kept, dim=1)  # (sorted: the larger half first, zeros last)
        sent = top.values != 0  # (an inf or NaN is sent)
        nonzero = sent.sum(1, keepdim=True)
        upper = torch.arange(kept, device=x.device) < (nonzero + 1) // 2
        magnitudes = top.values.double()
        high = torch.where(upper, magnitudes, 0).sum(1) / upper.sum(1).clamp(min=1)
        lower = sent & ~upper
        low = torch.where(lower.any(1), torch.where(lower, magnitudes, 0).sum(1) / lower.sum(1).clamp(min=1), high)
        negative = rows.gather(1, top.indices) < 0
        indices = torch.where(sent, top.indices, top.indices[:, :1])  # a zero kept: the first index again
        return (_bits_packed(indices.flatten(), bits), _bits_packed(negative.flatten(), 1),
                torch.stack((high, low), dim=1).float())

    def decode(payload: Payload, numel: int) -> torch.Tensor:
        packed, signs, magnitudes = payload
        count, length, kept, bits = _chunks(numel, k, chunk_size)
        indices = _bits_unpacked(packed, bits, count * kept).view(count, kept)
        negative = _bits_unpacked(signs, 1, count * kept).view(count, kept).bool()
        zero = torch.cat((torch.zeros_like(indices[:, :1], dtype=torch.bool), indices[:, 1:] == indices[:, :1]), 1)
        nonzero = kept - zero.sum(1, keepdim=True)
        lower = (torch.arange(kept, device=packed.device) >= (nonzero + 1) // 2).long()
        values = magnitudes.gather(1, lower)
        values = torch.where(zero, 0, torch.where(negative, -values, values))
        rows = magnitudes.new_zeros(count, length).scatter_add(1, indices, values)  # (a zero adds 0 to the first)
        return rows.flatten()[:numel]

    return Compressor(f"chunked_top_k({k}, {chunk_size})", encode, decode, gathered=True)


IS_COMPRESSOR = {"kind": Compressor, "a": "a puredist Compressor (e.g. int8_blocks())"}
"""The bounds of the rule ``INSTANCE`` (or ``INSTANCE_OR_NONE``) for a compressor."""


def check_compressor(compressor: object) -> None:
    """Raise ``TypeError`` unless ``compressor`` is a :class:`Compressor`."""
    check("compressor", compressor, INSTANCE, **IS_COMPRESSOR)
