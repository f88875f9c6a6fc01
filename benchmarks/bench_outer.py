"""DiLoCo benchmark on 2 local Gloo ranks: wall time and bytes sent per
synchronization of outer Nesterov SGD on bf16 pseudo-gradients, against periodic
averaging in fp32 (and DiLoCo in fp32), in one run. Run with ``make bench`` (or
``python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_outer.py``).

Bytes are measured: this process's ``wchar`` (``/proc/self/io``) around each call
(Gloo's sockets; NCCL's transfers are not seen). Per training step divide by the period
(``--period``).

``--device cuda`` (``make bench-gpu``) keeps the parameters on a GPU, over Gloo or
``--backend nccl``, and adds DiLoCo with its global copy and outer state in pinned host
memory (``global_device="cpu"``: no GPU memory for them) against the same on the GPU.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import puredist
from _measure import add_device_arguments, device_name, init_distributed, interleaved_medians, mib
from puredist.demo.wire import bytes_written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--width", type=int, default=866, help="40 x 866^2 is about 30M parameters")
    parser.add_argument("--period", type=int, default=50, help="inner steps per synchronization, for the per-step figures")
    parser.add_argument("--repeats", type=int, default=7)
    add_device_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = init_distributed(args)
    rank = dist.get_rank()
    collective = puredist.DistributedCollective()

    def model():
        gen = torch.Generator().manual_seed(0)
        return [torch.randn(args.width, args.width, generator=gen).to(device) for _ in range(args.layers)]

    nesterov = puredist.sgd(lr=0.7, momentum=0.9, nesterov=True)
    runs = {
        "periodic averaging fp32": (puredist.periodic_averager(2), model()),
        "DiLoCo fp32": (puredist.outer_optimizer(nesterov, sync_every=1), model()),
        "DiLoCo bf16 pseudo-grads": (puredist.outer_optimizer(nesterov, sync_every=1, comm_dtype=torch.bfloat16), model()),
    }
    if device.type == "cuda":
        runs["DiLoCo fp32, host copy"] = (puredist.outer_optimizer(nesterov, sync_every=1, global_device="cpu"), model())
    states = {name: transform.init(params) for name, (transform, params) in runs.items()}
    sent = {name: [] for name in runs}

    def sync(name):
        transform, params = runs[name]
        for p in params:  # a local step happened: the ranks differ
            p.add_(0.01 * (rank + 1))
        if name.startswith("periodic"):
            states[name] = states[name]._replace(step=0)  # step 0 is an averaging step
        start = bytes_written()
        states[name] = transform.update_(params, states[name], collective=collective)
        sent[name].append(bytes_written() - start)

    times = interleaved_medians({name: (lambda name=name: sync(name)) for name in runs}, args.repeats)
    if rank == 0:
        numel = args.layers * args.width**2
        print(f"\n{numel / 1e6:.1f}M fp32 parameters, world size {dist.get_world_size()}, on {device_name(device)}, "
              f"backend {dist.get_backend()}, one synchronization per call")
        base = times["periodic averaging fp32"]
        base_bytes = min(sent["periodic averaging fp32"])
        print(f"  {'method':26s} {'sync time':>10s} {'vs periodic':>12s} {'sent/sync':>12s} {'vs periodic':>12s} "
              f"{'sent/step (H=' + str(args.period) + ')':>18s}")
        for name, seconds in times.items():
            nbytes = min(sent[name])
            relative = f"{nbytes / base_bytes:11.2f}x" if base_bytes else f"{'n/a':>12s}"  # NCCL's bytes are not seen
            print(f"  {name:26s} {seconds * 1e3:8.1f}ms {seconds / base:11.2f}x {mib(nbytes)} {relative} "
                  f"{mib(nbytes / args.period):>18s}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
