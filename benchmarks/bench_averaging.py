"""Averaging benchmark: torch's ``average_parameters`` vs puredist's vs a bare
all-reduce of one pre-flattened buffer of the same bytes (alone, and with the
division that makes it a mean), on 2 local Gloo ranks.

Run with ``make bench`` (or
``python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_averaging.py``);
``--device cuda`` (``make bench-gpu``) on GPU tensors, over Gloo or ``--backend nccl``.
Prints per model: median time, ratios, and each method's extra peak memory (host
memory; GPU memory with ``--device cuda``).

At one rank ``average_`` returns at once (the mean of one rank); there the table adds
its body, the staged all-reduce it runs at several ranks, to compare the cost of the
machinery with a bare all-reduce (which NCCL still runs at one rank).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging import utils as torch_utils

import puredist
from puredist._inputs import checked
from _measure import (
    add_device_arguments, device_name, init_distributed, interleaved_medians, mib, peak_extra_bytes,
    peak_extra_device_bytes, return_large_blocks_to_the_os,
)


def make_params(kind: str, layers: int, width: int, seed: int, device: torch.device) -> list[torch.nn.Parameter]:
    """``layers`` weight matrices ``[width, width]`` plus their biases (2 tensors per
    layer); ``mixed``: bf16 weights, fp32 biases."""
    gen = torch.Generator().manual_seed(seed)
    weight_dtype = torch.bfloat16 if kind == "mixed" else torch.float32
    params = []
    for _ in range(layers):
        params.append(torch.nn.Parameter(torch.randn(width, width, generator=gen).to(device, weight_dtype)))
        params.append(torch.nn.Parameter(torch.randn(width, generator=gen).to(device)))
    return params


def averaging_methods(kind: str, layers: int, width: int, device: torch.device) -> tuple[dict, list[torch.Tensor], int]:
    """The ways to average this rank's parameters of the given model."""
    params = make_params(kind, layers, width, seed=dist.get_rank(), device=device)
    # torch's own copy: average_parameters rebinds p.data to a new buffer at every call, which
    # would make every call of puredist's a first one (new storage: checked and planned anew)
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    model_bytes = sum(p.numel() * p.element_size() for p in params)
    flat = torch.zeros(model_bytes // 4, dtype=torch.float32, device=device)
    collective = puredist.DistributedCollective()
    world = dist.get_world_size()
    methods = {
        "bare all_reduce": lambda: dist.all_reduce(flat),
        "bare all_reduce + division": lambda: (dist.all_reduce(flat), flat.div_(world)),
        "torch average_parameters": lambda: torch_utils.average_parameters(iter(torch_params), dist.group.WORLD),
        "puredist average_": lambda: puredist.average_(params, collective=collective),
    }
    if dist.get_world_size() == 1:  # what mean_ runs at several ranks: the checks (per layout), the rank check, the buckets
        methods["puredist body (1 rank)"] = lambda: collective._average_over(
            collective.process_group, checked(params), async_op=False, context="")
    return methods, params, collective._pool.capacity(device)


def peak_memory_of(methods: dict, device: torch.device) -> dict[str, int]:
    """Each method's extra peak memory, measured after a warm-up call (Gloo's own
    buffers for this size are not the method's cost)."""
    memory = {}
    for name, fn in methods.items():
        fn()
        dist.barrier()
        memory[name] = peak_extra_device_bytes(fn) if device.type == "cuda" else peak_extra_bytes(fn)
    return memory


def report(kind: str, params, cap: int, times: dict[str, float], memory: dict[str, int]) -> None:
    numel = sum(p.numel() for p in params)
    model_bytes = sum(p.numel() * p.element_size() for p in params)
    print(f"\n{kind}: {numel / 1e6:.1f}M parameters in {len(params)} tensors, {mib(model_bytes)}, "
          f"on {device_name(params[0].device)}, backend {dist.get_backend()}, "
          f"world size {dist.get_world_size()}, bucket cap {mib(cap)} "
          "(puredist keeps it as its staging pool between calls: not in 'extra peak')")
    bare, torch_time = times["bare all_reduce"], times["torch average_parameters"]
    divided = times["bare all_reduce + division"]
    print(f"  {'method':26s} {'median':>10s} {'vs bare':>8s} {'vs bare+div':>12s} {'vs torch':>9s} {'extra peak':>13s}")
    for name, seconds in times.items():
        print(f"  {name:26s} {seconds * 1e3:8.1f}ms {seconds / bare:7.2f}x {seconds / divided:11.2f}x "
              f"{seconds / torch_time:8.2f}x {mib(memory[name])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=40, help="weight matrices (2 tensors each)")
    parser.add_argument("--width", type=int, default=866, help="matrix side: 40 x 866^2 is about 30M parameters")
    parser.add_argument("--repeats", type=int, default=11)
    add_device_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = init_distributed(args)
    models = {kind: averaging_methods(kind, args.layers, args.width, device) for kind in ("fp32", "mixed")}
    times = {kind: interleaved_medians(methods, args.repeats) for kind, (methods, _, _) in models.items()}
    # Memory last: the fixed mmap threshold it needs would slow down allocations.
    return_large_blocks_to_the_os()
    memory = {kind: peak_memory_of(methods, device) for kind, (methods, _, _) in models.items()}
    if dist.get_rank() == 0:
        for kind, (_, params, cap) in models.items():
            report(kind, params, cap, times[kind], memory[kind])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
