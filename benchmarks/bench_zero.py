"""ZeRO benchmark on 2 local Gloo ranks, Adam: time per iteration of DDP + Adam,
torch's ZeroRedundancyOptimizer (not overlapped) and puredist's ZeRO overlapped with
DDP (both hooks); optimizer-state bytes per rank and collective payload per
iteration. Run with ``make bench`` (or
``python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_zero.py``).

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

from _measure import interleaved_medians, mib
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
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    inputs = torch.randn(args.batch, args.width, generator=gen)
    targets = torch.randn(args.batch, args.width, generator=gen)

    def iteration(model, optimizer, overlapped):
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        if not overlapped:
            optimizer.step()
        optimizer.zero_grad()

    runs = {}
    model = DDP(make_model(args.layers, args.width))
    runs["DDP + Adam"] = (model, torch.optim.Adam(model.parameters(), lr=1e-4), False)
    model = DDP(make_model(args.layers, args.width))
    runs["torch ZeRO (no overlap)"] = (model, TorchZero(model.parameters(), torch.optim.Adam, lr=1e-4), False)
    for name, wrap in (("puredist ZeRO overlap", hook_with_zero_step), ("puredist ZeRO interleaved", hook_with_zero_step_interleaved)):
        model = DDP(make_model(args.layers, args.width))
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=1e-4)
        model.register_comm_hook(None, wrap(allreduce_hook, model, zero))
        runs[name] = (model, zero, True)

    methods = {name: (lambda run=run: iteration(*run)) for name, run in runs.items()}
    for fn in methods.values():  # first steps create the unsharded optimizers' state
        fn()
    times = interleaved_medians(methods, args.repeats)

    param_bytes = sum(p.numel() * p.element_size() for p in runs["DDP + Adam"][0].parameters())
    full_state = state_bytes(s.values() for s in runs["DDP + Adam"][1].state.values())
    torch_state = state_bytes(s.values() for s in runs["torch ZeRO (no overlap)"][1].optim.state.values())
    ours_state = state_bytes(runs["puredist ZeRO overlap"][1].zero_state.owned)
    state = {
        "DDP + Adam": full_state,
        "torch ZeRO (no overlap)": torch_state,
        "puredist ZeRO overlap": ours_state,
        "puredist ZeRO interleaved": state_bytes(runs["puredist ZeRO interleaved"][1].zero_state.owned),
    }
    # Collective payload per iteration: DDP all-reduces every gradient; both ZeROs add
    # one broadcast of every parameter from its owner (torch's overlap would too).
    payload = {name: param_bytes * (1 if name == "DDP + Adam" else 2) for name in runs}
    states = torch.tensor([state[name] for name in runs], dtype=torch.float64)
    gathered = [torch.empty_like(states) for _ in range(world_size)]
    dist.all_gather(gathered, states)
    worst_state = torch.stack(gathered).max(0).values.tolist()

    if rank == 0:
        numel = sum(p.numel() for p in runs["DDP + Adam"][0].parameters())
        print(f"\n{numel / 1e6:.1f}M parameters ({mib(param_bytes)}), Adam, batch {args.batch}, world size {world_size}")
        base = times["DDP + Adam"]
        print(f"  {'method':28s} {'iteration':>10s} {'vs DDP':>7s} {'state/rank (max)':>18s} {'vs full':>8s} {'payload':>13s}")
        for (name, seconds), worst in zip(times.items(), worst_state):
            print(f"  {name:28s} {seconds * 1e3:8.1f}ms {seconds / base:6.2f}x {mib(worst):>18s} "
                  f"{worst / full_state:7.2f}x {mib(payload[name])}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
