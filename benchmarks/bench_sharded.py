"""Sharded against unsharded, on 4 local Gloo ranks in one run: 2 replica groups of a
~10M-parameter model, either FSDP2-sharded over 2 ranks per group (``fully_shard``,
DTensor parameters) or whole on every rank (plain tensors). The same replica groups
average (``average_`` over ``from_mesh(mesh, "replicate")``) and run one DiLoCo
synchronization; reported per rank: median time, bytes sent (measured) and the DiLoCo
state it holds (global copy and outer momentum). Run with ``make bench`` (or
``python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/bench_sharded.py``).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import puredist
from _measure import interleaved_medians, mib
from puredist.demo.wire import bytes_written


def make_model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--width", type=int, default=1000, help="10 x 1000^2 is about 10M parameters")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world_size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    collective = puredist.DistributedCollective.from_mesh(mesh, "replicate")

    whole = {n: p.detach() for n, p in make_model(args.layers, args.width).named_parameters()}
    sharded_model = make_model(args.layers, args.width)
    for layer in sharded_model:
        fully_shard(layer, mesh=mesh["shard"])
    sharded = dict(sharded_model.named_parameters())

    def outer():
        return puredist.outer_optimizer(puredist.sgd(lr=0.7, momentum=0.9, nesterov=True), sync_every=1)

    transforms = {"whole": outer(), "sharded": outer()}
    states = {"whole": transforms["whole"].init(whole), "sharded": transforms["sharded"].init(sharded)}

    def sync(name, params):
        def run():
            with torch.no_grad():
                states[name] = transforms[name].update_(params, states[name], collective=collective)
        return run

    methods = {
        "average_ whole": lambda: puredist.average_(whole, collective=collective),
        "average_ sharded": lambda: puredist.average_(sharded, collective=collective),
        "DiLoCo sync whole": sync("whole", whole),
        "DiLoCo sync sharded": sync("sharded", sharded),
    }
    sent = {}
    for name, fn in methods.items():
        before = bytes_written()
        fn()
        sent[name] = bytes_written() - before
    times = interleaved_medians(methods, args.repeats)

    def state_bytes(state) -> int:
        tensors = [*state.global_params, *(s.momentum_buffer for s in state.outer_state if s.momentum_buffer is not None)]
        return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)

    if dist.get_rank() == 0:
        count = sum(p.numel() for p in whole.values())
        print(f"{world_size} Gloo ranks, 2 replica groups; {count / 1e6:.1f}M fp32 parameters")
        print(f"{'what':22s} {'median':>9s} {'vs whole':>9s} {'sent/rank':>10s}")
        for name in methods:
            base = name.replace("sharded", "whole")
            print(f"{name:22s} {1000 * times[name]:7.1f}ms {times[name] / times[base]:8.2f}x {mib(sent[name]):>10s}")
        for name in ("whole", "sharded"):
            print(f"DiLoCo state per rank, {name:7s} {mib(state_bytes(states[name]))}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
