"""ZeRO benchmark on 2 local Gloo ranks, for Adam (which torch's overlap hooks
support) and RMSprop: time per iteration of DDP + the plain optimizer, torch's
ZeroRedundancyOptimizer (not overlapped), puredist's not overlapped and overlapped
with DDP (both hooks), each against DDP with the same optimizer in the same run;
optimizer-state bytes per rank and collective payload per iteration. Run with ``make bench`` (or
``python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_zero.py``);
``--device cuda`` (``make bench-gpu``) on a GPU, over Gloo or ``--backend nccl``.

torch's own overlap hooks refuse Gloo ("may meet hangs"), so they are not in the table.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

from _measure import add_device_arguments, device_name, init_distributed, interleaved_medians, mib
from puredist.classic import ZeroRedundancyOptimizer, hook_with_zero_step, hook_with_zero_step_interleaved


def make_model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks)


def state_bytes(states) -> int:
    return sum(t.numel() * t.element_size() for s in states for t in s if torch.is_tensor(t))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=2048, help="6 layers of 2048^2: ~25M parameters")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=9)
    add_device_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = init_distributed(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    inputs = torch.randn(args.batch, args.width, generator=gen).to(device)
    targets = torch.randn(args.batch, args.width, generator=gen).to(device)

    def iteration(model, optimizer, overlapped):
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        if not overlapped:
            optimizer.step()
        optimizer.zero_grad()

    def built(wrap=None, **zero_kwargs):
        model = DDP(make_model(args.layers, args.width).to(device))
        if wrap is None:
            return model
        zero = ZeroRedundancyOptimizer(model.parameters(), zero_kwargs.pop("optimizer_class"), **zero_kwargs)
        model.register_comm_hook(None, wrap(allreduce_hook, model, zero))
        return model, zero

    runs = {}  # name: (model, optimizer, overlapped, the DDP run it is compared to)
    for family, optimizer_class in (("Adam", torch.optim.Adam), ("RMSprop", torch.optim.RMSprop)):
        baseline = f"DDP + {family}"
        model = built()
        runs[baseline] = (model, optimizer_class(model.parameters(), lr=1e-4), False, baseline)
        model = built()
        runs[f"torch ZeRO {family}"] = (model, TorchZero(model.parameters(), optimizer_class, lr=1e-4), False, baseline)
        model = built()
        runs[f"puredist ZeRO {family}"] = (
            model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class, lr=1e-4), False, baseline)
        for kind, wrap in (("overlap", hook_with_zero_step), ("interleaved", hook_with_zero_step_interleaved)):
            model, zero = built(wrap, optimizer_class=optimizer_class, overlap_with_ddp=True, lr=1e-4)
            runs[f"puredist ZeRO {family} {kind}"] = (model, zero, True, baseline)

    methods = {name: (lambda run=run: iteration(*run[:3])) for name, run in runs.items()}
    for fn in methods.values():  # first steps create the optimizers' state
        fn()
    times = interleaved_medians(methods, args.repeats)

    def local_state(optimizer) -> int:
        held = optimizer.optim.state if hasattr(optimizer, "optim") else optimizer.state
        return state_bytes(s.values() for s in held.values())

    param_bytes = sum(p.numel() * p.element_size() for p in runs["DDP + Adam"][0].parameters())
    # Collective payload per iteration: DDP all-reduces every gradient; every ZeRO adds
    # one broadcast of every parameter from its owner.
    payload = {name: param_bytes * (1 if name.startswith("DDP") else 2) for name in runs}
    states = torch.tensor([local_state(run[1]) for run in runs.values()], dtype=torch.float64)
    gathered = [torch.empty_like(states) for _ in range(world_size)]
    dist.all_gather(gathered, states)
    worst_state = dict(zip(runs, torch.stack(gathered).max(0).values.tolist()))

    if rank == 0:
        numel = sum(p.numel() for p in runs["DDP + Adam"][0].parameters())
        print(f"\n{numel / 1e6:.1f}M parameters ({mib(param_bytes)}), batch {args.batch}, world size {world_size}, "
              f"on {device_name(device)}, backend {dist.get_backend()}")
        print(f"  {'method':34s} {'iteration':>10s} {'vs DDP':>7s} {'state/rank (max)':>18s} {'vs full':>8s} {'payload':>13s}")
        for name, (_, _, _, baseline) in runs.items():
            print(f"  {name:34s} {times[name] * 1e3:8.1f}ms {times[name] / times[baseline]:6.2f}x "
                  f"{mib(worst_state[name]):>18s} {worst_state[name] / worst_state[baseline]:7.2f}x {mib(payload[name])}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
