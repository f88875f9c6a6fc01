"""Small models and deterministic per-rank drift for the multi-process tests."""

import torch
from torch import nn


def make_model(seed: int, kind: str = "fp32") -> nn.Module:
    """A small MLP with a norm layer; ``kind`` is fp32, fp64 or mixed (bf16 linears,
    fp32 norm)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.LayerNorm(12), nn.Linear(12, 3))
    if kind == "fp64":
        model.double()
    elif kind == "mixed":
        model[0].bfloat16()
        model[2].bfloat16()
    return model


def drift_(params, rank: int, step: int) -> None:
    """A stand-in for a local optimizer step: add rank- and step-dependent noise and
    give every parameter a ``.grad`` (so torch's filter keeps it)."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
            p.grad = torch.zeros_like(p)
