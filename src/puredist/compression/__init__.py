"""Averaging with compressed payloads and error feedback, as pure state.

A :class:`Compressor` turns a flat fp32 tensor into a small payload and back:

- :func:`int8_blocks` / :func:`int4_blocks` / :func:`int2_blocks`: block-wise absmax
  quantization, one fp32 scale per block of ``block_size`` values (int4: two values a
  byte, int2: four, at 4 levels without a zero). Per element, ``|x - decode(encode(x))|
  <= absmax(block) / (2 * levels)`` (levels: 127, 7, 1.5; for scales in fp32's normal
  range: a block of subnormals rounds coarser); a block holding an inf or NaN has a
  non-finite scale, so decodes non-finite.
- :func:`top_k`: the ``ceil(fraction * n)`` values of largest magnitude and their
  indices (int32); the rest are sent as zeros.
- :func:`chunked_top_k`: SparseLoCo's payload, the ``k`` largest of each chunk of
  ``chunk_size`` values as small indices, a sign bit each and two magnitudes a chunk
  (1/146 of fp32's bytes at 64 of 4096); averaged by gathering (below).

:func:`compressed_averager` averages a parameter (or pseudo-gradient) pytree over the
``W`` ranks with those payloads, in two phases, like a reduce-scatter then an all-gather:
every rank adds its error-feedback residual ``e`` to its tensor (``v = x + e``) and cuts
it into ``W`` equal chunks; rank ``c`` owns chunk ``c``.

1. Every rank sends chunk ``c`` compressed to its owner (an all-to-all); the owner
   decodes them and takes the mean ``m_c`` (summed in rank order in fp64, rounded to
   fp32 once), its own chunk exact.
2. Every owner compresses ``m_c`` and sends it to all (an all-gather); every rank
   decodes every chunk: the same result, bit for bit, on every rank.

What a rank's chunks lost in phase 1 is its next residual there; what ``m_c`` lost in
phase 2, times ``W``, is the owner's next residual on chunk ``c`` (which it sends exact
next time). So the result is ``(1/W) sum_r (x_r + e_r - e_r')`` and error feedback
telescopes: ``sum_t result_t + (1/W) sum_r e_r,T = sum_t (1/W) sum_r x_r,t``. At fp32's
edge it would not: the owner's residual is computed in fp64 and rounded to fp32 once,
and where ``W`` times what phase 2 lost exceeds fp32's largest value (a dropped mean
entry above ``FLT_MAX / W``, as top-k can drop; half a step of a block near fp32's
largest, from ``W = 4`` for 2-bit values, 15 for 4-bit, 255 for int8) the owner marks its phase-2
payload (NaN in its floating-point tensors), and every rank refuses the step
(``ValueError``, nothing changed; under ``vmap`` the means are non-finite there, as for
an inf given). The residuals are the state (checkpoint them with the rest). All of this is in fp32: leaves
of other float dtypes enter as fp32 and their means are cast back, so what that cast
loses (a 16-bit leaf's rounding, an fp64 leaf's digits beyond fp32's) is outside the
feedback.

A compressor whose payloads are sparse (:attr:`Compressor.gathered`: the mean of ``W``
sparse payloads is not sparse, and compressed again by its owner would lose most of
itself) and any compressor over a torchft quorum (:class:`puredist.ft.ManagerCollective`,
whose members change between calls: no fixed chunk owners) take one phase instead:
every rank's whole row, compressed, is gathered by all, and each decodes the rows and
takes their mean in rank (quorum) order, the same bits everywhere (``W - 1`` payloads
per rank). A row's residual is what its payload lost, so error feedback telescopes as
above, and no residual can exceed fp32's range.

Bytes on the wire per rank: ``2 (W - 1) / W`` payloads of the whole tensor, as a ring
all-reduce sends ``2 (W - 1) / W`` tensors: the format's ratio (payload of ``n`` floats:
int8 ``n + 4 n / block_size``, int4 ``n / 2 + 4 n / block_size``, int2 ``n / 4 + 4 n /
block_size``, top-k ``8 k``; top-k selects within each chunk); gathered, ``W - 1``
payloads per rank (chunked top-k: ``k (bits + 1) / 8 + 8`` bytes a chunk, ``bits`` the
index's, 12 for chunks of 4096).

One concern a module: :mod:`puredist.compression.codecs` (the codes),
:mod:`puredist.compression.phases` (how payloads travel and are averaged),
:mod:`puredist.compression.averager` (the leaves, their residuals, the checks, the
averager). This package only re-exports; it must not keep state between calls:
residuals go in and out explicitly.
"""

from puredist.compression.averager import (
    CompressedAverager,
    CompressionState,
    compressed_averager,
    compressed_mean,
    compressed_mean_flat_,
)
from puredist.compression.codecs import (
    Compressor,
    check_compressor,
    chunked_top_k,
    int2_blocks,
    int4_blocks,
    int8_blocks,
    top_k,
)

__all__ = [
    "CompressedAverager",
    "CompressionState",
    "Compressor",
    "compressed_averager",
    "chunked_top_k",
    "compressed_mean",
    "int2_blocks",
    "int4_blocks",
    "int8_blocks",
    "top_k",
]
